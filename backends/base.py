"""The Backend interface every framework implements (hvtrain.backends.torch, .tensorflow).

A backend is framework math: it builds the native model (whole, or one pipeline stage) from the
neutral spec or a user's entrypoint, runs a step, evaluates, and converts weights and training
state to and from named numpy arrays. The Horovod runtime (init, ranks, collectives, elastic,
abort) is hvtrain.runtime.horovod, owned by the session; a backend receives it when it builds and asks its
framework binding (`runtime.horovod`) for the distributed optimizer, broadcasts and gradient
averages. The loop lives in hvtrain.training. Conformance: tests/backends/test_conformance.py.

This module imports no framework; the registry of names is hvtrain.backends.registry.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from hvtrain.backends.registry import BACKENDS
from hvtrain.errors import BackendUnavailable

if TYPE_CHECKING:
    import numpy as np

    from hvtrain.config.schema import Config
    from hvtrain.launch.process import ProcessInfo
    from hvtrain.metrics.suite import MetricSet
    from hvtrain.model.native import NativeInputs, OutputForm
    from hvtrain.model.spec import ModelSpec
    from hvtrain.model.weights import Inputs


class Collectives(Protocol):
    """What the backends and the pipeline runner use of the run's hvtrain.runtime.horovod.Runtime
    (typed here so that nothing below the runtime imports it)."""

    info: ProcessInfo
    elastic: bool
    horovod: Any  # the framework's Horovod binding (hvtrain.runtime.torch_horovod / tensorflow_horovod)

    @property
    def distributed(self) -> bool: ...

    @property
    def direct(self) -> bool: ...

    def allreduce_sum(self, values: np.ndarray, name: str = ...) -> np.ndarray: ...

    def sum_(self, values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray: ...

    def broadcast_object(self, obj: Any, root: int = 0) -> Any: ...

    def allgather_object(self, obj: Any) -> list[Any]: ...

    def gather_bytes(self, blob: bytes, root: int = 0, process_set: Any = None) -> list[bytes] | None: ...


class Backend(ABC):
    """One framework. Order of calls: configure -> build (or build_stage) -> steps -> get_weights."""

    name: ClassVar[str]

    @abstractmethod
    def configure(self, cfg: Config, info: ProcessInfo, gpu: int | None) -> None:
        """Per-process setup before anything is built: intra-op threads, the pinned GPU `gpu`
        (the local rank's, or None for CPU), and the framework RNG seeded per rank (dropout
        masks differ across replicas; a resume restores each rank's own stream)."""

    @abstractmethod
    def build(self, cfg: Config, spec: ModelSpec | None, weights: dict[str, np.ndarray] | None,
              num_outputs: int, runtime: Collectives, example: np.ndarray | None = None,
              form: OutputForm | None = None) -> None:
        """Model (from `spec`, or `cfg.model.entrypoint` when spec is None) and optimizer; load
        `weights` (neutral layout) if given; unless the run is elastic (whose state sync does it),
        broadcast the model and optimizer state from rank 0 so every rank starts equal.

        An entrypoint model is probed on `example` (model inputs of the data, hvtrain.model.native's
        probe batch; required then) before its optimizer is built: its first forward builds what
        is not built yet and finds whether it reads token ids (native_inputs), a second one on the
        broadcast weights what it returns (hvtrain.model.native.decide_form, the one contract of every
        backend), which fixes how its output becomes logits for the loss, predict and export:
        decided there when the model is built to train (`weights` None); with `weights`, `form` is
        the one their inputs record holds (None: a file written before it), reused and checked.

        Raises:
            ConfigError: at model.entrypoint, an output the contract refuses or a forward that fails.
        """

    @abstractmethod
    def build_stage(self, cfg: Config, spec: ModelSpec, layers: list[int], sources: tuple[int, ...],
                    outputs: tuple[int, ...], device: str, weights: dict[str, np.ndarray], replicas: int,
                    runtime: Collectives, process_set: Any) -> Any:
        """One pipeline stage holding only `layers` and their optimizer state: an object
        implementing hvtrain.backends.stage.StageEngine, fed the outputs of the producers
        `sources` and returning those of `outputs`. `process_set` joins the stage's `replicas`
        (None when there is one)."""

    @abstractmethod
    def set_lr(self, lr: float) -> None:
        """Learning rate for the following optimizer steps."""

    @abstractmethod
    def train_step(self, x: np.ndarray, y: np.ndarray, sample_weight: np.ndarray, apply: bool,
                   keys: np.ndarray | None = None) -> bool:
        """Forward/backward of sum(loss_i * sample_weight_i) (the weights sum to 1 over the global
        step); allreduce-average the gradients and update when `apply`. `keys` (int64 [batch, 2],
        hvtrain.data.draws.dropout_keys) draw the catalogue's dropout masks per sample
        (train.randomness: per_sample; required then), None: the framework's per-rank stream. The
        weighted loss is added to a local accumulator. A batch whose weights are all zero (a rank's
        empty share of a tail batch) joins the allreduce with zero gradients and changes no statistics. Returns False if
        this rank's loss was not finite; with `train.on_nan: skip` an update whose averaged
        gradients are not finite is skipped on every rank alike, and a non-finite loss makes its
        gradients NaN (an inf loss can have finite ones) so that its update is skipped too."""

    @abstractmethod
    def discard_gradients(self) -> None:
        """Forget gradients accumulated since the last update (after an elastic rollback)."""

    @abstractmethod
    def on_world_change(self) -> None:
        """The world size changed (elastic reset): adapt size-dependent compiled state."""

    @abstractmethod
    def release_training_state(self) -> None:
        """Training is over (the last checkpoint written): free the optimizer state and gradients
        before the end-of-run weight copies. No step may follow."""

    @abstractmethod
    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (1/N of it under train.shard_optimizer)."""

    @abstractmethod
    def loss_sum(self, reset: bool = False) -> float:
        """Local sum of weighted training losses since the last reset (a host sync)."""

    @abstractmethod
    def eval_batch(self, x: np.ndarray, y: np.ndarray, metrics: MetricSet, index: np.ndarray) -> np.ndarray:
        """This batch's evaluation statistics, no gradient: the loss summed by the framework, the
        rest by `metrics` (hvtrain.metrics.suite.batch_stats) from the outputs; `index` holds the samples'
        positions in the validation split."""

    @abstractmethod
    def predict(self, x: np.ndarray) -> np.ndarray:
        """Model outputs as numpy logits [batch, width], no gradient (an entrypoint model's in the
        form its probe decided: see build)."""

    @abstractmethod
    def get_state(self) -> dict[str, np.ndarray]:
        """Everything a bit-exact resume needs from this rank: model (all variables), optimizer
        state and the framework RNG (keys starting 'rng.'), as named arrays."""

    @abstractmethod
    def set_state(self, state: dict[str, np.ndarray], rng: bool = True) -> None:
        """Inverse of get_state; `rng=False` keeps this rank's fresh RNG (world size changed)."""

    @abstractmethod
    def elastic_state(self, counters: dict[str, Any]) -> Any:
        """A Horovod elastic state (from the runtime's binding) tracking the model, the optimizer
        and `counters`: committed, restored on a rollback, synced from rank 0."""

    @abstractmethod
    def get_weights(self) -> dict[str, np.ndarray]:
        """All weights (trainable and state such as batchnorm statistics), neutral layout."""

    @abstractmethod
    def trainable_names(self) -> set[str]:
        """The keys of get_weights() that the optimizer updates (not e.g. batchnorm statistics)."""

    @abstractmethod
    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Load neutral-layout weights (native names for entrypoint models).

        Raises:
            DataError: names or shapes that do not match the model (missing and unexpected named).
        """

    @abstractmethod
    def native_inputs(self) -> NativeInputs:
        """What the built model reads: token ids (int64; the spec's embedding reads the input, or an
        entrypoint model's did on the probe batch) or float32 features."""

    @abstractmethod
    def output_form(self) -> OutputForm:
        """How the built model's output becomes logits (hvtrain.model.native; PLAIN for a config's model)."""

    @abstractmethod
    def local_gpus(self) -> int:
        """GPUs this framework sees on this host."""

    @abstractmethod
    def export(self, fmt: str, path: str, inputs: Inputs) -> None:
        """The built model as a `fmt` artefact (one of EXPORT_FORMATS[name]) at `path`, taking raw
        rows `[N, *inputs.features]` of `export_dtypes(inputs)[0]` (hvtrain.model.weights; the
        normalisation and reshape in the graph) and giving what `hvtrain predict` gives
        (probabilities, or regression outputs)."""

    @abstractmethod
    def load_export(self, fmt: str, path: str) -> Callable[[np.ndarray], np.ndarray]:
        """An artefact of this framework's own format (not onnx) reloaded from `path`, as a function
        of raw rows (the export's verification)."""


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
