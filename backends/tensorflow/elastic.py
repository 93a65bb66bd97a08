"""Horovod elastic state for Keras 3 models.

horovod.tensorflow.elastic.TensorFlowState only re-broadcasts variables through a TF1 session,
so in TF2 eager mode a worker that joins keeps its own weights. This state saves, restores and
broadcasts the model and optimizer variables itself (their `.value` tf.Variables, which is what
Horovod's TF ops accept); RNG (seed generator) states stay per rank."""

from __future__ import annotations

from typing import Any

import numpy as np


def make_state(hvd: Any, variables: Any, counters: dict[str, Any]) -> Any:
    """`variables()` returns the variables to track (re-evaluated at each save/restore/sync)."""

    class KerasState(hvd.elastic.ObjectState):
        def __init__(self) -> None:
            self._saved_values = [np.array(v.numpy()) for v in variables()]
            super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **counters)

        def save(self) -> None:
            self._saved_values = [np.array(v.numpy()) for v in variables()]
            super().save()

        def restore(self) -> None:
            for var, value in zip(variables(), self._saved_values, strict=True):
                var.assign(value)
            super().restore()

        def sync(self) -> None:
            hvd.broadcast_variables([v.value for v in variables()], root_rank=0)
            self._saved_values = [np.array(v.numpy()) for v in variables()]
            super().sync()

    return KerasState()
