from __future__ import annotations

import click

from hvtrain.backends.registry import BACKENDS


@click.command()
@click.argument("config")
@click.option("--weights", required=True,
              help="A final.safetensors (any backend) or a checkpoint; carries the training normalisation.")
@click.option("--input", "input_path", required=True, metavar="X.npy|X.csv|TEXTS.txt",
              help="Raw feature rows as the dataset stores them (CSV: a header line, then numbers); for a model "
                   "trained on a text corpus also texts, one per line, encoded by the vocabulary in WEIGHTS.")
@click.option("--output", required=True, metavar="PREDS.npy",
              help="Class probabilities [N, C] (binary: [N, 1], the second class's), or regression outputs; "
                   "its directory must exist.")
@click.option("--logits", is_flag=True, help="Write the model's logits to --output instead of probabilities.")
@click.option("--labels", metavar="LABELS.npy", help="Also write each row's predicted label (the dataset's values).")
@click.option("--batch-size", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Rows per rank per step.")
@click.option("--backend", type=click.Choice(list(BACKENDS)), help="Overrides the config's backend.")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a config value.")
def predict(config: str, weights: str, input_path: str, output: str, logits: bool, labels: str | None,
            batch_size: int, backend: str | None, overrides: tuple[str, ...]) -> None:
    """Predict every row of --input with CONFIG's model and WEIGHTS, in input order; data parallel
    when launched on several ranks (rank 0 writes)."""
    from hvtrain.tools.predict import predict_files

    predict_files(config, weights, input_path, output, labels, logits, batch_size, backend, overrides)
