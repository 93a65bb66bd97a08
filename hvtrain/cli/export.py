from __future__ import annotations

import click

from hvtrain.backends.registry import BACKENDS, EXPORT_FORMATS


@click.command()
@click.argument("config")
@click.option("--weights", required=True, help="A final.safetensors (any backend) or a checkpoint; carries the "
              "training normalisation, which becomes part of the exported graph.")
@click.option("--format", "fmt", required=True, type=click.Choice(sorted({f for fs in EXPORT_FORMATS.values()
                                                                          for f in fs})),
              help="onnx (torch or tensorflow), savedmodel (tensorflow), torchscript (torch).")
@click.option("-o", "--output", required=True, metavar="PATH", help="The artefact (a directory for savedmodel).")
@click.option("--backend", type=click.Choice(list(BACKENDS)),
              help="The framework that exports (default: the config's if it writes FORMAT, else the one that does).")
@click.option("--input", "input_path", metavar="X.npy|X.csv",
              help="Raw rows to verify on instead of the config's validation split (needed when its data is "
                   "not available here).")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a config value.")
def export(config: str, weights: str, fmt: str, output: str, backend: str | None, input_path: str | None,
           overrides: tuple[str, ...]) -> None:
    """Export CONFIG's model with WEIGHTS as ONNX, a SavedModel or TorchScript, taking the raw rows
    `hvtrain predict` takes and giving what it gives; verified on the spot against the framework's
    predictions (max difference, relative above 1 in magnitude, <= 1e-4, else nothing is left at
    PATH and the command fails)."""
    from hvtrain.tools.export import export_model

    r = export_model(config, weights, fmt, output, backend, input_path, overrides)
    click.echo(f"exported {r['format']} ({r['backend']}) -> {r['path']}: input {r['input']['name']} "
               f"{r['input']['shape']} {r['input']['dtype']} (raw rows), output {r['output']}; verified on "
               f"{r['verified_on']}: max difference (relative above 1) {r['max_difference']:.2g} <= "
               f"{r['tolerance']:g}")
