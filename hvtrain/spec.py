"""The neutral model spec: layer catalogue, shape inference, neutral weight layout, numpy init.

Both backends build their native model from a `ModelSpec` and load the same initial
weights, generated here once in numpy from the seed. Tensors are channels-last
(batch, H, W, C) and sequences (batch, T, F), as in Keras; the torch backend permutes
around its NCHW ops so that the neutral layout is the same for both.

Neutral weight names are `layers.<i>.<param>`:
  dense      kernel [in, units], bias [units]
  conv2d     kernel [kh, kw, in, filters], bias [filters]
  batchnorm  gamma, beta, moving_mean, moving_variance [C]
  embedding  embeddings [input_dim, output_dim]
  lstm       kernel [in, 4u], recurrent_kernel [u, 4u], bias [4u]; gates i, f, c, o
  gru        kernel [in, 3u], recurrent_kernel [u, 3u], bias [2, 3u] (input, recurrent);
             gates z, r, h; reset applied after the recurrent matmul (Keras reset_after=True)
Initialisers (Keras defaults): glorot_uniform kernels, orthogonal recurrent kernels,
zero biases (LSTM forget-gate bias 1), uniform(-0.05, 0.05) embeddings. Layer i draws
from numpy's default_rng([seed, i]) in the order of the table above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hvtrain.config import Config
from hvtrain.errors import ConfigError

ACTIVATIONS = ("relu", "tanh", "sigmoid", "gelu", "softmax", "linear")
_REQUIRED = object()

# option -> (kind, default). Kinds are checked by _check_option.
LAYER_OPTIONS: dict[str, dict[str, tuple[str, Any]]] = {
    "dense": {"units": ("pos_int", _REQUIRED), "activation": ("activation", None), "use_bias": ("bool", True)},
    "conv2d": {"filters": ("pos_int", _REQUIRED), "kernel_size": ("pair", 3), "strides": ("pair", 1),
               "padding": ("padding", "valid"), "activation": ("activation", None), "use_bias": ("bool", True)},
    "maxpool2d": {"pool_size": ("pair", 2), "strides": ("pair_or_none", None)},
    "avgpool2d": {"pool_size": ("pair", 2), "strides": ("pair_or_none", None)},
    "flatten": {},
    "reshape": {"shape": ("shape", _REQUIRED)},
    "dropout": {"rate": ("rate", _REQUIRED)},
    "batchnorm": {"momentum": ("rate", 0.99), "epsilon": ("pos_float", 1e-3)},
    "activation": {"activation": ("activation", _REQUIRED)},
    "embedding": {"input_dim": ("pos_int", _REQUIRED), "output_dim": ("pos_int", _REQUIRED)},
    "lstm": {"units": ("pos_int", _REQUIRED), "return_sequences": ("bool", False)},
    "gru": {"units": ("pos_int", _REQUIRED), "return_sequences": ("bool", False)},
}


@dataclass(frozen=True)
class WeightSpec:
    name: str  # neutral name, layers.<i>.<param>
    shape: tuple[int, ...]
    init: str  # glorot_uniform | orthogonal | zeros | ones | lstm_bias | uniform_0.05
    trainable: bool = True


@dataclass(frozen=True)
class LayerSpec:
    index: int
    type: str
    options: dict[str, Any]
    input_shape: tuple[int, ...]  # without the batch axis
    output_shape: tuple[int, ...]
    weights: tuple[WeightSpec, ...] = ()
    stage: int | None = None  # a `stage: N` key on the layer (pipeline placement)

    @property
    def param_count(self) -> int:
        return sum(math.prod(w.shape) for w in self.weights if w.trainable)


@dataclass
class ModelSpec:
    input_shape: tuple[int, ...]
    layers: list[LayerSpec] = field(default_factory=list)

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.layers[-1].output_shape if self.layers else self.input_shape

    @property
    def param_count(self) -> int:
        return sum(layer.param_count for layer in self.layers)

    @property
    def integer_input(self) -> bool:
        """Embedding first: inputs are token ids, not features."""
        return bool(self.layers) and self.layers[0].type == "embedding"

    def weight_specs(self) -> list[WeightSpec]:
        return [w for layer in self.layers for w in layer.weights]

    def init_weights(self, seed: int) -> dict[str, np.ndarray]:
        """Initial weights in the neutral layout, identical for every backend."""
        out = {}
        for layer in self.layers:
            rng = np.random.default_rng([seed, layer.index])
            for w in layer.weights:
                out[w.name] = _initialise(w, rng)
        return out


def build_spec(cfg: Config) -> ModelSpec:
    """Validate `model.layers` and infer every layer's shapes.

    Raises:
        ConfigError: unknown layer type or option, bad option value, or a shape that
            cannot flow through the stack; located at `model.layers[i].key`.
    """
    shape = tuple(cfg.model.input_shape or ())
    spec = ModelSpec(input_shape=shape)
    for i, raw in enumerate(cfg.model.layers):
        path = f"model.layers[{i}]"
        if not isinstance(raw, dict):
            raise cfg.fail(path, f"expected a mapping like {{type: dense, units: 10}}, got {raw!r}")
        kind = raw.get("type")
        if kind not in LAYER_OPTIONS:
            raise cfg.fail(f"{path}.type" if "type" in raw else path,
                           f"unknown layer type {kind!r}; expected one of {', '.join(LAYER_OPTIONS)}")
        stage = raw.get("stage")
        if stage is not None and (not isinstance(stage, int) or isinstance(stage, bool) or stage < 0):
            raise cfg.fail(f"{path}.stage", f"expected a stage number >= 0, got {stage!r}")
        options = _layer_options(cfg, path, kind, {k: v for k, v in raw.items() if k != "stage"})
        try:
            out_shape, weights = _infer(cfg, path, i, kind, options, shape)
        except ConfigError as exc:
            previous = spec.layers[-1].stage if spec.layers else None
            if stage is not None and previous is not None and stage != previous:
                raise ConfigError(f"{exc} (stage boundary {previous} -> {stage}: stage {previous} outputs "
                                  f"{list(shape)})") from None
            raise
        spec.layers.append(LayerSpec(i, kind, options, shape, out_shape, tuple(weights), stage))
        shape = out_shape
    return spec


def check_against_data(cfg: Config, spec: ModelSpec, feature_shape: tuple[int, ...], num_outputs: int) -> None:
    """The model's input must take the data and its output must match the targets."""
    want = math.prod(spec.input_shape)
    have = math.prod(feature_shape)
    if want != have:
        raise cfg.fail("model.input_shape", f"expected {have} values per sample to match dataset "
                       f"{cfg.data.dataset!r} (features {list(feature_shape)}), got {list(spec.input_shape)} "
                       f"({want} values)")
    out = spec.output_shape
    if len(out) != 1 or out[0] != num_outputs:
        what = {"cross_entropy": f"{num_outputs} classes", "binary_cross_entropy": "1 logit"}.get(
            cfg.loss, f"{num_outputs} targets")
        last = f"model.layers[{len(spec.layers) - 1}]" if spec.layers else "model.layers"
        raise cfg.fail(last, f"model output shape {list(out)} does not match the data: expected [{num_outputs}] "
                       f"({what} for loss {cfg.loss!r})")


# ----------------------------------------------------------------------------- options


def _layer_options(cfg: Config, path: str, kind: str, raw: dict) -> dict[str, Any]:
    schema = LAYER_OPTIONS[kind]
    out: dict[str, Any] = {}
    for key in raw:
        if key != "type" and key not in schema:
            allowed = ", ".join(schema) or "no options"
            raise cfg.fail(f"{path}.{key}", f"unknown option for {kind}; expected {allowed} (or stage)")
    for key, (check, default) in schema.items():
        if key not in raw:
            if default is _REQUIRED:
                raise cfg.fail(path, f"{kind} needs option {key!r}")
            out[key] = default if default is None else _check_option(cfg, f"{path}.{key}", check, default)
            continue
        out[key] = _check_option(cfg, f"{path}.{key}", check, raw[key])
    return out


def _check_option(cfg: Config, path: str, check: str, value: Any) -> Any:
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if check == "pos_int" and is_int(value) and value > 0:
        return value
    if check == "bool" and isinstance(value, bool):
        return value
    if check == "activation" and (value is None or value in ACTIVATIONS):
        return None if value == "linear" else value
    if check == "padding" and value in ("valid", "same"):
        return value
    if check == "rate" and isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1:
        return float(value)
    if check == "pos_float" and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    if check in ("pair", "pair_or_none"):
        if value is None and check == "pair_or_none":
            return None
        if is_int(value) and value > 0:
            return (value, value)
        if isinstance(value, list) and len(value) == 2 and all(is_int(v) and v > 0 for v in value):
            return tuple(value)
    if check == "shape" and isinstance(value, list) and value and all(is_int(v) and v > 0 for v in value):
        return tuple(value)
    expected = {
        "pos_int": "a positive integer", "bool": "true or false", "padding": "valid or same",
        "activation": f"one of {', '.join(ACTIVATIONS)}", "rate": "a number in [0, 1)",
        "pos_float": "a positive number", "pair": "a positive integer or [h, w]",
        "pair_or_none": "a positive integer, [h, w] or null", "shape": "a list of positive integers",
    }[check]
    return _raise(cfg.fail(path, f"expected {expected}, got {value!r}"))


def _raise(exc: Exception) -> Any:
    raise exc


# ----------------------------------------------------------------------------- shapes


def _infer(cfg: Config, path: str, i: int, kind: str, o: dict, shape: tuple[int, ...]):
    def w(param: str, shp: tuple[int, ...], init: str, trainable: bool = True) -> WeightSpec:
        return WeightSpec(f"layers.{i}.{param}", tuple(int(s) for s in shp), init, trainable)

    def need_rank(n: int, what: str) -> None:
        if len(shape) != n:
            raise cfg.fail(f"{path}.type", f"{kind} expects {what} input, got shape {list(shape)}; "
                           "add a reshape or flatten layer before it")

    if kind == "dense":
        fan_in = shape[-1]
        weights = [w("kernel", (fan_in, o["units"]), "glorot_uniform")]
        if o["use_bias"]:
            weights.append(w("bias", (o["units"],), "zeros"))
        return shape[:-1] + (o["units"],), weights
    if kind == "conv2d":
        need_rank(3, "(H, W, C) image")
        (kh, kw), (sh, sw) = o["kernel_size"], o["strides"]
        if o["padding"] == "same" and (sh, sw) != (1, 1):
            raise cfg.fail(f"{path}.padding", "padding 'same' needs strides 1 (torch cannot express "
                           f"asymmetric same-padding), got strides {[sh, sw]}")
        h, wd = _spatial(cfg, path, shape, (kh, kw), (sh, sw), o["padding"])
        weights = [w("kernel", (kh, kw, shape[2], o["filters"]), "glorot_uniform")]
        if o["use_bias"]:
            weights.append(w("bias", (o["filters"],), "zeros"))
        return (h, wd, o["filters"]), weights
    if kind in ("maxpool2d", "avgpool2d"):
        need_rank(3, "(H, W, C) image")
        strides = o["strides"] or o["pool_size"]
        h, wd = _spatial(cfg, path, shape, o["pool_size"], strides, "valid")
        return (h, wd, shape[2]), []
    if kind == "flatten":
        return (math.prod(shape),), []
    if kind == "reshape":
        if math.prod(o["shape"]) != math.prod(shape):
            raise cfg.fail(f"{path}.shape", f"cannot reshape {list(shape)} ({math.prod(shape)} values) "
                           f"to {list(o['shape'])} ({math.prod(o['shape'])} values)")
        return tuple(o["shape"]), []
    if kind in ("dropout", "activation"):
        return shape, []
    if kind == "batchnorm":
        if len(shape) not in (1, 3):
            raise cfg.fail(f"{path}.type", f"batchnorm expects (C,) or (H, W, C) input, got {list(shape)}")
        c = shape[-1]
        return shape, [w("gamma", (c,), "ones"), w("beta", (c,), "zeros"),
                       w("moving_mean", (c,), "zeros", False), w("moving_variance", (c,), "ones", False)]
    if kind == "embedding":
        need_rank(1, "(T,) token-id")
        if i != 0:
            raise cfg.fail(f"{path}.type", "embedding must be the first layer (it takes token ids)")
        return shape + (o["output_dim"],), [w("embeddings", (o["input_dim"], o["output_dim"]), "uniform_0.05")]
    if kind in ("lstm", "gru"):
        need_rank(2, "(T, F) sequence")
        u, gates = o["units"], 4 if kind == "lstm" else 3
        bias = w("bias", (gates * u,), "lstm_bias") if kind == "lstm" else w("bias", (2, gates * u), "zeros")
        weights = [w("kernel", (shape[1], gates * u), "glorot_uniform"),
                   w("recurrent_kernel", (u, gates * u), "orthogonal"), bias]
        return ((shape[0], u) if o["return_sequences"] else (u,)), weights
    raise AssertionError(kind)  # LAYER_OPTIONS and _infer list the same kinds


def _spatial(cfg: Config, path: str, shape, kernel, strides, padding) -> tuple[int, int]:
    out = []
    for size, k, s in zip(shape[:2], kernel, strides, strict=True):
        n = size if padding == "same" else (size - k) // s + 1
        if n < 1:
            raise cfg.fail(path, f"window {list(kernel)} does not fit input {list(shape[:2])}")
        out.append(n)
    return out[0], out[1]


# ----------------------------------------------------------------------------- init


def _initialise(w: WeightSpec, rng: np.random.Generator) -> np.ndarray:
    shape = w.shape
    if w.init == "zeros":
        return np.zeros(shape, np.float32)
    if w.init == "ones":
        return np.ones(shape, np.float32)
    if w.init == "uniform_0.05":
        return rng.uniform(-0.05, 0.05, shape).astype(np.float32)
    if w.init == "lstm_bias":
        b = np.zeros(shape, np.float32)
        u = shape[0] // 4
        b[u: 2 * u] = 1.0  # forget gate
        return b
    if w.init == "glorot_uniform":
        receptive = math.prod(shape[:-2]) if len(shape) > 2 else 1
        fan_in, fan_out = shape[-2] * receptive, shape[-1] * receptive
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-limit, limit, shape).astype(np.float32)
    if w.init == "orthogonal":
        rows, cols = shape
        a = rng.standard_normal((max(rows, cols), min(rows, cols)))
        q, r = np.linalg.qr(a)
        q *= np.sign(np.diag(r))
        q = q if rows >= cols else q.T
        return q[:rows, :cols].astype(np.float32)
    raise AssertionError(w.init)


# ----------------------------------------------------------------------------- neutral files


def check_weights(spec: ModelSpec, weights: dict[str, np.ndarray], source: str) -> None:
    """Names and shapes of a neutral weight set must be exactly the spec's.

    Raises:
        DataError: naming the first missing, unexpected or mis-shaped key.
    """
    from hvtrain.errors import DataError

    expected = {w.name: w.shape for w in spec.weight_specs()}
    for name, shape in expected.items():
        if name not in weights:
            raise DataError(f"{source}: missing weight {name!r} (shape {list(shape)}) required by the config")
        if tuple(weights[name].shape) != shape:
            raise DataError(f"{source}: weight {name!r} has shape {list(weights[name].shape)}, "
                            f"the config's model needs {list(shape)}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise DataError(f"{source}: weight {extra[0]!r} is not part of the config's model "
                        f"({len(extra)} unexpected key(s))")


def per_layer(spec: ModelSpec, weights: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Neutral weights grouped by layer: result[i][param] = weights['layers.<i>.<param>']."""
    out: list[dict[str, np.ndarray]] = [{} for _ in spec.layers]
    for layer in spec.layers:
        for w in layer.weights:
            out[layer.index][w.name.rsplit(".", 1)[1]] = weights[w.name]
    return out


def from_layers(spec: ModelSpec, grouped: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Inverse of per_layer."""
    return {f"layers.{i}.{param}": np.asarray(v, np.float32)
            for i, layer_w in enumerate(grouped) for param, v in layer_w.items()}
