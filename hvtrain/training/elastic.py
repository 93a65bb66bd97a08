"""Horovod elastic training (`--elastic`, data parallel): the loop's state committed in memory,
rolled back and re-sharded when workers leave or join.

Horovod's elastic state is an ObjectState whose attributes are the counters: the loop's Position
is written into it at each commit and read back after a reset. The backend says which model and
optimizer state Horovod tracks; the runtime wraps the attempt in hvd.elastic.run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any

from hvtrain.config.validate import per_replica_batch
from hvtrain.errors import HvtrainError

if TYPE_CHECKING:
    from hvtrain.backends.base import Backend
    from hvtrain.training.run import EpochResult, Position, Run


class Elastic:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def run(self, run: Run, pos: Position, epochs: Callable[[Run, Position, Any], EpochResult | None]
            ) -> EpochResult | None:
        """`epochs(run, position, commit)` from `pos`, and again from the last commit after each reset."""
        runtime, steps = run.runtime, run.steps
        names = [f.name for f in fields(pos)]
        state = self.backend.elastic_state({**asdict(pos), "run_id": run.checkpoints.run_id})

        def attempt(state: Any) -> tuple[EpochResult | None]:
            info = runtime.refresh()  # rank and size after a reset
            per_replica_batch(run.cfg, info.size)  # data.global_batch_size: the same step on the new world
            self.backend.on_world_change()
            steps.refresh()
            # A rollback restores weights and optimizer state to the commit; gradients accumulated
            # since then (micro-batches of an unfinished step) belong to the abandoned attempt.
            steps.discard_gradients()
            run.reporter.rebind(info)
            run.checkpoints.run_id = state.run_id  # rank 0's, synced to every worker
            start = type(pos)(**{k: getattr(state, k) for k in names})
            run.reporter.truncate_metrics(start.epoch)

            def commit(here: Position) -> None:
                for k, v in asdict(here).items():
                    setattr(state, k, v)
                state.commit()

            return (epochs(run, start, commit),)

        outcome = runtime.elastic_run(attempt)(state)
        if outcome is None:  # Horovod's elastic wrapper swallowed an error it did not recognise
            raise HvtrainError("elastic training ended without a result after a worker failure")
        return outcome[0]
