"""Neutral spec -> torch.nn.Module, and neutral <-> torch weight conversion.

Activations stay channels-last between layers (the neutral layout); conv, pool and 2-D
batchnorm permute to NCHW around the op (a permuted NHWC tensor is a channels_last NCHW
tensor, which torch's CPU kernels take without a copy).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from hvtrain.entrypoint import check_native_names
from hvtrain.spec import LayerSpec, ModelSpec, check_weights, from_layers, per_layer

_ACT = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "gelu": F.gelu,
        "softmax": lambda x: torch.softmax(x, dim=-1)}


class Activation(nn.Module):
    def __init__(self, name: str | None):
        super().__init__()
        self.name = name
        self.fn = _ACT[name] if name else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x) if self.fn is not None else x


class Dense(nn.Module):
    def __init__(self, fan_in: int, units: int, use_bias: bool, activation: str | None):
        super().__init__()
        self.linear = nn.Linear(fan_in, units, bias=use_bias)
        self.act = Activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


class Conv2d(nn.Module):
    def __init__(self, cin: int, o: dict):
        super().__init__()
        padding = "same" if o["padding"] == "same" else 0
        self.conv = nn.Conv2d(cin, o["filters"], o["kernel_size"], o["strides"], padding=padding,
                              bias=o["use_bias"])
        self.act = Activation(o["activation"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1))


class Pool2d(nn.Module):
    def __init__(self, kind: str, o: dict):
        super().__init__()
        cls = nn.MaxPool2d if kind == "maxpool2d" else nn.AvgPool2d
        self.pool = cls(o["pool_size"], o["strides"] or o["pool_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


class BatchNorm(nn.Module):
    """Keras momentum m (moving = m*moving + (1-m)*batch) is torch momentum 1-m.

    A training batch with one value per channel (one sample of a dense layer) has no batch
    statistics: it is normalised with the moving statistics, which it leaves unchanged (torch
    would raise, Keras would output beta); both backends do the same.
    """

    def __init__(self, channels: int, image: bool, o: dict):
        super().__init__()
        cls = nn.BatchNorm2d if image else nn.BatchNorm1d
        self.bn = cls(channels, eps=o["epsilon"], momentum=1.0 - o["momentum"])
        self.image = image

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.numel() == x.shape[-1]:
            bn = self.bn
            return F.batch_norm(x.reshape(1, -1), bn.running_mean, bn.running_var, bn.weight, bn.bias, False,
                                0.0, bn.eps).reshape(x.shape)
        if self.image:
            return self.bn(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        return self.bn(x)


class Reshape(nn.Module):
    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape((x.shape[0],) + self.shape)


class Recurrent(nn.Module):
    def __init__(self, kind: str, fan_in: int, units: int, return_sequences: bool):
        super().__init__()
        cls = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = cls(fan_in, units, batch_first=True)
        self.return_sequences = return_sequences
        if kind == "lstm":
            # The neutral LSTM has one bias (Keras); torch's second is held at zero.
            self.rnn.bias_hh_l0.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return out if self.return_sequences else out[:, -1]


def build_model(spec: ModelSpec, dtype_policy: str | None = None) -> nn.Sequential:
    """The spec's layers in float32. `dtype_policy` (bf16/fp16 compute) is not a property of torch
    modules: the backend and stages autocast at run time, so it only keeps the signature alike."""
    return nn.Sequential(*[build_layer(layer, dtype_policy) for layer in spec.layers])


def build_layer(layer: LayerSpec, dtype_policy: str | None = None) -> nn.Module:
    o, shape = layer.options, layer.input_shape
    kind = layer.type
    if kind == "dense":
        return Dense(shape[-1], o["units"], o["use_bias"], o["activation"])
    if kind == "conv2d":
        return Conv2d(shape[-1], o)
    if kind in ("maxpool2d", "avgpool2d"):
        return Pool2d(kind, o)
    if kind == "flatten":
        return nn.Flatten()
    if kind == "reshape":
        return Reshape(o["shape"])
    if kind == "dropout":
        return nn.Dropout(o["rate"])
    if kind == "batchnorm":
        return BatchNorm(shape[-1], len(shape) == 3, o)
    if kind == "activation":
        return Activation(o["activation"])
    if kind == "embedding":
        return nn.Embedding(o["input_dim"], o["output_dim"])
    if kind in ("lstm", "gru"):
        return Recurrent(kind, shape[-1], o["units"], o["return_sequences"])
    raise AssertionError(kind)


# ----------------------------------------------------------------------------- weight layout

_GRU_TO_TORCH = (1, 0, 2)  # neutral/Keras gate blocks z, r, h -> torch r, z, n


def _gates(a: np.ndarray, order: tuple[int, ...], axis: int) -> np.ndarray:
    blocks = np.split(a, len(order), axis=axis)
    return np.concatenate([blocks[i] for i in order], axis=axis)


def _to_torch(layer: LayerSpec, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One layer's neutral weights (keyed by param, e.g. 'kernel') -> its torch state_dict."""
    k = layer.type
    if k == "dense":
        out = {"linear.weight": w["kernel"].T}
        if "bias" in w:
            out["linear.bias"] = w["bias"]
        return out
    if k == "conv2d":
        out = {"conv.weight": w["kernel"].transpose(3, 2, 0, 1)}
        if "bias" in w:
            out["conv.bias"] = w["bias"]
        return out
    if k == "batchnorm":
        return {"bn.weight": w["gamma"], "bn.bias": w["beta"], "bn.running_mean": w["moving_mean"],
                "bn.running_var": w["moving_variance"]}
    if k == "embedding":
        return {"weight": w["embeddings"]}
    if k == "lstm":
        return {"rnn.weight_ih_l0": w["kernel"].T, "rnn.weight_hh_l0": w["recurrent_kernel"].T,
                "rnn.bias_ih_l0": w["bias"], "rnn.bias_hh_l0": np.zeros_like(w["bias"])}
    if k == "gru":
        return {"rnn.weight_ih_l0": _gates(w["kernel"], _GRU_TO_TORCH, 1).T,
                "rnn.weight_hh_l0": _gates(w["recurrent_kernel"], _GRU_TO_TORCH, 1).T,
                "rnn.bias_ih_l0": _gates(w["bias"][0], _GRU_TO_TORCH, 0),
                "rnn.bias_hh_l0": _gates(w["bias"][1], _GRU_TO_TORCH, 0)}
    return {}


def _from_torch(layer: LayerSpec, s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of _to_torch (the LSTM's two torch biases are summed)."""
    k = layer.type
    if k == "dense":
        out = {"kernel": s["linear.weight"].T}
        if "linear.bias" in s:
            out["bias"] = s["linear.bias"]
        return out
    if k == "conv2d":
        out = {"kernel": s["conv.weight"].transpose(2, 3, 1, 0)}
        if "conv.bias" in s:
            out["bias"] = s["conv.bias"]
        return out
    if k == "batchnorm":
        return {"gamma": s["bn.weight"], "beta": s["bn.bias"], "moving_mean": s["bn.running_mean"],
                "moving_variance": s["bn.running_var"]}
    if k == "embedding":
        return {"embeddings": s["weight"]}
    if k == "lstm":
        return {"kernel": s["rnn.weight_ih_l0"].T, "recurrent_kernel": s["rnn.weight_hh_l0"].T,
                "bias": s["rnn.bias_ih_l0"] + s["rnn.bias_hh_l0"]}
    if k == "gru":
        return {"kernel": _gates(s["rnn.weight_ih_l0"].T, _GRU_TO_TORCH, 1),
                "recurrent_kernel": _gates(s["rnn.weight_hh_l0"].T, _GRU_TO_TORCH, 1),
                "bias": np.stack([_gates(s["rnn.bias_ih_l0"], _GRU_TO_TORCH, 0),
                                  _gates(s["rnn.bias_hh_l0"], _GRU_TO_TORCH, 0)])}
    return {}


def layer_to_native(layer: LayerSpec, native: nn.Module, w: dict[str, np.ndarray]) -> None:
    """Load one layer's neutral weights (keyed by param name, e.g. 'kernel') into its module."""
    state = {k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in _to_torch(layer, w).items()}
    missing, unexpected = native.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise AssertionError(f"weight conversion bug in layer {layer.index}: missing {missing}, "
                             f"unexpected {unexpected}")


def layer_from_native(layer: LayerSpec, native: nn.Module) -> dict[str, np.ndarray]:
    """One layer's neutral weights (keyed by param name) read from its module."""
    state = {k: v.detach().cpu().numpy().copy() for k, v in native.state_dict().items() if v.is_floating_point()}
    return {k: np.asarray(v, np.float32) for k, v in _from_torch(layer, state).items()}


def to_native(spec: ModelSpec | None, model: nn.Module, weights: dict[str, np.ndarray]) -> None:
    """Load neutral weights (native state_dict names for entrypoint models, spec None).

    Raises:
        DataError: names or shapes that do not match the model.
    """
    if spec is None:
        current = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
        check_native_names(current, {k: tuple(v.shape) for k, v in current.items()}, weights)
        model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in weights.items()}, strict=False)
        return
    check_weights(spec, weights, "weights")
    for layer, module, w in zip(spec.layers, model, per_layer(spec, weights), strict=True):
        layer_to_native(layer, module, w)


def from_native(spec: ModelSpec | None, model: nn.Module) -> dict[str, np.ndarray]:
    """All weights, neutral layout (native state_dict names for entrypoint models)."""
    if spec is None:
        return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items() if v.is_floating_point()}
    return from_layers(spec, [layer_from_native(layer, module) for layer, module in zip(spec.layers, model,
                                                                                          strict=True)])
