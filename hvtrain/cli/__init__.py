"""`hvtrain` click group. Commands are thin: parse options, call one library function."""

from __future__ import annotations

import sys

if sys.argv[1:2] == ["train"] and "--elastic" not in sys.argv:  # `hvtrain` and `python -m hvtrain` alike
    # First of all, before click and the commands are imported (~50 ms): a pre-emption notice from
    # here on is recorded, not fatal (hvtrain.training.preempt).
    from hvtrain.training.preempt import record_from_start

    record_from_start()

import click  # noqa: E402

from hvtrain.errors import HvtrainError  # noqa: E402
from hvtrain.version import __version__  # noqa: E402


class _Group(click.Group):
    """Maps HvtrainError to one line on stderr and its exit code (2): no traceback."""

    def invoke(self, ctx: click.Context):
        from hvtrain.errors import Preempted

        try:
            return super().invoke(ctx)
        except Preempted as exc:  # rank 0 said where it stopped; every rank exits with the documented code
            ctx.exit(exc.exit_code)
        except HvtrainError as exc:
            _report_error(str(exc))
            ctx.exit(exc.exit_code)


def _report_error(message: str) -> None:
    # Under a launcher every rank speaks for itself: the rank whose input is bad (a file missing
    # on its node) says so, and exits non-zero, which ends the job.
    from hvtrain.launch.process import launch_rank

    where = launch_rank()
    prefix = f"rank {where[0]} of {where[1]}: " if where and where[1] > 1 else ""
    click.echo(f"hvtrain: error: {prefix}{message}", err=True)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hvtrain")
def cli() -> None:
    """Train one experiment config under PyTorch or TensorFlow with Horovod."""


def _register() -> None:
    from hvtrain.cli import doctor, evaluate, export, hosts, launch, plan, predict, report, train

    cli.add_command(train.train)
    cli.add_command(evaluate.evaluate)
    cli.add_command(predict.predict)
    cli.add_command(export.export)
    cli.add_command(report.report)
    cli.add_command(launch.launch)
    cli.add_command(hosts.hosts)
    cli.add_command(doctor.doctor)
    cli.add_command(plan.plan)


_register()


def main() -> None:
    sys.exit(cli.main(prog_name="hvtrain", standalone_mode=True))
