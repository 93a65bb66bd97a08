"""Pre-emption and walltime: SIGTERM or SIGUSR1 (Slurm's `--signal=USR1@90`) stop every rank at
one common step, with a checkpoint there.

A handler only records the signal; the training loop asks every `train.signal_check_every` steps
whether any rank has one (one allreduce of a flag), so a signal that reached a single rank, or
only the launcher (`hvtrain launch` passes it on), stops the whole job at the same step. The job
then writes a checkpoint (atomically: a second signal during the write cannot harm the previous
one), rank 0 prints where it stopped, and every rank exits with PREEMPTED_EXIT.

`hvtrain train` records the signals first thing (`record_from_start`, before click and the commands
are imported), then installs the handlers, before the config, the data, the framework and Horovod:
a notice during start-up is recorded, not fatal. Until Horovod starts, each phase boundary (the
data, the framework's import, Horovod's init) asks this rank's record (`StopSignals.check`): a
notice ends the rank there at once, PREEMPTED_EXIT with nothing to lose, instead of importing the
framework and starting Horovod first (a scheduler's SIGKILL may come before that: Slurm's
KillWait is 30 s). Once Horovod runs, the loop asks every rank before its first step.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_FROM_START: list[str] = []  # what record_from_start's handler saw, until StopSignals takes it over


def _record(signum: int, frame: Any) -> None:
    if not _FROM_START:
        _FROM_START.append(signal.Signals(signum).name)


def record_from_start() -> None:
    """`hvtrain train`'s first act (hvtrain.cli imports this module before anything else): SIGTERM
    and SIGUSR1 recorded from here on, for StopSignals to take over. Before this, ~0.1 s into the
    process's life (Python's own start-up), either signal still ends it: nothing can catch it earlier."""
    for sig in SIGNALS:
        signal.signal(sig, _record)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # as StopSignals: a launcher may have blocked them


class StopSignals:
    """Records SIGTERM/SIGUSR1 while installed (a with-block); the previous handlers come back after."""

    def __init__(self, enabled: bool = True) -> None:
        self.received: str | None = None
        self.enabled = enabled
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = self.received or signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        if self.enabled and threading.current_thread() is threading.main_thread():  # handlers live there only
            for sig in SIGNALS:
                previous = signal.signal(sig, self._handle)
                # the start-up recorder is taken over, not restored: after the block a signal must
                # end the process again (its default), or MPI's teardown waits for a SIGKILL
                self._previous[sig] = signal.SIG_DFL if previous is _record else previous
            self.received = self.received or (_FROM_START[0] if _FROM_START else None)  # read once ours are in
            _FROM_START.clear()
            # A rank may inherit SIGTERM blocked (hvtrain launch blocks it in the launcher it starts,
            # so that only the ranks act on a job-wide SIGTERM) or ignored (Horovod's middlemen, as
            # scripts/build_horovod.sh patches them): its handlers must see it all the same.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        return self

    def check(self, before: str) -> None:
        """Start-up, before Horovod runs, at the boundary `before` (the data, the framework's import,
        Horovod's init): a notice recorded so far ends this rank now with PREEMPTED_EXIT, nothing
        trained or written; the rank says so itself. The other ranks need not agree first: they
        have nothing to lose either, and the launcher ends them as this rank exits (it waits for
        them in hvd.init otherwise), with this rank's 75, the first non-zero exit, as the job's.

        Raises:
            Preempted: a signal came.
        """
        if not (self.enabled and self.received):
            return
        from hvtrain.errors import Preempted
        from hvtrain.launch.process import launch_rank

        where = launch_rank()
        who = f"rank {where[0]} of {where[1]}: " if where and where[1] > 1 else ""
        message = (f"preempted before training started: nothing trained, nothing to lose ({self.received} "
                   f"during start-up, before {before}); run it again")
        print(f"hvtrain: {who}{message}", flush=True)
        raise Preempted(message)

    def rearm(self) -> None:
        """Install the handlers again: MPI_Init (inside hvd.init) replaces SIGTERM/SIGUSR1 handlers
        installed before it (measured: a rank then died of SIGUSR1)."""
        if self._previous:
            for sig in SIGNALS:
                signal.signal(sig, self._handle)

    def __exit__(self, *exc: Any) -> None:
        # Once a signal came, the handlers stay: the process is on its way out with PREEMPTED_EXIT,
        # and a later signal of the same burst must not kill it (measured: exit 138 instead of 75).
        if not self.received:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
        self._previous.clear()
