from __future__ import annotations

import click


@click.group()
def hosts() -> None:
    """Hostfile tools."""


@hosts.command("check")
@click.argument("hostfile")
@click.option("-np", "--num-proc", "np", type=int, help="Also check that NP ranks fit in the slots.")
def check(hostfile: str, np: int | None) -> None:
    """Parse HOSTFILE and print hosts, slots and the total."""
    from hvtrain.launch.builders import check_slots
    from hvtrain.launch.hostfile import parse_hostfile, total_slots

    records = parse_hostfile(hostfile)
    width = max(len(r.host) for r in records)
    for r in records:
        extra = f" max_slots={r.max_slots}" if r.max_slots else ""
        click.echo(f"{r.host:<{width}}  slots={r.slots}{extra}  ({r.where})")
    click.echo(f"total: {len(records)} host(s), {total_slots(records)} slot(s)")
    if np is not None:
        check_slots(np, records)
        click.echo(f"ok: -np {np} fits")
