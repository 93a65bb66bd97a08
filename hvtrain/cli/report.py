from __future__ import annotations

import click


@click.command()
@click.argument("run_dir")
@click.option("-o", "--output", "out_dir", metavar="DIR",
              help="Where the PNGs and report.md go (default RUN_DIR/report).")
def report(run_dir: str, out_dir: str | None) -> None:
    """Pictures of a training run (loss, metrics, confusion matrix, ROC curve, world size) and a
    report.md embedding them, from the files in RUN_DIR; imports no training framework."""
    from hvtrain.tools.report import write_report

    result = write_report(run_dir, out_dir)
    click.echo(f"report: {result['report']} ({', '.join(f'{k}.png' for k in result['figures']) or 'no pictures'})")
    for note in result["missing"]:
        click.echo(f"  not shown: {note}")
