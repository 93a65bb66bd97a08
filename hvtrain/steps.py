"""The seam between the one training loop and the parallel layouts.

The loop (hvtrain.trainer) drives a StepRunner: per optimizer step it hands over the rank's share
of a global batch, it reduces losses and evaluation sums through the runtime, and it checkpoints
the runner's state. `DataParallelSteps` runs the backend's whole-model step; the pipeline runner
(hvtrain.placement.runner.PipelineSteps) runs this rank's stage through the schedule.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import numpy as np

from hvtrain.data import Batch, Split, shard_eval

if TYPE_CHECKING:
    from hvtrain.backend import Backend
    from hvtrain.metrics import MetricSet
    from hvtrain.runtime import Runtime

EVAL_BATCH = 1024


class StepRunner(ABC):
    """One rank's part of a training step, for one parallel layout."""

    replica: int  # this rank's data-parallel index (which shard of each global batch it takes)
    replicas: int  # data-parallel width
    shard: str  # the part of the training state this rank holds (checkpoint shard name)
    owns_shard: bool  # the first rank holding `shard` (writes it into checkpoints and final weights)
    needs_x: bool = True  # whether train_batch reads the batch's features (a pipeline's first stage)
    needs_y: bool = True  # ... and its labels (a pipeline's last stage)

    @abstractmethod
    def describe(self) -> str:
        """The layout, for the start-up line."""

    @abstractmethod
    def set_lr(self, lr: float) -> None: ...

    @abstractmethod
    def train_batch(self, batch: Batch, x: np.ndarray | None, y: np.ndarray | None) -> bool:
        """Forward/backward this rank's share of a micro-batch (its features and labels, None where
        `needs_x`/`needs_y` is False); update when `batch.apply`. False when a loss this rank
        computed was not finite (and `train.on_nan` is stop)."""

    @abstractmethod
    def loss_sum(self, reset: bool = False) -> float:
        """This rank's part of the global sum of weighted training losses since the last reset."""

    @abstractmethod
    def eval_sums(self, split: Split) -> np.ndarray:
        """This rank's part of the evaluation sums over `split`, in the run's MetricSet layout
        (hvtrain.metrics: [loss, correct, squared error, absolute error], its metric blocks, count)."""

    @abstractmethod
    def get_state(self) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def set_state(self, state: dict[str, np.ndarray], rng: bool) -> None: ...

    @abstractmethod
    def weights(self) -> dict[str, np.ndarray]:
        """The neutral weights this rank holds (all of them, or its stage's)."""

    @abstractmethod
    def trainable_names(self) -> set[str]:
        """Keys of weights() the optimizer updates: replicas must agree on them bitwise (batchnorm
        statistics are per replica, as in every Horovod data-parallel run)."""

    @abstractmethod
    def discard_gradients(self) -> None:
        """Drop gradients accumulated since the last update (elastic rollback)."""

    def summary(self) -> dict[str, Any]:
        """Layout facts for summary.json (gathered from every rank by the caller)."""
        return {}


class DataParallelSteps(StepRunner):
    """The whole model on every rank; Horovod averages gradients inside the backend's step."""

    def __init__(self, backend: Backend, runtime: Runtime, metrics: MetricSet | None = None) -> None:
        """The backend's whole model on this rank.

        Args:
            metrics: what eval_sums computes (None: this runner is never evaluated, measure_step).
        """
        self.backend, self.runtime, self.metrics = backend, runtime, metrics
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
        return self.backend.train_step(x, y, batch.weights, batch.apply)

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


def digest(weights: dict[str, np.ndarray]) -> str:
    """Bitwise fingerprint of a weight set (replicas of one shard must agree)."""
    h = hashlib.sha256()
    for k in sorted(weights):
        h.update(k.encode() + np.ascontiguousarray(weights[k]).tobytes())
    return h.hexdigest()[:16]
