"""`hvtrain launch`'s pre-emption notice: a SIGTERM or SIGUSR1 it receives, kept until the ranks can
take it, then passed on to them as SIGUSR1.

A rank records the notice only once its handler is installed (the first thing `hvtrain train`
does, ~0.1 s after the process starts); before that, SIGUSR1 kills it (exit 138). And before the
launcher has started any rank there is no one to tell. So the notice is kept from the moment
`hvtrain launch` starts, and each `hvtrain train` rank on this host gets it as soon as
/proc/PID/status shows its SIGUSR1 handler (SigCgt); a rank of another command (predict, an
elastic run: no handler) gets it at once, and ends of it. Signalling this host's ranks is enough:
the training loop's world-wide check stops every rank, on every host, at one common step. Ranks
on other hosts cannot be looked at from here: when none runs on this host, the notice goes to
the MPI launcher (mpirun, srun), which passes SIGUSR1 on to every rank, once it has run SETTLE_S
(the remote ranks' start-up: a rank signalled before its handler is there dies of it).
horovodrun --gloo starts remote ranks over ssh, which passes no signal on: with no rank on this
host, the notice cannot be delivered, and it says so at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun", "srun")
SETTLE_S = 10.0  # the remote ranks' start-up (ssh, Python, hvtrain's handler), as mpirun started them
POLL_S = 0.1  # how often a pending notice looks for ranks that can take it


def catches(pid: int, sig: int) -> bool | None:
    """Whether process `pid` has a handler for `sig` (Linux /proc SigCgt); None: cannot tell."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return None


def rank_command(process: Any) -> list[str] | None:
    """The hvtrain command of a process `hvtrain launch` started as a rank (`python -m hvtrain ARGS`,
    execute.worker_command): ARGS; None for any other process."""
    try:
        argv = process.cmdline()
    except Exception:  # noqa: BLE001 - a process that just ended
        return None
    return argv[3:] if argv[1:3] == ["-m", "hvtrain"] else None


def can_take(process: Any, command: list[str]) -> bool:
    """Whether a rank running `command` can be given the notice now: a training rank once its
    handler is installed (where /proc cannot tell, at once); any other at once."""
    if command[:1] != ["train"] or "--elastic" in command:
        return True
    return catches(process.pid, signal.SIGUSR1) is not False


def _name(process: Any) -> str:
    try:
        return process.name()
    except Exception:  # noqa: BLE001 - a process that just ended
        return ""


def _age(process: Any) -> float:
    """Seconds since `process` started: from /proc's start time in clock ticks since boot (psutil's
    create_time counts from a boot time rounded to the second)."""
    try:
        with open(f"/proc/{process.pid}/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        try:
            return time.time() - process.create_time()
        except Exception:  # noqa: BLE001 - a process that just ended
            return 0.0


class Notice:
    """SIGTERM/SIGUSR1 to this process recorded while installed (a with-block), then passed on by
    `serve` to the ranks below the launcher as they become able to take it."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.since = 0.0
        self.told: set[int] = set()  # pids that got the notice
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received, self.since = signal.Signals(signum).name, time.time()

    def __enter__(self) -> Notice:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def serve(self, proc: subprocess.Popen) -> int:
        """Wait for the launcher `proc` to end, passing a notice on as the ranks can take it; its
        exit code."""
        while True:
            try:
                code = proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if self.received:
                self.deliver(proc.pid)
        if self.received and not self.told:
            print(f"hvtrain launch: the {self.received} it received was not passed on: no rank and no MPI launcher "
                  f"below pid {proc.pid} on this host could take it (horovodrun --gloo starts remote ranks over ssh, "
                  "which passes no signal on); signal the ranks themselves", file=sys.stderr, flush=True)
        return code

    def deliver(self, launcher_pid: int) -> list[int]:
        """One look below `launcher_pid`: SIGUSR1 to every rank not told yet that can take it; with no
        rank on this host, to the MPI launcher once it has run SETTLE_S. Returns the pids signalled."""
        import psutil

        try:
            top = psutil.Process(launcher_pid)
            below = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        ranks = [(p, command) for p in below if (command := rank_command(p)) is not None]
        targets = [p for p, command in ranks if p.pid not in self.told and can_take(p, command)]
        if not ranks and not self.told:  # no rank here (yet): the launcher passes it on to every host's ranks
            mpi = [p for p in below if _name(p) in MPI_LAUNCHERS]
            targets = [p for p in mpi[:1] if p.pid not in self.told and _age(p) >= SETTLE_S]
        sent = []
        for p in targets:
            try:
                p.send_signal(signal.SIGUSR1)
            except psutil.NoSuchProcess:
                continue
            self.told.add(p.pid)
            sent.append(p.pid)
        return sent
