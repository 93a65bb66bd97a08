from __future__ import annotations

import click

from hvtrain.backends.registry import BACKENDS


@click.command()
@click.argument("config")
@click.option("--weights", required=True, help="A final.safetensors from any backend (neutral layout).")
@click.option("--backend", type=click.Choice(list(BACKENDS)), help="Overrides the config's backend.")
@click.option("--output-dir", help="Where eval.json goes (default: the config's output_dir).")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a config value.")
def evaluate(config: str, weights: str, backend: str | None, output_dir: str | None,
             overrides: tuple[str, ...]) -> None:
    """Validation metrics of WEIGHTS on CONFIG's data; reduced across ranks when launched on several."""
    from hvtrain.training.entry import evaluate as run

    run(config, weights, backend, output_dir, overrides)
