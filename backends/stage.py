"""What a backend provides for one pipeline stage (hvtrain.pipeline.runner drives it)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from hvtrain.metrics.suite import MetricSet


class StageEngine(ABC):
    @abstractmethod
    def forward(self, key: int, xs: list[np.ndarray], padding: bool = False,
                draws: np.ndarray | None = None) -> list[np.ndarray]:
        """Training forward of micro-batch `key` from the stage's incoming tensors (Stage.sources
        order) to its outgoing ones (Stage.outputs order, float32); keep the graph until
        backward(key). `padding`: the micro-batch holds only zero-weight samples (no statistics
        updated). `draws`: its samples' dropout keys (Backend.train_step's `keys`)."""

    @abstractmethod
    def forward_loss(self, key: int, xs: list[np.ndarray], y: np.ndarray, sample_weight: np.ndarray,
                     scale: float = 1.0, draws: np.ndarray | None = None) -> float:
        """Last stage: forward and the weighted loss sum(l_i * w_i), returned unscaled; keep the
        graph of the loss times `scale` (fp16 loss scaling)."""

    @abstractmethod
    def backward(self, key: int, grads: list[np.ndarray] | None) -> list[np.ndarray] | None:
        """Backward of micro-batch `key` (grads of the outgoing tensors, None on the last stage);
        accumulate parameter gradients; return the gradients of the incoming tensors (None on
        stage 0)."""

    @abstractmethod
    def reduce_gradients(self, inv_scale: float = 1.0, check_finite: bool = True) -> bool:
        """Average accumulated gradients over this stage's replicas (Horovod process set), multiply
        them by `inv_scale`; True if all are finite. Only a world-wide skip decision (fp16 loss
        scaling, on_nan: skip) needs that answer: without `check_finite` the stage returns True
        without reading every gradient again (measured: 5 ms a step for 2 M parameters in torch)."""

    @abstractmethod
    def apply_update(self, update: bool = True) -> None:
        """Optimizer step on the reduced gradients if `update`; then zero them."""

    @abstractmethod
    def discard_gradients(self) -> None:
        """Forget live graphs and accumulated gradients."""

    @abstractmethod
    def set_lr(self, lr: float) -> None: ...

    @abstractmethod
    def predict(self, xs: list[np.ndarray]) -> list[np.ndarray]:
        """Forward without gradient (evaluation): the outgoing tensors, float32."""

    @abstractmethod
    def eval_sums(self, xs: list[np.ndarray], y: np.ndarray, metrics: MetricSet, index: np.ndarray) -> np.ndarray:
        """Last stage: this batch's statistics in `metrics`' layout, without the count (`index`: the
        samples' positions in the validation split)."""

    @abstractmethod
    def loss_sum(self, reset: bool = False) -> float: ...

    @abstractmethod
    def get_weights(self) -> dict[str, np.ndarray]:
        """This stage's weights under their neutral (global) names."""

    @abstractmethod
    def get_state(self) -> dict[str, np.ndarray]:
        """This stage's model, optimizer and RNG state (see Backend.get_state)."""

    @abstractmethod
    def set_state(self, state: dict[str, np.ndarray], rng: bool = True) -> None: ...

    @abstractmethod
    def param_count(self) -> int:
        """Trainable parameters held by this rank."""

    @abstractmethod
    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its share of the stage's, when sharded)."""

    def peak_activation_bytes(self) -> int | None:
        """Measured peak bytes of tensors saved for backward, if the framework exposes them."""
        return None
