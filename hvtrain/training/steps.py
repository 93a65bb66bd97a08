"""The seam between the one training loop and the parallel layouts.

The loop (hvtrain.training.loop) drives a StepRunner: per optimizer step it hands over the rank's share
of a global batch, it reduces losses and evaluation sums through the runtime, and it checkpoints
the runner's state. `DataParallelSteps` runs the backend's whole-model step; the pipeline runner
(hvtrain.pipeline.runner.PipelineSteps) runs this rank's stage through the schedule."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from hvtrain.backends.steps import EVAL_BATCH, StepRunner
from hvtrain.data.batches import Batch, shard_eval
from hvtrain.data.dataset import Split
from hvtrain.data.draws import dropout_keys

if TYPE_CHECKING:
    from hvtrain.backends.base import Backend
    from hvtrain.metrics.suite import MetricSet
    from hvtrain.runtime.horovod import Runtime



class DataParallelSteps(StepRunner):
    """The whole model on every rank; Horovod averages gradients inside the backend's step."""

    def __init__(self, backend: Backend, runtime: Runtime, metrics: MetricSet | None = None,
                 draws_seed: int | None = None) -> None:
        """The backend's whole model on this rank.

        Args:
            metrics: what eval_sums computes (None: this runner is never evaluated, measure_step).
            draws_seed: the seed of per-sample dropout masks (hvtrain.config.validate.draws_seed; None:
                the framework's per-rank streams).
        """
        self.backend, self.runtime, self.metrics, self.draws_seed = backend, runtime, metrics, draws_seed
        self.shard, self.owns_shard = "model", runtime.info.is_main
        self.refresh()

    def refresh(self) -> None:
        """Rank and size from the runtime (again after an elastic reset)."""
        info = self.runtime.info
        self.replica, self.replicas, self.owns_shard = info.rank, info.size, info.is_main

    def describe(self) -> str:
        return f"data parallel x {self.replicas}"

    def set_lr(self, lr: float) -> None:
        self.backend.set_lr(lr)

    def train_batch(self, batch: Batch, x: np.ndarray | None, y: np.ndarray | None) -> bool:
        keys = None if self.draws_seed is None else dropout_keys(self.draws_seed, batch.epoch, batch.indices)
        return self.backend.train_step(x, y, batch.weights, batch.apply, keys)

    def loss_sum(self, reset: bool = False) -> float:
        return self.backend.loss_sum(reset)

    def eval_sums(self, split: Split) -> np.ndarray:
        idx = shard_eval(len(split), self.replica, self.replicas)
        self.metrics.begin()
        sums = np.zeros(self.metrics.size - 1, np.float64)
        for start in range(0, len(idx), EVAL_BATCH):
            chunk = idx[start: start + EVAL_BATCH]
            sums += self.backend.eval_batch(*split.take(chunk), self.metrics, chunk)
        return np.concatenate([sums, [len(idx)]])

    def get_state(self) -> dict[str, np.ndarray]:
        return self.backend.get_state()

    def set_state(self, state: dict[str, np.ndarray], rng: bool) -> None:
        self.backend.set_state(state, rng=rng)

    def weights(self) -> dict[str, np.ndarray]:
        return self.backend.get_weights()

    def trainable_names(self) -> set[str]:
        return self.backend.trainable_names()

    def discard_gradients(self) -> None:
        self.backend.discard_gradients()

    def optimizer_state_bytes(self) -> int | None:
        return self.backend.optimizer_state_bytes()

    def release_training_state(self) -> None:
        self.backend.release_training_state()


def digest(weights: dict[str, np.ndarray]) -> str:
    """Bitwise fingerprint of a weight set (replicas of one shard must agree)."""
    h = hashlib.sha256()
    for k in sorted(weights):
        h.update(k.encode() + np.ascontiguousarray(weights[k]).tobytes())
    return h.hexdigest()[:16]
