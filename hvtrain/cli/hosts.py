from __future__ import annotations

import click


@click.group()
def hosts() -> None:
    """Hostfiles and scheduler allocations."""


@hosts.command("check")
@click.argument("hostfile", required=False)
@click.option("-np", "--num-proc", "np", type=int, help="Also check that NP ranks fit in the slots.")
def check(hostfile: str | None, np: int | None) -> None:
    """Parse HOSTFILE (default: this job's Slurm/PBS/LSF allocation) and print hosts, slots and the
    total; for an allocation, also the scheduler variables read."""
    from hvtrain.launch.builders import check_slots
    from hvtrain.launch.hostfile import parse_hostfile, total_slots
    from hvtrain.launch.scheduler import require

    if hostfile:
        records = parse_hostfile(hostfile)
    else:
        alloc = require()
        records = alloc.hosts
        click.echo(f"{alloc.scheduler} allocation; read: "
                   + ", ".join(f"{k}={v}" for k, v in alloc.variables.items()))
        for note in alloc.notes:
            click.echo(f"  {note}")
    width = max(len(r.host) for r in records)
    for r in records:
        extra = f" max_slots={r.max_slots}" if r.max_slots else ""
        click.echo(f"{r.host:<{width}}  slots={r.slots}{extra}  ({r.where})")
    click.echo(f"total: {len(records)} host(s), {total_slots(records)} slot(s)")
    if np is not None:
        check_slots(np, records)
        click.echo(f"ok: -np {np} fits")


@hosts.command("from-env")
@click.option("--format", "fmt", type=click.Choice(["openmpi", "horovod", "mpich"]), default="openmpi",
              show_default=True, help="openmpi: 'host slots=N' lines; horovod: h:n,h:n; mpich: 'host:N' lines.")
def from_env(fmt: str) -> None:
    """Print this job's Slurm / PBS / LSF allocation as a hostfile (or a Horovod -H list)."""
    from hvtrain.launch.scheduler import render, require

    click.echo(render(require().hosts, fmt), nl=False)
