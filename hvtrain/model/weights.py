"""Weight files and what travels with them: the weights, and how raw inputs become model inputs.

Both kinds of file hvtrain writes can be read as weights:
  - `final.safetensors`: the weights (neutral layout; native names for entrypoint models), with
    header metadata `inputs`;
  - a checkpoint (`ckpt-*.safetensors`, hvtrain.io.checkpoints): its `weights.*` tensors hold the
    same weights, and its verified `meta` holds the same `inputs`.
`inputs` is what predicting needs without the training data: the shape of one raw row as the
dataset stores it, the input dtype, the normalisation fitted on the training split (shift and
scale, base64 of the little-endian bytes: exact; float64, `stats_dtype`, as training computes and
applies them; float32 in files written before that key), the reshape to the model's input
shape, the loss, the number of outputs, the class labels (classification), the dtype the dataset
stores raw rows in (`raw_dtype`: what an export's graph must take to lose nothing; absent in files
written before it, then taken as float64) and, for a text corpus,
its vocabulary (`text`: word -> id, PAD 0, OOV 1, max_len, the tokenizer) and, for a forecaster
trained on normalised targets (data.window), the targets' shift and scale (`target`: predictions
are turned back into the series' units), and for an entrypoint model the form of its output
(`output`: hvtrain.model.native.OutputForm, decided when it was built to train; evaluate, predict,
export and a resume reuse it). Reading never executes code (safetensors and JSON only).
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hvtrain.data.dataset import Transform
from hvtrain.errors import DataError, HvtrainError
from hvtrain.io.checkpoints import FORMAT as CHECKPOINT_FORMAT
from hvtrain.io.checkpoints import load as load_checkpoint
from hvtrain.model.native import OutputForm

if TYPE_CHECKING:
    from hvtrain.config.schema import Config
    from hvtrain.data.dataset import Dataset
    from hvtrain.model.spec import ModelSpec

INPUTS_KEY = "inputs"  # the metadata key (final.safetensors) / meta key (checkpoints)
INPUTS_VERSION = 1
WEIGHTS_PREFIX = "weights."  # a checkpoint's copy of the whole model's weights
_DTYPES = {"float32": np.float32, "int64": np.int64}
_STATS_DTYPES = {"float32": "<f4", "float64": "<f8"}  # the normalisation statistics' encoding


@dataclass(frozen=True)
class Inputs:
    """How raw feature rows become this model's inputs, and what its outputs mean."""

    features: tuple[int, ...]  # one raw row, as the dataset stores it
    transform: Transform  # dtype, normalisation (training split), reshape
    normalize: str  # none | standard | minmax (for messages)
    loss: str
    outputs: int  # model output width
    classes: np.ndarray | None  # raw label of each class id (classification), else None
    text: dict[str, Any] | None = None  # a text corpus's vocabulary (hvtrain.data.text.vocabulary_record)
    target: tuple[float, float] | None = None  # (shift, scale) of normalised regression targets: y = out*scale+shift
    split: dict[str, Any] | None = None  # what chose the validation samples (hvtrain.data.dataset.Dataset.split)
    raw_dtype: str | None = None  # the dataset's raw rows (float64, float32, uint8, ...); None: not recorded
    output: OutputForm | None = None  # an entrypoint model's output form (hvtrain.model.native); None: a
    # config's model, or a file written before the form travelled (then decided on the loaded model)

    @property
    def width(self) -> int:
        return math.prod(self.features)


# An export's graph normalises in float32, as before statistics travelled in float64, unless that
# would lose the raw values: rounding a raw value (and the shift) to float32 moves the normalised
# value by about 2**-24 * (|shift| / scale + a few), so up to |shift| <= 16 * scale float32 keeps
# it to ~1e-6 (the export's tolerance is 1e-4). Beyond (Unix timestamps, coordinates in metres,
# 1e8 + N(0, 1)) the graph normalises in float64, and takes float64 rows when float32 cannot hold
# the raw dtype.
FLOAT32_SHIFT_RATIO = 16.0


def export_dtypes(inputs: Inputs) -> tuple[np.dtype, np.dtype | None]:
    """(the dtype of an exported graph's input `x`, the dtype its normalisation runs in; None:
    it does not normalise). Only features far from zero relative to their spread (|shift| > 16 x
    scale) are normalised in float64, so every other graph (the catalogue's, sklearn's, images')
    has no float64 op (TensorRT, TFLite and many accelerators run none) and takes float32 rows, as
    before. A graph that normalises in float64 takes float64 rows when float32 cannot hold the
    raw dtype (float64, integers of more than 16 bits, or a record without raw_dtype), else float32."""
    t = inputs.transform
    model_input = np.dtype(t.dtype)
    if t.shift is None:
        return model_input, None  # training cast the raw rows to the model's dtype: the caller may as well
    ratio = np.abs(np.asarray(t.shift, np.float64)) / np.asarray(t.scale, np.float64)
    if not len(ratio) or float(ratio.max()) <= FLOAT32_SHIFT_RATIO:
        return np.dtype(np.float32), np.dtype(np.float32)
    raw = np.dtype(inputs.raw_dtype or "float64")
    exact = np.can_cast(raw, np.float32, "safe")  # float16/32, (u)int8/16, bool
    return np.dtype(np.float32 if exact else np.float64), np.dtype(np.float64)


@dataclass
class WeightFile:
    path: str
    weights: dict[str, np.ndarray]
    inputs: Inputs | None  # None: written before inputs travelled with weights
    kind: str  # "weights" or "checkpoint"
    # each layer's (type, name) in the model the file was written from, by index ("" unnamed);
    # None: not recorded (an older or foreign file, an entrypoint model)
    layers: list[tuple[str, str]] | None = None


def describe_inputs(cfg: Config, data: Dataset, output: OutputForm | None = None) -> dict[str, Any]:
    """The JSON-able `inputs` record of a training run's data (see the module docstring), with
    `output`, the form an entrypoint model's output was decided to have when it was built to train."""
    t = data.train.transform
    classes = None
    if data.classes is not None:
        listed = data.classes.tolist()
        classes = listed if all(isinstance(c, (int, float, str)) for c in listed) else None
    return {"version": INPUTS_VERSION, "features": list(data.train.source.feature_shape),
            "dtype": np.dtype(t.dtype).name, "normalize": cfg.data.normalize if t.shift is not None else "none",
            "shift": _encode(t.shift), "scale": _encode(t.scale), "stats_dtype": "float64",
            "input_shape": list(t.shape) if t.shape is not None else None,
            "loss": cfg.loss, "outputs": int(data.num_outputs), "classes": classes,
            "raw_dtype": data.train.source.features(data.train.rows[:1]).dtype.name,
            **({"text": data.text} if data.text is not None else {}),
            **({"split": data.split} if data.split is not None else {}),
            **({"target": {"shift": float(data.series["shift"]), "scale": float(data.series["scale"])}}
               if data.series is not None and (data.series["shift"], data.series["scale"]) != (0.0, 1.0) else {}),
            **({"output": output.record()} if output is not None else {})}


def inputs_from(record: Any, where: str) -> Inputs:
    """Parse an `inputs` record.

    Raises:
        DataError: a record that is not one this version understands (named by `where`).
    """
    try:
        if not isinstance(record, dict):
            raise TypeError(f"expected a JSON object, got {type(record).__name__}")
        if record.get("version") != INPUTS_VERSION:
            raise ValueError(f"expected version {INPUTS_VERSION}, got {record.get('version')!r}")
        features = tuple(int(v) for v in record["features"])
        shape = tuple(int(v) for v in record["input_shape"]) if record["input_shape"] is not None else None
        stats = record.get("stats_dtype", "float32")  # absent: written when the statistics were float32
        if stats not in _STATS_DTYPES:
            raise ValueError(f"stats_dtype: expected one of {sorted(_STATS_DTYPES)}, got {stats!r}")
        shift, scale = _decode(record["shift"], stats), _decode(record["scale"], stats)
        if (shift is None) != (scale is None) or shift is not None and (
                len(shift) != math.prod(features) or len(scale) != len(shift)):
            raise ValueError(f"normalisation statistics of {None if shift is None else len(shift)} values for "
                             f"rows of shape {list(features)}")
        classes = record["classes"]
        return Inputs(features, Transform(_DTYPES[record["dtype"]], shift, scale, shape), str(record["normalize"]),
                      str(record["loss"]), int(record["outputs"]),
                      np.asarray(classes) if classes is not None else None, _text_record(record.get("text")),
                      _target_record(record.get("target")), _split_record(record.get("split")),
                      _raw_dtype(record.get("raw_dtype")),
                      OutputForm.from_record(record["output"]) if record.get("output") is not None else None)
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{where}: unreadable '{INPUTS_KEY}' metadata ({type(exc).__name__}: {exc})") from None


def _target_record(target: Any) -> tuple[float, float] | None:
    if target is None:
        return None
    if not isinstance(target, dict) or not all(isinstance(target.get(k), (int, float)) for k in ("shift", "scale")) \
            or not (math.isfinite(target["shift"]) and math.isfinite(target["scale"]) and target["scale"] > 0):
        raise ValueError(f"target: expected finite shift and a positive scale, got {str(target)[:60]}")
    return float(target["shift"]), float(target["scale"])


def _raw_dtype(name: Any) -> str | None:
    if name is None:
        return None
    try:
        dtype = np.dtype(str(name))
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biuf":
        raise ValueError(f"raw_dtype: expected a numeric dtype name, got {str(name)[:40]!r}")
    return dtype.name


def _split_record(split: Any) -> dict[str, Any] | None:
    if split is None:
        return None
    if not isinstance(split, dict) or not {"seed", "validation_split", "samples"} <= set(split):
        raise ValueError(f"split: expected seed, validation_split and samples, got {str(split)[:60]}")
    return split


def evaluation_data(cfg: Config, data: Dataset, inputs: Inputs | None, where: str) -> tuple[Dataset, list[str]]:
    """The data `hvtrain evaluate` scores saved weights on: this config's validation split, fed as
    the weights were trained (their inputs record's normalisation, not the config's: predict does
    the same), and the notes to print. Evaluating with the config's statistics scored another
    model input (trained with minmax, evaluated standardised: 0.877 instead of 0.928).

    Raises:
        ConfigError: a split that would put the weights' training samples into this validation
            split (another seed or data.validation_split on the same samples), classes that map to
            other ids, a series normalised otherwise (its targets were scaled by the config).
        DataError: rows of another shape than the weights were trained on.
    """
    from dataclasses import replace

    if inputs is None:  # written before the record travelled: nothing to compare
        return data, []
    have = tuple(data.train.source.feature_shape)
    if inputs.features != have:
        raise DataError(f"{where}: trained on rows of shape {list(inputs.features)}, {data.name} has {list(have)}")
    ours, theirs, notes = data.split, inputs.split, []
    if ours is not None and theirs is not None:
        if ours["samples"] != theirs["samples"]:
            notes.append(f"evaluate: {where} was trained on {theirs['samples']} samples split by seed "
                         f"{theirs['seed']} and validation_split {theirs['validation_split']}; {data.name} has "
                         f"{ours['samples']}: its validation split may hold samples the weights were trained on")
        else:
            differ = [k for k in ("seed", "validation_split") if ours[k] != theirs[k]]
            if differ:
                key = "seed" if "seed" in differ else "data.validation_split"
                raise cfg.fail(key, f"{where} was trained with seed {theirs['seed']} and data.validation_split "
                               f"{theirs['validation_split']} on these {ours['samples']} samples, this config splits "
                               f"with {', '.join(f'{k} {ours[k]}' for k in differ)}: its validation split would "
                               "hold training samples; evaluate with the training run's values")
    if inputs.classes is not None and data.classes is not None \
            and inputs.classes.tolist() != data.classes.tolist():
        raise cfg.fail("data", f"{where} was trained on the classes {inputs.classes.tolist()[:8]}, {data.name} has "
                       f"{data.classes.tolist()[:8]}: class ids would mean other labels")
    t, mine = inputs.transform, data.val.transform
    same = (t.shift is None) == (mine.shift is None) and (t.shift is None or (
        np.array_equal(t.shift, mine.shift) and np.array_equal(t.scale, mine.scale)))
    if same:
        return data, notes
    if data.series is not None:
        raise cfg.fail("data.normalize", f"{where} was trained on the series normalised with '{inputs.normalize}' "
                       f"statistics of its training part, this config's data.normalize '{cfg.data.normalize}' gives "
                       "others (and scales the targets by them): evaluate with the training run's data settings")
    fed = replace(t, shape=mine.shape, dtype=mine.dtype)
    notes.append(f"evaluate: inputs normalised as {where} was trained ({inputs.normalize}, the training split's "
                 f"statistics from its inputs record), not by this config's data.normalize '{cfg.data.normalize}'")
    return replace(data, train=replace(data.train, transform=fed), val=replace(data.val, transform=fed)), notes


def _text_record(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict) or not isinstance(text.get("vocabulary"), dict) or "max_len" not in text:
        raise ValueError(f"text: expected a vocabulary record (vocabulary, max_len, ...), got {str(text)[:60]}")
    return text


def read_weights(path: str | Path) -> WeightFile:
    """The weights of a final.safetensors (any backend's) or of a checkpoint, and their inputs record.

    Raises:
        DataError: missing or unreadable file; a checkpoint that holds no weights copy.
        CheckpointError: a checkpoint that does not verify (checksum, format).
    """
    from safetensors import SafetensorError, safe_open

    where = str(path)
    try:
        with safe_open(where, framework="numpy") as fh:
            metadata = fh.metadata() or {}
    except FileNotFoundError:
        raise DataError(f"{where}: weights file not found") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise DataError(f"{where}: not a readable safetensors file ({str(exc).splitlines()[0]})") from None
    if metadata.get("format") == CHECKPOINT_FORMAT:
        ckpt = load_checkpoint(where)  # verified: checksum over tensors and meta
        weights = {k[len(WEIGHTS_PREFIX):]: v for k, v in ckpt.tensors.items() if k.startswith(WEIGHTS_PREFIX)}
        if not weights:
            raise DataError(f"{where}: this checkpoint holds no copy of the model's weights (written by an older "
                            "hvtrain); use the run's final.safetensors, or a checkpoint of a newer run")
        record = ckpt.meta.get(INPUTS_KEY)
        return WeightFile(where, weights, inputs_from(record, where) if record is not None else None, "checkpoint",
                          _config_layers(ckpt.meta.get("config")))
    weights = load_weights(where)
    layers = _metadata_layers(metadata)
    text = metadata.get(INPUTS_KEY)
    if text is None:
        return WeightFile(where, weights, None, "weights", layers)
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: unreadable '{INPUTS_KEY}' metadata (not JSON: {exc})") from None
    return WeightFile(where, weights, inputs_from(record, where), "weights", layers)


def layer_metadata(spec: ModelSpec | None) -> dict[str, str]:
    """final.safetensors metadata naming the model's layers by index: `layers` (types, comma
    separated) and `layer_names` (a JSON list, "" for an unnamed layer); init_from compares them."""
    if spec is None:
        return {"layers": "", "layer_names": "[]"}
    return {"layers": ",".join(layer.type for layer in spec.layers),
            "layer_names": json.dumps([layer.name for layer in spec.layers])}


def _metadata_layers(metadata: dict[str, str]) -> list[tuple[str, str]] | None:
    types = [t for t in metadata.get("layers", "").split(",") if t]
    if not types:
        return None
    try:
        names = json.loads(metadata.get("layer_names", "null"))
    except json.JSONDecodeError:
        names = None
    if not isinstance(names, list) or len(names) != len(types):
        names = [""] * len(types)  # written before names travelled with the types
    return [(t, str(n or "")) for t, n in zip(types, names, strict=True)]


def _config_layers(config: Any) -> list[tuple[str, str]] | None:
    """A checkpoint's layers, from the config it holds (None when that no longer builds a spec)."""
    from hvtrain.config.load import load_config
    from hvtrain.model.spec import build_spec

    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict) or not model.get("layers"):
        return None
    # the model section alone: the rest of an older run's config need not validate today
    model = {k: model[k] for k in ("input_shape", "layers", "output") if model.get(k) is not None}
    try:
        spec = build_spec(load_config({"name": "checkpoint", "model": model}, need_data=False))
    except (HvtrainError, KeyError, TypeError, ValueError):
        return None
    return [(layer.type, layer.name) for layer in spec.layers]


def load_weights(path: str) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file (never pickle: loading cannot run code)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(path)
    except FileNotFoundError:
        raise DataError(f"{path}: weights file not found") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable safetensors file ({exc})") from None


def require_inputs(wf: WeightFile) -> Inputs:
    """The inputs record, or an error saying which file lacks what."""
    if wf.inputs is None:
        raise DataError(f"{wf.path}: no '{INPUTS_KEY}' metadata (the normalisation statistics fitted on the "
                        "training split, the raw feature shape and the class labels); the file was written by an "
                        "older hvtrain or another tool: retrain with this version to predict without the training "
                        "data (`hvtrain evaluate`, which opens the data, still takes it)")
    return wf.inputs


def initial_weights(cfg: Config, spec: ModelSpec) -> tuple[dict[str, np.ndarray], str | None]:
    """A run's initial weights: the seeded ones (spec.init_weights), replaced by model.init_from's in
    every layer not named in model.init_skip. Layers match by index (`layers.<i>`, as in every
    neutral file); where the file records its layers (final.safetensors metadata, a checkpoint's
    config) each layer's type must be the same, and each tensor's shape is checked. A different
    name is allowed (layers get renamed) and listed in the returned line, which says what was
    loaded (None without init_from).

    Raises:
        ConfigError: an unknown init_skip name, an unreadable file, a layer of another type, a
            missing or mis-shaped tensor (located at model.init_from, naming both layers).
    """
    weights = spec.init_weights(cfg.seed)
    m = cfg.model
    if m.init_from is None:
        return weights, None
    named = {layer.name: layer for layer in spec.layers if layer.name}
    for name in m.init_skip:
        if name not in named:
            raise cfg.fail("model.init_skip", f"no layer is named {name!r}; named layers: "
                           f"{', '.join(named) or 'none (give the layers a name:)'}")
    path = Path(m.init_from)
    if not path.is_absolute() and not path.exists() and (Path(cfg.source).parent / path).exists():
        path = Path(cfg.source).parent / path  # relative to the config file
    try:
        wf = read_weights(path)
    except HvtrainError as exc:
        raise cfg.fail("model.init_from", str(exc)) from None
    skip = {named[name].index for name in m.init_skip}
    loaded, renamed = [], []
    for layer in spec.layers:
        if layer.index in skip or not layer.weights:
            continue
        label = layer.path + (f" ({layer.name})" if layer.name else "")
        if wf.layers is not None and layer.index < len(wf.layers):
            kind, name = wf.layers[layer.index]
            there = f"layers.{layer.index}" + (f" ({name})" if name else "")
            if kind != layer.type:
                raise cfg.fail("model.init_from", f"{path}: {there} is a {kind} layer, {label} here is a "
                               f"{layer.type}: layers match by index, so the shared layers must come first and in "
                               "the same order; list the layer's name in model.init_skip to keep its seeded init")
            if name and layer.name and name != layer.name:
                renamed.append(f"{name} -> {layer.name}")
        for w in layer.weights:
            got = wf.weights.get(w.name)
            if got is None or tuple(got.shape) != w.shape:
                have = "has no such tensor" if got is None else f"has shape {list(got.shape)}"
                raise cfg.fail("model.init_from", f"{path}: {w.name} of {label} {have}, the model needs "
                               f"{list(w.shape)}; list the layer's name in model.init_skip to keep its seeded init")
            weights[w.name] = np.array(got, np.float32)
        loaded.append(layer.name or str(layer.index))
    frozen = [layer.name or str(layer.index) for layer in spec.layers if not layer.trainable and layer.weights]
    return weights, (f"init_from {path}: layers {', '.join(loaded) or 'none'} loaded"
                     + (f" (renamed: {', '.join(renamed)})" if renamed else "")
                     + (f"; {', '.join(m.init_skip)} seeded" if m.init_skip else "")
                     + (f"; frozen: {', '.join(frozen)}" if frozen else ""))


def _encode(a: np.ndarray | None) -> str | None:
    return None if a is None else base64.b64encode(np.ascontiguousarray(a, "<f8").tobytes()).decode("ascii")


def _decode(text: str | None, dtype: str = "float64") -> np.ndarray | None:
    if text is None:
        return None
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    code = _STATS_DTYPES[dtype]
    if len(raw) % np.dtype(code).itemsize:
        raise ValueError(f"{len(raw)} bytes is not a whole number of {dtype} values")
    return np.frombuffer(raw, code).astype(dtype)
