"""What a backend provides for one pipeline stage. The neutral runner (placement/runner.py)
drives it: it owns the schedule and the MPI point-to-point exchange of numpy activations
and gradients; the stage owns the math and the autograd graphs of live micro-batches."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class StageEngine(ABC):
    @abstractmethod
    def forward(self, key: int, x: np.ndarray) -> np.ndarray:
        """Training forward of micro-batch `key`; keep its graph until backward(key)."""

    @abstractmethod
    def forward_loss(self, key: int, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> bool:
        """Last stage: forward and the weighted loss sum(l_i * w_i); keep the graph. False if the
        loss is not finite."""

    @abstractmethod
    def backward(self, key: int, grad: np.ndarray | None) -> np.ndarray | None:
        """Backward of micro-batch `key` (grad of the stage output, None on the last stage);
        accumulate parameter gradients; return the gradient of the stage input (None on stage 0)."""

    @abstractmethod
    def step(self) -> None:
        """Average accumulated gradients over this stage's replicas (Horovod process set), update, zero."""

    @abstractmethod
    def set_lr(self, lr: float) -> None: ...

    @abstractmethod
    def predict(self, x: np.ndarray) -> np.ndarray:
        """Forward without gradient (evaluation)."""

    @abstractmethod
    def eval_sums(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Last stage: [loss, correct, squared error, absolute error] sums for this batch."""

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

    def peak_activation_bytes(self) -> int | None:
        """Measured peak bytes of tensors saved for backward, if the framework exposes them."""
        return None
