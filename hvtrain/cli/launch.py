from __future__ import annotations

import shlex
import sys

import click


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("-np", "--num-proc", "np", type=int, help="Number of ranks (default: every slot of the hosts).")
@click.option("--hostfile", type=str, help="Hostfile: 'host slots=N', 'host:N' or 'host' per line.")
@click.option("-H", "--hosts", type=str,
              help="host1:N,host2:N (default: the Slurm/PBS/LSF allocation, else localhost:NP).")
@click.option("--launcher", type=click.Choice(["horovodrun", "mpirun", "srun"]), default="horovodrun",
              show_default=True, help="srun: inside a Slurm allocation, where mpirun is not allowed.")
@click.option("--gloo", is_flag=True, help="horovodrun: Gloo controller instead of MPI.")
@click.option("--dry-run", is_flag=True, help="Print the command, do not run it.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED, required=True)
def launch(np: int | None, hostfile: str | None, hosts: str | None, launcher: str, gloo: bool, dry_run: bool,
           args: tuple[str, ...]) -> None:
    """Start `hvtrain ARGS...` on NP ranks: hvtrain launch -np 2 -- train CONFIG."""
    from hvtrain.launch import execute

    p = execute.plan(np, list(args), launcher, hostfile, hosts, gloo)
    click.echo(shlex.join(p.argv), err=not dry_run)
    if p.hostfile_text is not None and dry_run:
        click.echo(f"# <hostfile>:\n{p.hostfile_text}", nl=False)
    if dry_run:
        return
    sys.exit(execute.run(p))
