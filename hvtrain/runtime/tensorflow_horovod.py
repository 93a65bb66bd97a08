"""Horovod's TensorFlow binding, for the TensorFlow backend: the one place that calls
horovod.tensorflow.

Horovod 0.28.1 was written for Keras 2; hvtrain's Keras 3 patch (scripts/horovod_keras3.py, applied
by make setup) makes its TensorFlow API take Keras 3 variables, so they are handed over as they are.
Without the patch this binding refuses to load, in one line, rather than fail inside Horovod.
"""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvtrain.errors import HvtrainError
from hvtrain.launch.horovodrun import KERAS3_PATCH, keras3_patch
from hvtrain.runtime.horovod import grouped_allreduce

if not (_KERAS3 := keras3_patch()).startswith("present"):
    raise HvtrainError(f"Horovod's TensorFlow binding lacks hvtrain's Keras 3 patch ({_KERAS3}, expected "
                       f"{KERAS3_PATCH}): run `make setup`, or .venv/bin/python scripts/horovod_keras3.py")


class TensorFlowHorovod:
    """horovod.tensorflow for one process (Runtime uses `hvd` for the neutral collectives)."""

    hvd = hvd
    # Horovod's TF wrapper recognises a failed collective only by op names in the message (not
    # GroupedAllreduce, nor a bare gloo "connection closed"): these mean "a peer died"
    collective_errors: tuple[type[BaseException], ...] = (tf.errors.UnknownError, tf.errors.InternalError,
                                                          tf.errors.AbortedError)

    @staticmethod
    def as_tensor(values: np.ndarray) -> tf.Tensor:
        return tf.constant(np.ascontiguousarray(values))

    @staticmethod
    def compression(name: str) -> Any:
        return hvd.Compression.fp16 if name == "fp16" else hvd.Compression.none

    def broadcast(self, variables: list[Any]) -> None:
        """Rank 0's values of these Keras variables to every rank."""
        hvd.broadcast_variables(list(variables), root_rank=0)

    def average(self, tensors: list[tf.Tensor], num_groups: int, name: str, compression: str,
                process_set: Any = None) -> list[tf.Tensor]:
        """The tensors averaged over the ranks of `process_set` (all ranks: None), in `num_groups`
        groups; works inside tf.function."""
        kwargs = {"process_set": process_set} if process_set is not None else {}
        return grouped_allreduce(hvd, tensors, num_groups, name, op=hvd.Average,
                                 compression=self.compression(compression), **kwargs)

    def reducescatter_mean(self, tensor: tf.Tensor, name: str, process_set: Any = None) -> tf.Tensor:
        """Rank r's 1/size of `tensor` (split on its first axis), averaged over the ranks (of
        `process_set`: r is the rank within it)."""
        kwargs = {"process_set": process_set} if process_set is not None else {}
        return hvd.reducescatter(tensor, op=hvd.Average, name=name, **kwargs)

    def allgather(self, tensor: tf.Tensor, name: str, process_set: Any = None) -> tf.Tensor:
        """Every rank's (of `process_set`) `tensor`, concatenated in rank order on the first axis."""
        kwargs = {"process_set": process_set} if process_set is not None else {}
        return hvd.allgather(tensor, name=name, **kwargs)

    def elastic_state(self, shared: Any, local: Any, counters: dict[str, Any]) -> Any:
        """Horovod elastic state for Keras 3 variables: `shared()` (weights, optimizer) saved,
        restored and broadcast from rank 0; `local()` (seed generators) this rank's own, saved and
        restored on a rollback, never synced, so a rollback continues exactly as a resume from a
        checkpoint there. horovod.tensorflow.elastic.TensorFlowState re-broadcasts only through a
        TF1 session: in TF2 eager mode a worker that joins would keep its own weights."""

        def values(variables: list) -> list[np.ndarray]:
            return [np.array(v.numpy()) for v in variables]

        binding = self

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
                binding.broadcast(shared())
                self._saved_values = values(shared())
                super().sync()

        return KerasState()
