"""The neutral layer catalogue: options, shape inference, weight layout and numpy initialisers.

Shapes exclude the batch axis and are channels-last, as in Keras. Every layer takes a list of
input shapes (one for most layers, several for merges and cross-attention) and returns its output
shape and weights. Weight names are `layers.<i>.<param>`; layouts are Keras's (docs/your-data-and-models.md's table).
Initialisers mirror Keras's defaults in numpy: glorot_uniform kernels (fans as Keras computes
them for any rank), orthogonal recurrent kernels, zero biases, ones for scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

ACTIVATIONS = ("relu", "tanh", "sigmoid", "gelu", "softmax", "linear")
REQUIRED = object()

# option -> (kind, default). Kinds are checked by check_option.
LAYER_OPTIONS: dict[str, dict[str, tuple[str, Any]]] = {
    "dense": {"units": ("pos_int", REQUIRED), "activation": ("activation", None), "use_bias": ("bool", True)},
    "conv2d": {"filters": ("pos_int", REQUIRED), "kernel_size": ("pair", 3), "strides": ("pair", 1),
               "padding": ("padding", "valid"), "activation": ("activation", None), "use_bias": ("bool", True)},
    "conv1d": {"filters": ("pos_int", REQUIRED), "kernel_size": ("pos_int", 3), "strides": ("pos_int", 1),
               "padding": ("padding", "valid"), "activation": ("activation", None), "use_bias": ("bool", True)},
    "maxpool2d": {"pool_size": ("pair", 2), "strides": ("pair_or_none", None)},
    "avgpool2d": {"pool_size": ("pair", 2), "strides": ("pair_or_none", None)},
    "maxpool1d": {"pool_size": ("pos_int", 2), "strides": ("pos_int_or_none", None)},
    "avgpool1d": {"pool_size": ("pos_int", 2), "strides": ("pos_int_or_none", None)},
    "global_avgpool": {},
    "global_maxpool": {},
    "flatten": {},
    "zeropad2d": {"padding": ("pair", 1)},  # zeros around H and W (both sides): a strided conv's symmetric padding
    "reshape": {"shape": ("shape", REQUIRED)},
    "dropout": {"rate": ("rate", REQUIRED)},
    "batchnorm": {"momentum": ("rate", 0.99), "epsilon": ("pos_float", 1e-3)},
    "layernorm": {"epsilon": ("pos_float", 1e-3)},
    "activation": {"activation": ("activation", REQUIRED)},
    "embedding": {"input_dim": ("pos_int", REQUIRED), "output_dim": ("pos_int", REQUIRED)},
    "positional_embedding": {"max_len": ("pos_int", REQUIRED)},
    "lstm": {"units": ("pos_int", REQUIRED), "return_sequences": ("bool", False)},
    "gru": {"units": ("pos_int", REQUIRED), "return_sequences": ("bool", False)},
    "multi_head_attention": {"num_heads": ("pos_int", REQUIRED), "key_dim": ("pos_int", REQUIRED),
                             "causal": ("bool", False), "dropout": ("rate", 0.0)},
    "add": {},
    "multiply": {},
    "concatenate": {"axis": ("int", -1)},
}
# How many inputs each layer takes: (at least, at most).
ARITY = {"add": (2, 64), "multiply": (2, 64), "concatenate": (2, 64), "multi_head_attention": (1, 2)}


@dataclass(frozen=True)
class WeightSpec:
    name: str  # neutral name, layers.<i>.<param>
    shape: tuple[int, ...]
    init: str  # glorot_uniform | orthogonal | zeros | ones | lstm_bias | uniform_0.05
    trainable: bool = True


# ----------------------------------------------------------------------------- options


def layer_options(fail, path: str, kind: str, raw: dict) -> dict[str, Any]:
    """Check a layer's options against the schema. `fail(path, message)` makes the located error."""
    schema = LAYER_OPTIONS[kind]
    out: dict[str, Any] = {}
    for key in raw:
        if key not in schema:
            allowed = ", ".join(schema) or "no options"
            raise fail(f"{path}.{key}", f"unknown option for {kind}; expected {allowed} "
                       "(or name, inputs, stage, trainable)")
    for key, (check, default) in schema.items():
        if key not in raw:
            if default is REQUIRED:
                raise fail(path, f"{kind} needs option {key!r}")
            out[key] = default if default is None else check_option(fail, f"{path}.{key}", check, default)
            continue
        out[key] = check_option(fail, f"{path}.{key}", check, raw[key])
    return out


def check_option(fail, path: str, check: str, value: Any) -> Any:
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if check == "pos_int" and is_int(value) and value > 0:
        return value
    if check == "pos_int_or_none" and (value is None or is_int(value) and value > 0):
        return value
    if check == "int" and is_int(value):
        return value
    if check == "bool" and isinstance(value, bool):
        return value
    if check == "activation" and (value is None or value in ACTIVATIONS):
        return None if value == "linear" else value
    if check == "padding" and value in ("valid", "same"):
        return value
    if check == "rate" and isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1:
        return float(value)
    if check == "pos_float" and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 \
            and value < 1e300 and math.isfinite(value):  # .inf trained on zeros; a 400-digit int: OverflowError
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
        "pos_int": "a positive integer", "pos_int_or_none": "a positive integer or null", "int": "an integer",
        "bool": "true or false", "padding": "valid or same",
        "activation": f"one of {', '.join(ACTIVATIONS)}", "rate": "a number in [0, 1)",
        "pos_float": "a finite positive number", "pair": "a positive integer or [h, w]",
        "pair_or_none": "a positive integer, [h, w] or null", "shape": "a list of positive integers",
    }[check]
    raise fail(path, f"expected {expected}, got {value!r}")


# ----------------------------------------------------------------------------- shapes


def infer(fail, path: str, i: int, kind: str, o: dict, shapes: list[tuple[int, ...]]
          ) -> tuple[tuple[int, ...], list[WeightSpec]]:
    """Output shape and weights of layer `i` given its input shapes."""
    shape = shapes[0]

    def w(param: str, shp: tuple[int, ...], init: str, trainable: bool = True) -> WeightSpec:
        return WeightSpec(f"layers.{i}.{param}", tuple(int(s) for s in shp), init, trainable)

    def need_rank(n: int, what: str) -> None:
        if len(shape) != n:
            raise fail(f"{path}.type", f"{kind} expects {what} input, got shape {list(shape)}; "
                       "add a reshape or flatten layer before it")

    def same_padding_strides(strides: tuple[int, ...]) -> None:
        if o["padding"] == "same" and any(s != 1 for s in strides):
            raise fail(f"{path}.padding", "padding 'same' needs strides 1 (torch cannot express "
                       f"asymmetric same-padding), got strides {list(strides)}")

    if kind == "dense":
        weights = [w("kernel", (shape[-1], o["units"]), "glorot_uniform")]
        if o["use_bias"]:
            weights.append(w("bias", (o["units"],), "zeros"))
        return shape[:-1] + (o["units"],), weights
    if kind in ("conv2d", "conv1d"):
        rank = 3 if kind == "conv2d" else 2
        need_rank(rank, "(H, W, C) image" if rank == 3 else "(T, C) sequence")
        kernel = o["kernel_size"] if rank == 3 else (o["kernel_size"],)
        strides = o["strides"] if rank == 3 else (o["strides"],)
        same_padding_strides(strides)
        spatial = _spatial(fail, path, shape, kernel, strides, o["padding"])
        weights = [w("kernel", tuple(kernel) + (shape[-1], o["filters"]), "glorot_uniform")]
        if o["use_bias"]:
            weights.append(w("bias", (o["filters"],), "zeros"))
        return spatial + (o["filters"],), weights
    if kind in ("maxpool2d", "avgpool2d", "maxpool1d", "avgpool1d"):
        rank = 3 if kind.endswith("2d") else 2
        need_rank(rank, "(H, W, C) image" if rank == 3 else "(T, C) sequence")
        pool = o["pool_size"] if rank == 3 else (o["pool_size"],)
        strides = (o["strides"] or o["pool_size"]) if rank == 3 else ((o["strides"] or o["pool_size"]),)
        return _spatial(fail, path, shape, pool, strides, "valid") + (shape[-1],), []
    if kind in ("global_avgpool", "global_maxpool"):
        if len(shape) not in (2, 3):
            raise fail(f"{path}.type", f"{kind} pools every axis but channels: expects (T, C) or (H, W, C), "
                       f"got {list(shape)}")
        return (shape[-1],), []
    if kind == "flatten":
        return (math.prod(shape),), []
    if kind == "zeropad2d":
        need_rank(3, "(H, W, C) image")
        return (shape[0] + 2 * o["padding"][0], shape[1] + 2 * o["padding"][1], shape[2]), []
    if kind == "reshape":
        if math.prod(o["shape"]) != math.prod(shape):
            raise fail(f"{path}.shape", f"cannot reshape {list(shape)} ({math.prod(shape)} values) "
                       f"to {list(o['shape'])} ({math.prod(o['shape'])} values)")
        return tuple(o["shape"]), []
    if kind in ("dropout", "activation"):
        return shape, []
    if kind == "batchnorm":
        if len(shape) not in (1, 3):
            raise fail(f"{path}.type", f"batchnorm expects (C,) or (H, W, C) input, got {list(shape)}")
        c = shape[-1]
        return shape, [w("gamma", (c,), "ones"), w("beta", (c,), "zeros"),
                       w("moving_mean", (c,), "zeros", False), w("moving_variance", (c,), "ones", False)]
    if kind == "layernorm":
        c = shape[-1]
        return shape, [w("gamma", (c,), "ones"), w("beta", (c,), "zeros")]
    if kind == "embedding":
        need_rank(1, "(T,) token-id")
        return shape + (o["output_dim"],), [w("embeddings", (o["input_dim"], o["output_dim"]), "uniform_0.05")]
    if kind == "positional_embedding":
        need_rank(2, "(T, D) sequence")
        if shape[0] > o["max_len"]:
            raise fail(f"{path}.max_len", f"sequence length {shape[0]} exceeds max_len {o['max_len']}")
        return shape, [w("embeddings", (o["max_len"], shape[1]), "glorot_uniform")]
    if kind in ("lstm", "gru"):
        need_rank(2, "(T, F) sequence")
        u, gates = o["units"], 4 if kind == "lstm" else 3
        bias = w("bias", (gates * u,), "lstm_bias") if kind == "lstm" else w("bias", (2, gates * u), "zeros")
        weights = [w("kernel", (shape[1], gates * u), "glorot_uniform"),
                   w("recurrent_kernel", (u, gates * u), "orthogonal"), bias]
        return ((shape[0], u) if o["return_sequences"] else (u,)), weights
    if kind == "multi_head_attention":
        kv = shapes[1] if len(shapes) > 1 else shape
        for s in (shape, kv):
            if len(s) != 2:
                raise fail(f"{path}.type", f"multi_head_attention expects (T, D) sequences, got {list(s)}")
        h, k, d = o["num_heads"], o["key_dim"], shape[1]
        return shape, [w("query_kernel", (d, h, k), "glorot_uniform"), w("query_bias", (h, k), "zeros"),
                       w("key_kernel", (kv[1], h, k), "glorot_uniform"), w("key_bias", (h, k), "zeros"),
                       w("value_kernel", (kv[1], h, k), "glorot_uniform"), w("value_bias", (h, k), "zeros"),
                       w("output_kernel", (h, k, d), "glorot_uniform"), w("output_bias", (d,), "zeros")]
    if kind in ("add", "multiply"):
        for other in shapes[1:]:
            if other != shape:
                raise fail(path, f"{kind}: shapes {tuple(shape)} and {tuple(other)} differ")
        return shape, []
    if kind == "concatenate":
        axis = o["axis"]
        if not -len(shape) <= axis < len(shape):
            raise fail(f"{path}.axis", f"axis {axis} out of range for inputs of rank {len(shape)}")
        a = axis % len(shape)
        for other in shapes[1:]:
            mismatch = len(other) != len(shape) or any(
                x != y for j, (x, y) in enumerate(zip(shape, other, strict=True)) if j != a)
            if mismatch:
                raise fail(path, f"concatenate on axis {axis}: shapes {tuple(shape)} and {tuple(other)} "
                           "differ outside that axis")
        out = list(shape)
        out[a] = sum(s[a] for s in shapes)
        return tuple(out), []
    raise AssertionError(kind)  # LAYER_OPTIONS and infer list the same kinds


def _spatial(fail, path: str, shape, kernel, strides, padding) -> tuple[int, ...]:
    out = []
    for size, k, s in zip(shape[: len(kernel)], kernel, strides, strict=True):
        n = size if padding == "same" else (size - k) // s + 1
        if n < 1:
            raise fail(path, f"window {list(kernel)} does not fit input {list(shape[: len(kernel)])}")
        out.append(n)
    return tuple(out)


# ----------------------------------------------------------------------------- init


def initialise(w: WeightSpec, rng: np.random.Generator) -> np.ndarray:
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
