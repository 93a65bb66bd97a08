"""Hostfiles and host lists, parsed once into typed records, rendered per launcher.

Accepted line forms (one host per line; blank lines and `#` comments are skipped):
    node1 slots=4              OpenMPI (optionally `max_slots=N`, N >= slots)
    node1:4                    Horovod / MPICH
    node1                      one slot
Errors name `file:line` and say what was expected, e.g.
    hostfiles/cluster:3: expected 'host slots=N', 'host:N' or 'host', got 'node1 slots='
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hvtrain.errors import HostfileError

# RFC 1123 labels (underscores tolerated, as many clusters use them) or an IPv4 address.
_HOST = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?"
                   r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?)*$")
_EXPECTED = "expected 'host slots=N', 'host:N' or 'host'"


@dataclass(frozen=True)
class HostSlots:
    host: str
    slots: int
    max_slots: int | None = None
    where: str = ""  # file:line (or "-H") for later errors


def validate_host(name: str, where: str) -> str:
    """A host name safe to put in a launcher argv: letters, digits, '-', '_', '.' only."""
    if not _HOST.match(name):
        raise HostfileError(f"{where}: invalid host name {name!r}; expected letters, digits, '-', '_' "
                            "and '.' (an RFC 1123 name or IPv4 address)")
    return name


def _positive(text: str, where: str, what: str, line: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise HostfileError(f"{where}: {what} must be a positive integer, got {line!r}")
    return int(text)


def parse_line(text: str, where: str) -> HostSlots | None:
    """One hostfile line -> record, or None for a blank/comment line."""
    line = text.split("#", 1)[0].strip()
    if not line:
        return None
    tokens = line.split()
    head = tokens[0]
    if len(tokens) == 1 and "=" not in head:
        if ":" in head:
            host, _, slots = head.partition(":")
            if not host or not slots:
                raise HostfileError(f"{where}: {_EXPECTED}, got {line!r}")
            return HostSlots(validate_host(host, where), _positive(slots, where, "slots", line), None, where)
        return HostSlots(validate_host(head, where), 1, None, where)
    options: dict[str, int] = {}
    for token in tokens[1:]:
        key, sep, value = token.partition("=")
        if not sep or key not in ("slots", "max_slots", "max-slots") or not value:
            raise HostfileError(f"{where}: {_EXPECTED}, got {line!r}")
        key = key.replace("-", "_")
        if key in options:
            raise HostfileError(f"{where}: {key} given twice in {line!r}")
        options[key] = _positive(value, where, key, line)
    if ":" in head:
        raise HostfileError(f"{where}: {_EXPECTED}, got {line!r} (mixes host:N and slots=)")
    host = validate_host(head, where)
    slots = options.get("slots", 1)
    max_slots = options.get("max_slots")
    if max_slots is not None and max_slots < slots:
        raise HostfileError(f"{where}: max_slots={max_slots} is less than slots={slots}")
    return HostSlots(host, slots, max_slots, where)


def parse_hostfile(path: str | Path) -> list[HostSlots]:
    """Parse a hostfile; every problem is reported with `file:line`.

    Raises:
        HostfileError: unreadable file, a bad line, a host listed twice, or no hosts.
    """
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise HostfileError(f"{path}: cannot read hostfile ({getattr(exc, 'strerror', None) or exc})") from None
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        record = parse_line(line, f"{path}:{lineno}")
        if record is not None:
            records.append(record)
    return _check(records, str(path))


def parse_hosts(spec: str) -> list[HostSlots]:
    """`-H host1:4,host2:4` (slots default to 1)."""
    records = []
    for item in spec.split(","):
        record = parse_line(item, f"-H {spec}")
        if record is None:
            raise HostfileError(f"-H {spec}: empty host entry; expected host:N[,host:N...]")
        records.append(record)
    return _check(records, f"-H {spec}")


def _check(records: list[HostSlots], source: str) -> list[HostSlots]:
    if not records:
        raise HostfileError(f"{source}: no hosts found (only blank or comment lines)")
    seen: dict[str, str] = {}
    for r in records:
        if r.host in seen:
            raise HostfileError(f"{r.where}: host {r.host!r} is listed twice (first at {seen[r.host]})")
        seen[r.host] = r.where
    return records


def total_slots(hosts: list[HostSlots]) -> int:
    return sum(h.slots for h in hosts)


def render_host_list(hosts: list[HostSlots]) -> str:
    """Horovod `-H` / OpenMPI `-H` / MPICH `-hosts` syntax: `h1:4,h2:4`."""
    return ",".join(f"{h.host}:{h.slots}" for h in hosts)


def render_hostfile(hosts: list[HostSlots], flavour: str) -> str:
    """Hostfile text in the launcher's own syntax (OpenMPI `slots=`, MPICH/Intel `host:N`)."""
    if flavour == "openmpi":
        lines = [f"{h.host} slots={h.slots}" + (f" max_slots={h.max_slots}" if h.max_slots else "")
                 for h in hosts]
    else:
        lines = [f"{h.host}:{h.slots}" for h in hosts]
    return "\n".join(lines) + "\n"
