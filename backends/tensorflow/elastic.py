"""Horovod elastic state for Keras 3 models.

horovod.tensorflow.elastic.TensorFlowState only re-broadcasts variables through a TF1 session,
so in TF2 eager mode a worker that joins keeps its own weights. This state saves, restores and
broadcasts the model and optimizer variables itself (their `.value` tf.Variables, which is what
Horovod's TF ops accept). RNG (seed generator) states are this rank's own: saved and restored on a
rollback, never synced, so a rollback continues exactly as a resume from a checkpoint there."""

from __future__ import annotations

from typing import Any

import numpy as np

from .ops import is_rng


def make_state(hvd: Any, model: Any, optimizer: Any, counters: dict[str, Any], scaler: Any = None) -> Any:
    """`scaler` is always None here: Keras keeps the loss scale among the optimizer's variables."""

    def shared() -> list:
        return [v for v in model.variables if not is_rng(v)] + list(optimizer.variables)

    def local() -> list:
        return [v for v in model.variables if is_rng(v)]

    def values(variables: list) -> list[np.ndarray]:
        return [np.array(v.numpy()) for v in variables]

    class KerasState(hvd.elastic.ObjectState):
        def __init__(self) -> None:
            self._saved_values, self._saved_local = values(shared()), values(local())
            super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **counters)

        def save(self) -> None:
            self._saved_values, self._saved_local = values(shared()), values(local())
            super().save()

        def restore(self) -> None:
            for var, value in zip(shared() + local(), self._saved_values + self._saved_local, strict=True):
                var.assign(value)
            super().restore()

        def sync(self) -> None:
            hvd.broadcast_variables([v.value for v in shared()], root_rank=0)
            self._saved_values = values(shared())
            super().sync()

    return KerasState()
