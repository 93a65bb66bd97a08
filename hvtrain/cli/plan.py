from __future__ import annotations

import click


@click.command()
@click.argument("config")
@click.option("-np", "--num-proc", "np", type=int, required=True, help="World size the plan is for.")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a config value.")
def plan(config: str, np: int, overrides: tuple[str, ...]) -> None:
    """Print the pipeline plan of CONFIG on NP ranks (no training, no framework import)."""
    from hvtrain.placement.plan import describe, make_plan
    from hvtrain.session import prepare

    p = prepare(config, overrides=overrides)
    click.echo(describe(make_plan(p.cfg, p.spec, np), p.spec, p.cfg.data.batch_size))
