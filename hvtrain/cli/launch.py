from __future__ import annotations

import shlex
import sys

import click

_COMMAND = "hvtrain.launch.command"


class _SplitAtDashes(click.Command):
    """`hvtrain launch [OPTIONS] [LAUNCHER OPTIONS] -- COMMAND...`: the first `--` ends the launch
    options; click would drop it and run an option meant for mpirun (`--oversubscribe`) inside
    every rank's command (`python -m hvtrain --oversubscribe train ...`)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            ctx.meta[_COMMAND] = args[args.index("--") + 1:]
            args = args[:args.index("--")]
        return super().parse_args(ctx, args)


@click.command(cls=_SplitAtDashes, context_settings={"ignore_unknown_options": True})
@click.option("-np", "--num-proc", "np", type=int, help="Number of ranks (default: every slot of the hosts).")
@click.option("--hostfile", type=str, help="Hostfile: 'host slots=N', 'host:N' or 'host' per line.")
@click.option("-H", "--hosts", type=str,
              help="host1:N,host2:N (default: the Slurm/PBS/LSF allocation, else localhost:NP).")
@click.option("--launcher", type=click.Choice(["horovodrun", "mpirun", "srun"]), default="horovodrun",
              show_default=True, help="srun: inside a Slurm allocation, where mpirun is not allowed.")
@click.option("--gloo", is_flag=True, help="horovodrun: Gloo controller instead of MPI.")
@click.option("--dry-run", is_flag=True, help="Print the command, do not run it.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def launch(np: int | None, hostfile: str | None, hosts: str | None, launcher: str, gloo: bool, dry_run: bool,
           args: tuple[str, ...]) -> None:
    """Start `hvtrain ARGS...` on NP ranks: hvtrain launch -np 2 -- train CONFIG. Options hvtrain
    does not know, before the `--`, go to the launcher: hvtrain launch --launcher mpirun -np 4
    --oversubscribe -- train CONFIG."""
    from hvtrain.launch import execute

    command, extra = _command_and_extra(list(args))
    p = execute.plan(np, command, launcher, hostfile, hosts, gloo, extra)
    click.echo(shlex.join(p.argv), err=not dry_run)
    if p.hostfile_text is not None and dry_run:
        click.echo(f"# <hostfile>:\n{p.hostfile_text}", nl=False)
    if dry_run:
        return
    sys.exit(execute.run(p))


def _command_and_extra(args: list[str]) -> tuple[list[str], list[str]]:
    """(the hvtrain command, the launcher's own options). Without `--` the command starts at the
    first word, and an unknown option before it is refused: whether the words after it are its
    values or the command cannot be told (`--mca btl tcp train CONFIG`)."""
    from hvtrain.errors import LaunchError

    command = click.get_current_context().meta.get(_COMMAND)
    if command is None:
        if args and args[0].startswith("-"):
            raise LaunchError(f"{args[0]}: not an hvtrain launch option; a launcher's own options go before `--`:"
                              f" hvtrain launch [OPTIONS] {args[0]} ... -- train CONFIG")
        command, extra = args, []
    else:
        extra = args
        if extra and not extra[0].startswith("-"):
            raise LaunchError(f"{extra[0]!r} before `--`: expected launcher options there and the hvtrain "
                              "command after it (hvtrain launch -np 2 -- train CONFIG)")
    if not command:
        raise LaunchError("expected the hvtrain command to run on every rank, e.g. hvtrain launch -np 2 -- "
                          "train CONFIG")
    return command, extra
