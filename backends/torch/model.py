"""Neutral spec graph -> torch.nn.Module, and neutral <-> torch weight conversion.

Activations stay channels-last between layers (the neutral layout); conv, pool and 2-D
batchnorm permute to NCHW around the op (a permuted NHWC tensor is a channels_last NCHW
tensor, which torch's CPU kernels take without a copy).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hvtrain.model.entrypoint import check_native_names
from hvtrain.model.spec import INPUT, LayerSpec, ModelSpec, check_weights, from_layers, per_layer

from .draws import SampleDraws
from .layers import build_layer


class Graph(nn.Module):
    """The spec's layers run in topological order, each on its inputs' outputs.

    `sources` are the producer indices fed in as arguments (the model input, INPUT, for a whole
    model; a pipeline stage's boundary tensors otherwise); `outputs` those returned (one tensor,
    or a tuple for several)."""

    def __init__(self, layers: list[LayerSpec], sources: tuple[int, ...] = (INPUT,), outputs: tuple[int, ...] = (),
                 draws: SampleDraws | None = None):
        super().__init__()
        self.specs = layers
        self.layers = nn.ModuleList([build_layer(layer, None, draws) for layer in layers])
        self.sources = sources
        self.outputs = outputs or (layers[-1].index,)
        last_use: dict[int, int] = {}
        for pos, layer in enumerate(layers):
            for j in layer.inputs:
                last_use[j] = pos
        self.free_after = {pos: [j for j, p in last_use.items() if p == pos and j not in self.outputs]
                           for pos in range(len(layers))}

    def forward(self, *xs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        values = dict(zip(self.sources, xs, strict=True))
        for pos, (layer, module) in enumerate(zip(self.specs, self.layers, strict=True)):
            values[layer.index] = module(*[values[j] for j in layer.inputs])
            for j in self.free_after[pos]:  # keep only what later layers still read
                values.pop(j, None)
        outs = tuple(values[j] for j in self.outputs)
        return outs[0] if len(outs) == 1 else outs


def build_model(spec: ModelSpec, dtype_policy: str | None = None, sources: tuple[int, ...] = (INPUT,),
                outputs: tuple[int, ...] = (), layers: list[LayerSpec] | None = None,
                draws: SampleDraws | None = None) -> Graph:
    """The spec's graph (or `layers`, a pipeline stage, fed the producer tensors `sources` and
    returning `outputs`) in float32. `dtype_policy` (bf16/fp16 compute) is not a property of torch
    modules: the backend and stages autocast at run time, so it only keeps the signature alike.
    `draws`: dropout masks per sample (the caller sets each training batch's keys on it)."""
    if layers is None:
        return Graph(spec.layers, sources, outputs or (spec.output_index,), draws)
    return Graph(layers, sources, outputs or (layers[-1].index,), draws)


def native_layers(model: Graph, layers: list[LayerSpec]) -> list[nn.Module]:
    """The module of each spec layer, in spec order."""
    by_index = {spec.index: module for spec, module in zip(model.specs, model.layers, strict=True)}
    return [by_index[layer.index] for layer in layers]


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
    if k in ("conv2d", "conv1d"):  # neutral [*window, in, out] -> torch [out, in, *window]
        r = w["kernel"].ndim
        out = {"conv.weight": w["kernel"].transpose(r - 1, r - 2, *range(r - 2))}
        if "bias" in w:
            out["conv.bias"] = w["bias"]
        return out
    if k == "batchnorm":
        return {"bn.weight": w["gamma"], "bn.bias": w["beta"], "bn.running_mean": w["moving_mean"],
                "bn.running_var": w["moving_variance"]}
    if k == "layernorm":
        return {"norm.weight": w["gamma"], "norm.bias": w["beta"]}
    if k in ("positional_embedding", "multi_head_attention"):
        return dict(w)  # stored in the neutral layout
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
    if k in ("conv2d", "conv1d"):
        r = s["conv.weight"].ndim
        out = {"kernel": s["conv.weight"].transpose(*range(2, r), 1, 0)}
        if "conv.bias" in s:
            out["bias"] = s["conv.bias"]
        return out
    if k == "batchnorm":
        return {"gamma": s["bn.weight"], "beta": s["bn.bias"], "moving_mean": s["bn.running_mean"],
                "moving_variance": s["bn.running_var"]}
    if k == "layernorm":
        return {"gamma": s["norm.weight"], "beta": s["norm.bias"]}
    if k in ("positional_embedding", "multi_head_attention"):
        return dict(s)
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
    for layer, module, w in zip(spec.layers, native_layers(model, spec.layers), per_layer(spec, weights),
                                strict=True):
        layer_to_native(layer, module, w)


def from_native(spec: ModelSpec | None, model: nn.Module) -> dict[str, np.ndarray]:
    """All weights, neutral layout (native state_dict names for entrypoint models)."""
    if spec is None:
        return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items() if v.is_floating_point()}
    pairs = zip(spec.layers, native_layers(model, spec.layers), strict=True)
    return from_layers(spec, [layer_from_native(layer, module) for layer, module in pairs])
