"""Pre-emption and walltime: SIGTERM or SIGUSR1 (Slurm's `--signal=USR1@90`) stop every rank at
one common step, with a checkpoint there.

A handler only records the signal; the training loop asks every `train.signal_check_every` steps
whether any rank has one (one allreduce of a flag), so a signal that reached a single rank, or
only the launcher (`hvtrain launch` passes it on), stops the whole job at the same step. The job
then writes a checkpoint (atomically: a second signal during the write cannot harm the previous
one), rank 0 prints where it stopped, and every rank exits with PREEMPTED_EXIT.

`hvtrain train` installs the handlers first thing, before the config, the data, the framework and
Horovod (a notice during start-up is recorded, not fatal); the loop asks once more before its
first step, so such a notice ends the run there with PREEMPTED_EXIT and nothing to lose.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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
                self._previous[sig] = signal.signal(sig, self._handle)
            # A rank may inherit SIGTERM blocked (hvtrain launch blocks it in the launcher it starts,
            # so that only the ranks act on a job-wide SIGTERM) or ignored (Horovod's middlemen, as
            # scripts/build_horovod.sh patches them): its handlers must see it all the same.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        return self

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
