"""The loop's seam: one rank's part of a training step, for one parallel layout.

hvtrain.training.loop drives a StepRunner; hvtrain.training.steps.DataParallelSteps (the backend's
whole-model step) and hvtrain.pipeline.runner.PipelineSteps (a pipeline stage) implement it. It
sits with the backend interface, below both, so neither layout imports the other or the loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from hvtrain.data.batches import Batch
    from hvtrain.data.dataset import Split


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
        (hvtrain.metrics.suite: [loss, correct, squared error, absolute error], its metric blocks, count)."""

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

    def refresh(self) -> None:  # noqa: B027 - a layout whose world cannot change (pipelines) has nothing to read
        """Read the world again after an elastic reset (this rank's replica index and the width)."""

    def release_training_state(self) -> None:  # noqa: B027 - a layout may keep its state (pipelines, for now)
        """Training is over: free what only training needs (optimizer state, gradients)."""

    def optimizer_state_bytes(self) -> int | None:
        """Bytes of optimizer state this rank holds (None: not measured for this layout)."""
        return None

    def summary(self) -> dict[str, Any]:
        """Layout facts for summary.json (gathered from every rank by the caller)."""
        return {}
