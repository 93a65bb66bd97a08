"""The Backend interface every framework implements, and the registry that finds them.

The neutral trainer (hvtrain.trainer) owns the loop, metrics, logging and files; a backend
owns the math: it builds the native model from the neutral spec, runs a step, reduces and
broadcasts through Horovod, and converts weights to and from the neutral layout.
Conformance: tests/backends/test_conformance.py runs the same checks on every backend.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from hvtrain.config import Config
from hvtrain.dist import ProcessInfo
from hvtrain.errors import BackendUnavailable
from hvtrain.placement.plan import PipelinePlan, Stage
from hvtrain.placement.stage import StageEngine
from hvtrain.spec import ModelSpec

# name -> "module:Class"; modules are imported only when chosen.
BACKENDS = {
    "torch": "hvtrain.backends.torch.backend:TorchBackend",
    "tensorflow": "hvtrain.backends.tensorflow.backend:TensorFlowBackend",
}


class Backend(ABC):
    """One framework under Horovod. Methods are called in this order:
    init -> build -> (set_lr | train_step | eval_batch | allreduce_sum)* -> get_weights -> shutdown.
    """

    name: ClassVar[str]

    @abstractmethod
    def init(self, cfg: Config, comm: Any = None, groups: list[list[int]] | None = None) -> ProcessInfo:
        """Initialise Horovod (and the framework's threads); return who this process is.

        `comm` (an mpi4py communicator) makes Horovod share MPI with mpi4py (pipelines);
        `groups` are Horovod process sets (each pipeline stage's data-parallel ranks)."""

    @abstractmethod
    def build(self, cfg: Config, spec: ModelSpec | None, weights: dict[str, np.ndarray] | None,
              num_outputs: int) -> None:
        """Build the model (from `spec`, or `cfg.model.entrypoint` when spec is None) and the
        optimizer; load `weights` (neutral layout) if given; broadcast state from rank 0."""

    @abstractmethod
    def set_lr(self, lr: float) -> None:
        """Learning rate for the following optimizer steps."""

    @abstractmethod
    def train_step(self, x: np.ndarray, y: np.ndarray, weights: np.ndarray, apply: bool) -> bool:
        """Forward/backward of sum(loss_i * weights_i) (weights sum to 1 over the global step);
        allreduce-average gradients and update when `apply`. The weighted loss is added to a
        local accumulator. Returns False if this rank's loss was not finite; with
        `train.on_nan: skip` an update whose averaged gradients are not finite is skipped on
        every rank alike."""

    @abstractmethod
    def loss_sum(self, reset: bool = False) -> float:
        """Local sum of weighted training losses since the last reset (a host sync)."""

    @abstractmethod
    def eval_batch(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Sums over this batch, no gradient: [loss, correct, squared error, absolute error]."""

    @abstractmethod
    def predict(self, x: np.ndarray) -> np.ndarray:
        """Model outputs (logits) as numpy, no gradient."""

    @abstractmethod
    def allreduce_sum(self, values: np.ndarray) -> np.ndarray:
        """Sum a float64 vector over all ranks; every rank gets the result."""

    @abstractmethod
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """A picklable object from `root` to every rank."""

    @abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order, on every rank."""

    @abstractmethod
    def get_state(self) -> dict[str, np.ndarray]:
        """Everything a bit-exact resume needs from this rank: model (all variables), optimizer
        state and the framework RNG, as named arrays (non-tensor parts JSON-encoded as uint8)."""

    @abstractmethod
    def set_state(self, state: dict[str, np.ndarray], rng: bool = True) -> None:
        """Inverse of get_state; `rng=False` keeps this rank's fresh RNG (world size changed)."""

    @abstractmethod
    def elastic_state(self, counters: dict[str, Any]) -> Any:
        """Horovod elastic state tracking model, optimizer and `counters` (commit/restore/sync)."""

    @abstractmethod
    def elastic_run(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`fn` wrapped by hvd.elastic.run: re-run from the last commit after a reset."""

    @abstractmethod
    def refresh(self) -> ProcessInfo:
        """Re-read rank and size (after an elastic reset) and adapt size-dependent state."""

    @abstractmethod
    def get_weights(self) -> dict[str, np.ndarray]:
        """All weights (trainable and state such as batchnorm statistics), neutral layout."""

    @abstractmethod
    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Load neutral-layout weights; names and shapes must match the model."""

    @abstractmethod
    def local_gpus(self) -> int:
        """GPUs this framework sees on this host (device checks for pipeline placement)."""

    @abstractmethod
    def build_stage(self, cfg: Config, spec: ModelSpec, stage: Stage, plan: PipelinePlan,
                    weights: dict[str, np.ndarray]) -> StageEngine:
        """One pipeline stage holding only its layers and their optimizer state."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release Horovod."""


def get_backend(name: str) -> Backend:
    """Instantiate a registered backend, importing its framework only now.

    Raises:
        BackendUnavailable: unknown name, or its framework/Horovod cannot be imported.
    """
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    module_name, _, class_name = BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(f"backend {name!r} cannot be used: {exc} (run `make setup`, then "
                                 "`hvtrain doctor`)") from None
    return getattr(module, class_name)()
