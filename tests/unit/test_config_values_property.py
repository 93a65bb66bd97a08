"""Config values (issue 21): every numeric option has a range, checked once in the config and so
the same for both backends. Drawn values (in and out of range, NaN and infinities, huge integers,
wrong types, YAML spellings) load, or fail as one ConfigError located at the option: `file:line`
in a YAML file, the --set, or `<dict>`; never another exception. A few in-range draws then train
through the real CLI (one backend per example, tiny data, 1 epoch) or are refused in one line,
never with a traceback.

RANGES below is the test's own statement of each range (the oracle), not read from hvtrain.config.load:
a numeric option added to the schema without an entry here fails the first test."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hvtrain.config.load import load_config
from hvtrain.config.schema import Config
from hvtrain.config.yaml import parse_override
from hvtrain.errors import ConfigError
from tests.support.launch import BACKENDS

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Spec:
    integer: bool
    lo: float
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    off: float | None = None  # one value outside the range with a meaning (0: switched off)
    optional: bool = False  # null allowed
    items: bool = False  # a list of such numbers
    text: bool = False  # a string is a value too (model.output_key: an entry name, or an index)

    def allows(self, v: Any) -> bool:
        """Whether `v` (one number, of the right type) is in range."""
        if self.off is not None and v == self.off:
            return True
        if isinstance(v, float) and not math.isfinite(v):
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        below = self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        return above and below


def I(lo, hi=None, **kw):  # noqa: E743, N802 - short names keep the table readable
    return Spec(True, lo, hi, **kw)


def F(lo, hi=None, **kw):  # noqa: N802
    return Spec(False, lo, hi, **kw)


RANGES: dict[str, Spec] = {
    "seed": I(0, 2**32 - 1),  # numpy's seed range
    "data.prefetch": I(0), "data.validation_split": F(0, 1, hi_open=True), "data.batch_size": I(1),
    "data.global_batch_size": I(1, optional=True),
    "data.samples": I(1), "data.features": I(1), "data.classes": I(1), "data.window": I(1, optional=True),
    "data.horizon": I(1), "data.vocab_size": I(3), "data.max_len": I(1),
    "data.image.size": I(1, 65535, optional=True, items=True), "data.workers": I(0, 256),
    "data.augment.resized_crop": F(0, 1, lo_open=True, optional=True, items=True),
    "data.augment.crop_padding": I(0, 4096), "data.augment.brightness": F(0, 1), "data.augment.contrast": F(0, 1),
    "model.input_shape": I(1, optional=True, items=True), "model.output_key": I(0, optional=True, text=True),
    "optimizer.lr": F(0, lo_open=True), "optimizer.momentum": F(0, 1, hi_open=True), "optimizer.weight_decay": F(0),
    "optimizer.betas": F(0, 1, hi_open=True, items=True), "optimizer.eps": F(0, lo_open=True),
    "optimizer.rho": F(0, 1, hi_open=True), "optimizer.warmup_epochs": F(0),
    "train.epochs": I(1), "train.max_steps": I(0), "train.grad_accumulation": I(1), "train.log_every": I(1),
    "train.threads": I(0, 4096), "train.checkpoint_every": I(0), "train.keep": I(1),
    "train.elastic_commit_every": I(1), "train.signal_check_every": I(1), "train.peer_timeout_s": F(4, off=0),
    "horovod.cycle_time_ms": F(0, 1000), "horovod.fusion_threshold_mb": F(0, 16384),
    "horovod.direct_cycle_ms": F(0, 1000),
    "horovod.cache_capacity": I(0, 2**31 - 1, optional=True), "horovod.num_groups": I(0),
    "parallel.pipeline.stages": I(1), "parallel.pipeline.micro_batches": I(1, 4096),
}

CLASSIFIER = {"name": "t", "data": {"dataset": "sklearn:digits"},
              "model": {"input_shape": [64], "layers": [{"type": "dense", "units": 10}]}}
NATIVE = {"name": "t", "data": {"dataset": "sklearn:digits"}, "model": {"entrypoint": "tests.support.models:mlp"}}
SERIES = {"name": "t", "loss": "mse", "data": {"dataset": "statsmodels:sunspots", "window": 8},
          "model": {"input_shape": [8], "layers": [{"type": "dense", "units": 1}]}}


def numeric_options(cls: type = Config, prefix: str = "") -> set[str]:
    """Every int / float option of the schema (optional or in a list too), by key path."""
    out = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        tp, path = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out |= numeric_options(tp, f"{path}.")
            continue
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        for arg in args:
            inner = typing.get_args(arg) if typing.get_origin(arg) is list else (arg,)
            if any(t in (int, float) for t in inner):
                out.add(path)
    return out


def test_every_numeric_option_has_a_range_and_its_default_is_in_it():
    assert numeric_options() == set(RANGES), "a numeric option without a range (or a stale entry in RANGES)"
    defaults = Config(name="t").to_dict()
    for key, spec in RANGES.items():
        value = defaults
        for part in key.split("."):
            value = value[part]
        values = value if spec.items and value is not None else [value]
        assert all(v is None and spec.optional or spec.allows(v) for v in values), (key, value)


# ----------------------------------------------------------------------------- values drawn


def numbers(spec: Spec) -> st.SearchStrategy:
    """Numbers in, at and just outside the range, and the non-finite ones."""
    lo, hi = spec.lo, spec.hi if spec.hi is not None else spec.lo + 10**6
    if spec.integer:
        inside = st.integers(int(lo), int(hi))
        edges = st.sampled_from([int(lo) - 1, int(lo), int(hi), int(hi) + 1, -(2**40), 2**64, 10**30])
        return st.one_of(inside, edges, st.floats(allow_nan=True), st.sampled_from([1.5, 2.0]))
    inside = st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    edges = st.sampled_from([lo, hi, math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf), -0.0,
                             math.inf, -math.inf, math.nan, lo - 1, hi + 1, 10**30, 10**400, 4])
    return st.one_of(inside, edges, st.integers(-10, 10**6))


WRONG = st.one_of(st.text(max_size=8), st.booleans(), st.none(), st.just({"a": 1}), st.just([]))
# YAML spellings of numbers and near-numbers, as written in the file (YAML 1.2 floats, hex, ...)
SPELLINGS = st.sampled_from(["1e3", "1E-2", "0x10", "0o7", "1_000", "+5", "1.", ".5", "-.5", "-0", ".inf", "-.Inf",
                             ".NaN", "1e400", "9" * 5000, "null", "~", "yes", "true", "'3'", "[1, 2]", "{a: 1}",
                             "1e", "3e-4x", "[0.9, .nan]", "[]", "[[1]]", "[1, 2, 3]"])


@st.composite
def drawn(draw) -> tuple[str, str]:
    """(key path, the value as YAML flow text)."""
    key = draw(st.sampled_from(sorted(RANGES)))
    spec = RANGES[key]
    if spec.items:
        value = draw(st.one_of(st.lists(numbers(spec), min_size=1, max_size=3), numbers(spec), WRONG))
    else:
        value = draw(st.one_of(numbers(spec), numbers(spec), WRONG))
    text = draw(st.one_of(st.just(flow(value)), SPELLINGS)) if draw(st.integers(0, 4)) == 0 else flow(value)
    return key, text


def flow(value: Any) -> str:
    if isinstance(value, str):  # a JSON string is a one-line YAML double-quoted scalar (PyYAML folds newlines)
        return json.dumps(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**300:
        return str(value)  # PyYAML would write it, but a 1e400-like int is what we mean: digits
    return yaml.safe_dump([value], default_flow_style=True, width=10**9).strip()[1:-1]


def meaning(text: str) -> tuple[bool, Any]:
    """(readable, value) of YAML flow text as the config reads it (YAML 1.2 floats)."""
    try:
        return True, parse_override(f"x={text}")[1]
    except ConfigError:
        return False, None


def acceptable(spec: Spec, value: Any) -> bool:
    """The oracle: right type and in range."""
    def one(v: Any) -> bool:
        if isinstance(v, bool):
            return False
        if spec.integer:
            return isinstance(v, int) and spec.allows(v)
        if not isinstance(v, (int, float)) or (isinstance(v, int) and abs(v) > 10**300):
            return False  # an integer of hundreds of digits is no finite float
        return spec.allows(float(v))

    if value is None:
        return spec.optional
    if spec.text and isinstance(value, str):
        return True
    if spec.items:
        if not isinstance(value, list) or not value or not all(one(v) for v in value):
            return False
        if spec is RANGES["data.augment.resized_crop"]:  # [min, max] area fractions (a draw of [1.0] failed)
            return len(value) == 2 and value[0] <= value[1]
        pairs = (RANGES["optimizer.betas"], RANGES["data.image.size"])  # [beta1, beta2], [height, width]
        return len(value) == 2 if any(spec is p for p in pairs) else True
    return one(value)


def nested(base: dict, key: str, value: Any) -> dict:
    out = json.loads(json.dumps(base))
    node = out
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


def emit(mapping: dict, key: str, text: str) -> tuple[str, int]:
    """Block-style YAML of `mapping` with `key`'s value written as `text`; and that key's line."""
    lines: list[str] = []
    where = 0

    def walk(node: dict, prefix: str, indent: int) -> None:
        nonlocal where
        for k, v in node.items():
            path = f"{prefix}{k}"
            if path == key:
                lines.append(" " * indent + f"{k}: {text}")
                where = len(lines)
            elif isinstance(v, dict):
                lines.append(" " * indent + f"{k}:")
                walk(v, f"{path}.", indent + 2)
            else:
                lines.append(" " * indent + f"{k}: {flow(v)}")

    walk(mapping, "", 0)
    return "\n".join(lines) + "\n", where


def built(cfg: Config, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(drawn())
def test_a_drawn_value_loads_or_is_one_located_config_error(tmp_path, draw):
    key, text = draw
    spec = RANGES[key]
    base = SERIES if key in ("data.window", "data.horizon") else NATIVE if key == "model.output_key" else CLASSIFIER
    readable, value = meaning(text)
    # null is the default of these two, but the bases need a value (model.layers, a series)
    ok = readable and acceptable(spec, value) and not (value is None and key in ("model.input_shape", "data.window"))
    placeholder = 1 if spec.integer else 1.0
    body, line = emit(nested(base, key, [placeholder] if spec.items else placeholder), key, text)
    path = tmp_path / "c.yaml"
    path.write_text(body)
    channels = [("file", lambda: load_config(path), f"{path}:{line}: ")]
    if readable:  # the same value by --set on the base config, and as a mapping (the Python API)
        path_base = tmp_path / "base.yaml"
        path_base.write_text(emit(base, "", "")[0])
        channels += [("--set", lambda: load_config(path_base, [f"{key}={text}"]), f"{path_base} (--set {key}"),
                     ("dict", lambda: load_config(nested(base, key, value)), f"<dict>: {key}")]
    for channel, load, located in channels:
        try:
            cfg = load()
        except ConfigError as exc:
            message = str(exc)
            assert "\n" not in message, message
            assert not ok, f"{channel}: {key}={text!r} is in range, refused: {message}"
            assert message.startswith(located), f"{channel}: not located at {located!r}: {message}"
            if readable and channel == "file":
                assert message.startswith(f"{path}:{line}: {key}"), message  # the option itself, not a neighbour
            continue
        assert ok, f"{channel}: {key}={text!r} loaded as {built(cfg, key)!r}, out of range or of the wrong type"
        got, want = built(cfg, key), value
        if not spec.integer:  # a float option holds the number as a float
            want = [float(v) for v in value] if isinstance(value, list) else None if value is None else float(value)
        assert got == want, (channel, key, got, want)


# Layer options are numbers too: checked where the model spec is built (still before any framework).
LAYER_DRAWS = {("dense", "units"): I(1), ("dropout", "rate"): F(0, 1, hi_open=True),
               ("layernorm", "epsilon"): F(0, lo_open=True), ("batchnorm", "momentum"): F(0, 1, hi_open=True),
               ("batchnorm", "epsilon"): F(0, lo_open=True)}


@SETTINGS
@given(st.sampled_from(sorted(LAYER_DRAWS)).flatmap(lambda k: st.tuples(st.just(k), st.one_of(numbers(LAYER_DRAWS[k]),
                                                                                               WRONG))))
def test_a_drawn_layer_option_builds_or_is_one_located_config_error(tmp_path, draw):
    from hvtrain.model.spec import build_spec

    (kind, option), value = draw
    path = tmp_path / "c.yaml"
    path.write_text(f"name: t\ndata: {{dataset: sklearn:digits}}\nmodel:\n  input_shape: [64]\n  layers:\n"
                    f"    - {{type: {kind}, {option}: {flow(value)}}}\n    - {{type: dense, units: 10}}\n")
    readable, value = meaning(flow(value))
    ok = readable and acceptable(LAYER_DRAWS[kind, option], value)
    try:
        build_spec(load_config(path))
    except ConfigError as exc:
        assert not ok and str(exc).startswith(f"{path}:6: model.layers[0].{option}: "), str(exc)
        return
    assert ok, (kind, option, value)


# ----------------------------------------------------------------------------- in-range draws train

# A practical corner of each range (tiny data, one epoch); every value is in its option's range.
TRAIN_DRAWS: dict[str, st.SearchStrategy] = {
    "seed": st.one_of(st.sampled_from([0, 542363, 2**32 - 1]), st.integers(0, 2**32 - 1)), "data.prefetch": st.integers(0, 3),
    "data.validation_split": st.sampled_from([0.0, 0.1, 0.25, 0.5]), "data.batch_size": st.integers(1, 48),
    "data.samples": st.integers(8, 96), "optimizer.lr": st.floats(1e-4, 0.5),
    "optimizer.momentum": st.floats(0, 0.99), "optimizer.weight_decay": st.floats(0, 0.1),
    "optimizer.eps": st.floats(1e-8, 1.0), "optimizer.rho": st.floats(0, 0.99),
    "optimizer.warmup_epochs": st.floats(0, 2), "train.max_steps": st.integers(0, 4),
    "train.grad_accumulation": st.integers(1, 3), "train.log_every": st.integers(1, 30),
    "train.threads": st.integers(0, 2), "train.checkpoint_every": st.integers(0, 2), "train.keep": st.integers(1, 3),
    "train.signal_check_every": st.integers(1, 20), "train.peer_timeout_s": st.sampled_from([0.0, 4.0, 30.0]),
    "horovod.cycle_time_ms": st.floats(0, 5), "horovod.fusion_threshold_mb": st.floats(0, 64),
    "horovod.direct_cycle_ms": st.floats(0, 300),
    "horovod.cache_capacity": st.one_of(st.none(), st.integers(0, 2048)), "horovod.num_groups": st.integers(0, 3),
}


@st.composite
def run_args(draw) -> list[str]:
    """--set items for a tiny synthetic run, every option of TRAIN_DRAWS drawn (the features and
    classes pair with the model's shape)."""
    features, classes = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    name = draw(st.sampled_from(["sgd", "adam", "adamw", "rmsprop"]))
    sets = {"data.features": features, "data.classes": classes, "model.input_shape": [features],
            "model.layers.0.units": max(2, classes), "optimizer.name": name}
    for key, values in TRAIN_DRAWS.items():
        sets[key] = draw(values)
    if name in ("adam", "adamw"):
        sets["optimizer.betas"] = [draw(st.floats(0, 0.99)), draw(st.floats(0, 0.999))]
    if name == "sgd" and sets.get("optimizer.momentum", 0) > 0 and draw(st.booleans()):
        sets["optimizer.nesterov"] = True
    if draw(st.booleans()):
        sets["train.checkpoint_unit"] = "step"
    return [item for k, v in sets.items() for item in ("--set", f"{k}={flow(v)}")]


RUN_CONFIG = """name: drawn
data: {dataset: "synthetic:classification", samples: 64, features: 4, classes: 3}
model:
  input_shape: [4]
  layers:
    - {type: dense, units: 3}
train: {epochs: 1}
"""

# Each drawn run through the real CLI, in one process per backend (Horovod stays up between
# sessions): prints, per run, its exit code and what it wrote to stderr (the Python side).
DRIVER = """
import contextlib, io, json, sys, traceback
from hvtrain.cli import cli
results = []
for argv in json.load(sys.stdin):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv, prog_name="hvtrain", standalone_mode=False)
        except BaseException:
            code = "traceback"
            traceback.print_exc(file=err)
    results.append({"code": 0 if code is None else code, "stderr": err.getvalue()})
print("RESULTS " + json.dumps(results))
"""


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=2, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(run_args(), min_size=3, max_size=3))
def test_in_range_draws_train_or_are_refused_in_one_line(tmp_path, backend, draws):
    config = tmp_path / "drawn.yaml"
    config.write_text(RUN_CONFIG)
    runs = [["train", str(config), "--backend", backend, "--quiet", "--output-dir", str(tmp_path / f"run{i}"), *args]
            for i, args in enumerate(draws)]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("HVTRAIN_", "OMPI_", "PMIX_"))}
    proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(runs), cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**env, "TF_CPP_MIN_LOG_LEVEL": "3"})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line is not None, f"the driver died (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    for argv, result in zip(runs, json.loads(line[len("RESULTS "):]), strict=True):
        errors = [x for x in result["stderr"].splitlines() if x.startswith("hvtrain: error:")]
        assert "Traceback" not in result["stderr"], (argv, result["stderr"][-3000:])
        assert result["code"] == 0 or (result["code"] == 2 and len(errors) == 1), (argv, result)
        if result["code"] == 0:  # it trained: the run's weights and summary are there
            out = Path(argv[argv.index("--output-dir") + 1])
            assert (out / "final.safetensors").is_file() and (out / "summary.json").is_file(), argv
