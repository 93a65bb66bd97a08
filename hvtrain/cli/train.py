from __future__ import annotations

import click

from hvtrain.backends.registry import BACKENDS


@click.command()
@click.argument("config")
@click.option("--backend", type=click.Choice(list(BACKENDS)), help="Overrides the config's backend.")
@click.option("--output-dir", help="Overrides the config's output_dir.")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Override a config value (repeatable), e.g. --set train.epochs=5.")
@click.option("--resume", metavar="auto|PATH",
              help="Continue from a checkpoint: the newest one in output_dir that verifies (auto), or PATH.")
@click.option("--elastic", is_flag=True,
              help="Horovod elastic (under horovodrun --min-np/--max-np/--host-discovery-script).")
@click.option("--quiet", is_flag=True, help="No progress output.")
def train(config: str, backend: str | None, output_dir: str | None, overrides: tuple[str, ...],
          resume: str | None, elastic: bool, quiet: bool) -> None:
    """Train CONFIG on this process's ranks (alone, or under horovodrun/mpirun)."""
    from hvtrain.training.preempt import StopSignals

    # First of all (before the config, the data, the framework and Horovod): a pre-emption notice
    # during start-up is recorded, and the run stops before its first step, exit 75, instead of
    # dying of the signal. Elastic runs keep the default handlers (Horovod elastic restarts them).
    with StopSignals(enabled=not elastic) as signals:
        from hvtrain.training.entry import train as run

        run(config, backend, output_dir, overrides, quiet=quiet, resume=resume, elastic=elastic, signals=signals)
