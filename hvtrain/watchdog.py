"""Lost hosts: a non-elastic job ends within seconds of a host vanishing, and says which host.

MPI and Horovod wait on a vanished peer until TCP gives up: a cut link or a dead node sends no
reset, so that is minutes to hours. Here each host's first rank (local rank 0) listens on a TCP
port and answers every knock with its token; every rank learns each host's listener at start-up
(one allgather, the same one that tells the manifest where ranks run). While training on this
host makes no progress (no step for `STALL_S`), its first rank knocks on every other host's
listener every `PROBE_EVERY_S`. A host that has not answered for `train.peer_timeout_s` is lost:
that rank says so (`rank r of N: lost host H (ranks a-b): ...`) and ends the job with
LOST_HOST_EXIT. A slow step never ends a job; only a host that stops answering does.

The launcher must then end too. horovodrun --gloo ends its other ranks as soon as one exits, so
under Gloo the rank exits at once. mpirun waits for its daemon on the lost host until its own OOB
keepalive notices (`hvtrain launch` turns it on: 15-25 s) and an MPI_Abort before that makes it
wait for good (measured), so under MPI the rank aborts only after LAUNCHER_GRACE_S. Elastic runs
have none of this: Horovod's driver re-forms the world without the host.
"""

from __future__ import annotations

import secrets
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
    token: str = ""


def local_addresses() -> tuple[str, ...]:
    """This host's non-loopback IPv4 addresses (the token tells a wrong host apart)."""
    import psutil

    return tuple(sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                         if a.family == socket.AF_INET and not a.address.startswith("127.")}))


class Listener:
    """Answers each connection with the token, then closes it (a thread, until close())."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(8)
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
            try:
                conn.settimeout(KNOCK_TIMEOUT_S)
                conn.sendall(self.token.encode())
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def knock(place: Place) -> bool:
    """Does that host's listener answer with its token (on any of its addresses)?"""
    for address in place.addresses:
        try:
            with socket.create_connection((address, place.port), timeout=KNOCK_TIMEOUT_S) as conn:
                got = b""
                while len(got) < len(place.token):
                    chunk = conn.recv(64)
                    if not chunk:
                        break
                    got += chunk
                if got.decode(errors="replace") == place.token:
                    return True
        except OSError:
            continue
    return False


def describe(host: str, ranks: Sequence[int], place: Place) -> str:
    span = f"rank {ranks[0]}" if len(ranks) == 1 else (
        f"ranks {ranks[0]}-{ranks[-1]}" if list(ranks) == list(range(ranks[0], ranks[-1] + 1))
        else "ranks " + ", ".join(map(str, ranks)))
    return f"{host} ({', '.join(place.addresses) or 'no address'}; {span})"


class Watchdog:
    """Knocks on the other hosts while training here is stalled; `on_lost(message)` when one is gone.

    Args:
        places: every rank's Place, in rank order (host first ranks carry port and token).
        my_host: this rank's host name (its own host is never knocked on).
        timeout_s: how long a host may go unanswered before it counts as lost.
    """

    def __init__(self, places: Sequence[Place], my_host: str, timeout_s: float,
                 on_lost: Callable[[str], None], stall_s: float = STALL_S) -> None:
        self.timeout_s, self.stall_s, self.on_lost = timeout_s, stall_s, on_lost
        ranks: dict[str, list[int]] = {}
        doors: dict[str, Place] = {}
        for rank, place in enumerate(places):
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

    def _watch(self) -> None:
        silent_since: dict[str, float] = {}
        with ThreadPoolExecutor(max_workers=min(32, len(self.doors)), thread_name_prefix="hvtrain-knock") as pool:
            while not self._stop.wait(PROBE_EVERY_S):
                now = time.monotonic()
                if now - self.last_beat < self.stall_s:
                    silent_since.clear()
                    continue
                hosts = list(self.doors)
                asked = time.monotonic()
                answers = list(pool.map(lambda h: knock(self.doors[h]), hosts))
                now = time.monotonic()
                for host, answered in zip(hosts, answers, strict=True):
                    if answered:
                        silent_since.pop(host, None)
                    else:
                        silent_since.setdefault(host, asked)
                lost = sorted(h for h, t in silent_since.items() if now - t >= self.timeout_s)
                if lost and not self._stop.is_set():
                    names = "; ".join(describe(h, self.ranks[h], self.doors[h]) for h in lost)
                    stalled = now - self.last_beat
                    self.on_lost(f"lost host {names}: no answer for {self.timeout_s:g} s while training here "
                                 f"waited {stalled:.0f} s for it (train.peer_timeout_s); ending the job, exit "
                                 f"{LOST_HOST_EXIT}: resume from the last checkpoint without that host")
                    return
