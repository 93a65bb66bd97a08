"""The neutral layer catalogue as torch modules (channels-last in and out, like Keras)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from hvtrain.model.spec import LayerSpec

from .draws import HashedDropout, SampleDraws, dropped

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
    would raise, Keras would output beta); both backends do the same. So is every batch of a
    frozen layer (`trainable: false`), as Keras does.
    """

    def __init__(self, channels: int, image: bool, o: dict):
        super().__init__()
        cls = nn.BatchNorm2d if image else nn.BatchNorm1d
        self.bn = cls(channels, eps=o["epsilon"], momentum=1.0 - o["momentum"])
        self.image = image

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frozen = not self.bn.weight.requires_grad  # a frozen layer: running statistics, never updated
        if self.training and (frozen or x.numel() == x.shape[-1]):
            bn = self.bn
            return F.batch_norm(x.reshape(-1, x.shape[-1]), bn.running_mean, bn.running_var, bn.weight, bn.bias,
                                False, 0.0, bn.eps).reshape(x.shape)
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


class Conv1d(nn.Module):
    def __init__(self, cin: int, o: dict):
        super().__init__()
        padding = "same" if o["padding"] == "same" else 0
        self.conv = nn.Conv1d(cin, o["filters"], o["kernel_size"], o["strides"], padding=padding, bias=o["use_bias"])
        self.act = Activation(o["activation"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x.transpose(1, 2)).transpose(1, 2))


class Pool1d(nn.Module):
    def __init__(self, kind: str, o: dict):
        super().__init__()
        cls = nn.MaxPool1d if kind == "maxpool1d" else nn.AvgPool1d
        self.pool = cls(o["pool_size"], o["strides"] or o["pool_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x.transpose(1, 2)).transpose(1, 2)


class GlobalPool(nn.Module):
    """Over every axis but the batch and the channels."""

    def __init__(self, kind: str):
        super().__init__()
        self.max = kind == "global_maxpool"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1, x.shape[-1])
        return flat.amax(dim=1) if self.max else flat.mean(dim=1)


class LayerNorm(nn.Module):
    def __init__(self, channels: int, o: dict):
        super().__init__()
        self.norm = nn.LayerNorm(channels, eps=o["epsilon"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class PositionalEmbedding(nn.Module):
    """A learned position table added to a (T, D) sequence (positions 0..T-1)."""

    def __init__(self, max_len: int, dim: int):
        super().__init__()
        self.embeddings = nn.Parameter(torch.zeros(max_len, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.embeddings[: x.shape[1]].to(x.dtype)


class MultiHeadAttention(nn.Module):
    """Keras's MultiHeadAttention, weight for weight: einsum projections to (heads, key_dim), query
    scaled by 1/sqrt(key_dim), softmax over keys (optionally causal), dropout on the weights, output
    projection back to the query's width. Parameters are stored in the neutral layout. With
    per-sample `draws`, a training forward with dropout computes the weights explicitly (Keras's
    order: scaled query, scores, softmax, mask) to drop them by the hashed mask."""

    NAMES = ("query_kernel", "query_bias", "key_kernel", "key_bias", "value_kernel", "value_bias",
             "output_kernel", "output_bias")

    def __init__(self, layer: LayerSpec, draws: SampleDraws | None = None):
        super().__init__()
        for w in layer.weights:
            self.register_parameter(w.name.rsplit(".", 1)[1], nn.Parameter(torch.zeros(w.shape)))
        self.key_dim, self.causal = layer.options["key_dim"], layer.options["causal"]
        self.dropout = nn.Dropout(layer.options["dropout"])
        self.index, self.draws = layer.index, draws

    def forward(self, query: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        source = query if source is None else source
        b, t, d = query.shape
        h, k = self.query_bias.shape

        def project(x: torch.Tensor, kernel: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            # x @ [D, H*K] as one matmul (what Keras's einsum computes), to (B, H, T, K)
            y = torch.addmm(bias.reshape(-1).to(x.dtype), x.reshape(-1, x.shape[-1]), kernel.reshape(x.shape[-1], -1)
                            .to(x.dtype))
            return y.reshape(b, -1, h, k).transpose(1, 2)

        q = project(query, self.query_kernel, self.query_bias)
        key = project(source, self.key_kernel, self.key_bias)
        v = project(source, self.value_kernel, self.value_bias)
        rate = self.dropout.p if self.training else 0.0
        if rate and self.draws is not None:
            out = self._hashed(q, key, v, rate)
        else:
            out = F.scaled_dot_product_attention(q, key, v, is_causal=self.causal, dropout_p=rate,
                                                 scale=1.0 / math.sqrt(self.key_dim))
        out = out.transpose(1, 2).reshape(b * t, h * k)
        return torch.addmm(self.output_bias.to(out.dtype), out, self.output_kernel.reshape(h * k, d).to(out.dtype)
                           ).reshape(b, t, d)

    def _hashed(self, q: torch.Tensor, key: torch.Tensor, v: torch.Tensor, rate: float) -> torch.Tensor:
        scores = (q * torch.tensor(1.0 / math.sqrt(self.key_dim), dtype=q.dtype)) @ key.transpose(-1, -2)
        if self.causal:  # query i sees keys 0..i
            t, s = scores.shape[-2:]
            allowed = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        weights = dropped(weights, self.draws.keep(self.index, weights, rate), rate)
        return weights @ v


class Merge(nn.Module):
    def __init__(self, kind: str, axis: int = -1):
        super().__init__()
        self.kind = kind
        self.dim = axis if axis < 0 else axis + 1  # the neutral axis excludes the batch

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        if self.kind == "concatenate":
            return torch.cat(xs, dim=self.dim)
        out = xs[0]
        for x in xs[1:]:
            out = out + x if self.kind == "add" else out * x
        return out


def build_layer(layer: LayerSpec, dtype_policy: str | None = None, draws: SampleDraws | None = None) -> nn.Module:
    """The module of `layer`; a frozen one (`trainable: false`) has no parameter requiring a gradient
    and, for batchnorm, normalises with its running statistics and leaves them unchanged (as Keras).
    `draws`: its dropout masks are per sample (hashed), else the torch generator's."""
    module = _build(layer, draws)
    if not layer.trainable:
        module.requires_grad_(False)
    return module


def _build(layer: LayerSpec, draws: SampleDraws | None) -> nn.Module:
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
    if kind == "zeropad2d":  # (N, H, W, C): the last axis first in F.pad's order
        ph, pw = o["padding"]
        return nn.ZeroPad3d((0, 0, pw, pw, ph, ph))
    if kind == "reshape":
        return Reshape(o["shape"])
    if kind == "dropout":
        return nn.Dropout(o["rate"]) if draws is None else HashedDropout(o["rate"], layer.index, draws)
    if kind == "batchnorm":
        return BatchNorm(shape[-1], len(shape) == 3, o)
    if kind == "activation":
        return Activation(o["activation"])
    if kind == "embedding":
        return nn.Embedding(o["input_dim"], o["output_dim"])
    if kind in ("lstm", "gru"):
        return Recurrent(kind, shape[-1], o["units"], o["return_sequences"])
    if kind == "conv1d":
        return Conv1d(shape[-1], o)
    if kind in ("maxpool1d", "avgpool1d"):
        return Pool1d(kind, o)
    if kind in ("global_avgpool", "global_maxpool"):
        return GlobalPool(kind)
    if kind == "layernorm":
        return LayerNorm(shape[-1], o)
    if kind == "positional_embedding":
        return PositionalEmbedding(o["max_len"], shape[-1])
    if kind == "multi_head_attention":
        return MultiHeadAttention(layer, draws)
    if kind in ("add", "multiply", "concatenate"):
        return Merge(kind, o.get("axis", -1))
    raise AssertionError(kind)
