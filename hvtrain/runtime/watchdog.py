"""Lost hosts: a non-elastic job ends within seconds of a host vanishing, and says which host.

MPI and Horovod wait on a vanished peer until TCP gives up: a cut link or a dead node sends no
reset, so that is minutes to hours. Here each host's first rank (local rank 0) listens on a TCP
port (accept and close: any TCP answer shows the host is up); every rank learns each host's
listener at start-up (one allgather, the same one that tells the manifest where ranks run). The
watchdog first knocks on every other host once: a host that does not answer then (a firewall)
is not watched, with a warning. While training on this host makes no progress (no step for
`STALL_S`), its first rank knocks on the other hosts every `PROBE_EVERY_S`. Any TCP answer, a
refusal included (the host is up; its ranks may have ended normally), means alive; only silence
(a timeout, no route) counts. A host silent for `train.peer_timeout_s` is lost: that rank says
so (`rank r of N: lost host H (ranks a-b): ...`) and ends the job with LOST_HOST_EXIT. A slow
step never ends a job.

The launcher must then end too. horovodrun --gloo ends its other ranks as soon as one exits, so
under Gloo the rank exits at once. mpirun waits for its daemon on the lost host until its own OOB
keepalive notices (`hvtrain launch` turns it on: 15-25 s) and an MPI_Abort before that makes it
wait for good (measured), so under MPI the rank aborts only after LAUNCHER_GRACE_S, and not at
all if training went on meanwhile. Elastic runs have none of this: Horovod's driver re-forms the
world without the host.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hvtrain.errors import HvtrainError

STALL_S = 5.0  # no training step for this long: start knocking
PROBE_EVERY_S = 2.0
KNOCK_TIMEOUT_S = 2.0
LAUNCHER_GRACE_S = 30.0  # MPI: after saying which host is lost, let mpirun end the job itself first
LOST_HOST_EXIT = 69  # EX_UNAVAILABLE: resubmit on other nodes and resume from the last checkpoint


class HostLost(HvtrainError):
    exit_code = LOST_HOST_EXIT


@dataclass(frozen=True)
class Place:
    """Where one rank runs, and (for a host's first rank) how to knock on its host."""

    host: str
    addresses: tuple[str, ...] = ()
    port: int = 0


def local_addresses() -> tuple[str, ...]:
    """This host's non-loopback IPv4 addresses."""
    import psutil

    return tuple(sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                         if a.family == socket.AF_INET and not a.address.startswith("127.")}))


class Listener:
    """Accepts each connection and closes it (a thread, until close())."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="hvtrain-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def knock(place: Place) -> bool:
    """Is that host up? Any TCP answer on one of its addresses says so: its listener accepting, or a
    refusal (the listener closed: its ranks ended). Silence (timeout, no route) does not."""
    for address in place.addresses:
        try:
            with socket.create_connection((address, place.port), timeout=KNOCK_TIMEOUT_S):
                return True
        except ConnectionRefusedError:
            return True
        except OSError:
            continue
    return False


def distinct_addresses(places: Sequence[Place]) -> list[Place]:
    """Drop addresses that several hosts claim (docker0's 172.17.0.1 on every node): knocking on
    one of those reaches whichever host is nearest, the knocking host itself included."""
    owners: dict[str, set[str]] = {}
    for place in places:
        for address in place.addresses:
            owners.setdefault(address, set()).add(place.host)
    return [Place(p.host, tuple(a for a in p.addresses if len(owners[a]) == 1), p.port) for p in places]


def describe(host: str, ranks: Sequence[int], place: Place) -> str:
    span = f"rank {ranks[0]}" if len(ranks) == 1 else (
        f"ranks {ranks[0]}-{ranks[-1]}" if list(ranks) == list(range(ranks[0], ranks[-1] + 1))
        else "ranks " + ", ".join(map(str, ranks)))
    return f"{host} ({', '.join(place.addresses) or 'no address'}; {span})"


class Watchdog:
    """Knocks on the other hosts while training here is stalled; reports a lost one and ends the job.

    Args:
        places: every rank's Place, in rank order (host first ranks carry addresses and port).
        my_host: this rank's host name (its own host is never knocked on).
        timeout_s: how long a host may stay silent before it counts as lost.
        report: prints one line (the rank's failure or a warning), prefixed with the rank.
        end: ends the job (after `grace_s`, unless training made progress meanwhile).
    """

    def __init__(self, places: Sequence[Place], my_host: str, timeout_s: float, report: Callable[[str, bool], None],
                 end: Callable[[], None], stall_s: float = STALL_S, grace_s: float = 0.0) -> None:
        self.timeout_s, self.stall_s, self.grace_s = timeout_s, stall_s, grace_s
        self.report, self.end = report, end
        ranks: dict[str, list[int]] = {}
        doors: dict[str, Place] = {}
        for rank, place in enumerate(distinct_addresses(places)):
            ranks.setdefault(place.host, []).append(rank)
            if place.port:
                doors.setdefault(place.host, place)
        self.ranks = ranks
        self.doors = {h: p for h, p in doors.items() if h != my_host}
        self.last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hvtrain-watchdog", daemon=True)

    def start(self) -> Watchdog:
        if self.doors:
            self._thread.start()
        return self

    def beat(self) -> None:
        """Training made progress (called every step)."""
        self.last_beat = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _knock_all(self, pool: ThreadPoolExecutor) -> dict[str, bool]:
        hosts = list(self.doors)
        return dict(zip(hosts, pool.map(lambda h: knock(self.doors[h]), hosts), strict=True))

    def _watch(self) -> None:
        with ThreadPoolExecutor(max_workers=min(32, len(self.doors)), thread_name_prefix="hvtrain-knock") as pool:
            for host, answered in self._knock_all(pool).items():
                if not answered:  # unreachable from the start: a firewall, not a loss
                    self.report(f"watchdog: host {describe(host, self.ranks[host], self.doors[host])} does not "
                                f"answer on port {self.doors[host].port} at start-up (a firewall?); it is not "
                                "watched for loss (train.peer_timeout_s: 0 turns the watchdog off)", False)
                    del self.doors[host]
            silent_since: dict[str, float] = {}
            while self.doors and not self._stop.wait(PROBE_EVERY_S):
                if time.monotonic() - self.last_beat < self.stall_s:
                    silent_since.clear()
                    continue
                asked = time.monotonic()
                for host, answered in self._knock_all(pool).items():
                    if answered:
                        silent_since.pop(host, None)
                    else:
                        silent_since.setdefault(host, asked)
                now = time.monotonic()
                lost = sorted(h for h, t in silent_since.items() if now - t >= self.timeout_s)
                if not lost or self._stop.is_set():
                    continue
                names = "; ".join(describe(h, self.ranks[h], self.doors[h]) for h in lost)
                beat = self.last_beat
                self.report(f"lost host {names}: no answer for {self.timeout_s:g} s while training here waited "
                            f"{now - beat:.0f} s for it (train.peer_timeout_s); ending the job, exit "
                            f"{LOST_HOST_EXIT}: resume from the last checkpoint without that host", True)
                if self._stop.wait(self.grace_s) and self.last_beat == beat:
                    return  # the run ended (stop) meanwhile
                if self.last_beat != beat:  # training went on: a blip, not a loss
                    self.report(f"watchdog: training goes on; {', '.join(lost)} answered after all", False)
                    silent_since.clear()
                    continue
                self.end()
                return
