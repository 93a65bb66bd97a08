from __future__ import annotations

import click

from hvtrain.backends.registry import BACKENDS


@click.command()
@click.option("--backend", type=click.Choice(list(BACKENDS)), default="torch", show_default=True,
              help="The backend that must be able to run (exit 1 if not).")
def doctor(backend: str) -> None:
    """Print the environment hvtrain runs in; fail when BACKEND cannot run."""
    from hvtrain.tools.doctor import collect

    report = collect()
    for section, rows in report.sections.items():
        click.echo(f"{section}:")
        for key, value in rows.items():
            click.echo(f"  {key:<22} {value}")
    for w in report.warnings:
        click.echo(f"warning: {w}", err=True)
    problems = report.problems(backend)
    for p in problems:
        click.echo(f"problem: {p}", err=True)
    if problems:
        raise SystemExit(1)
    click.echo(f"ok: backend {backend!r} can run")
