"""Per-sample dropout masks in torch (train.randomness: per_sample).

The mask of an element is a hash of its sample's key (hvtrain.data.draws.dropout_keys: seed, epoch,
sample), the layer and the element's position within the sample, computed with int64 tensor ops that
give exactly hvtrain.data.draws.keep_mask: the same masks for TensorFlow (backends/tensorflow/draws.py),
on any rank count and after any resume. The backend (or stage) sets the batch's keys before each
training forward; an inference forward draws nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import torch
from torch import nn

from hvtrain.data.draws import GOLDEN32, LAYER32, M32, MIX32_A, MIX32_B, drop_threshold


class SampleDraws:
    """The current training batch's sample keys (int64 [batch, 2]), shared by the model's dropouts."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self._salts: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    @contextmanager
    def keyed(self, keys: torch.Tensor | None) -> Iterator[None]:
        """The model's dropouts read `keys` during a training forward (its masks stay in the graph)."""
        self.keys = keys
        try:
            yield
        finally:
            self.keys = None

    def salts(self, layer: int, n: int, device: torch.device) -> torch.Tensor:
        """hvtrain.data.draws.element_salts, cached per layer and size."""
        key = (layer, n, device)
        if key not in self._salts:
            j = torch.arange(n, dtype=torch.int64, device=device)
            self._salts[key] = mix32((j * GOLDEN32 + (layer + 1) * LAYER32) & M32)
        return self._salts[key]

    def keep(self, layer: int, x: torch.Tensor, rate: float) -> torch.Tensor:
        """bool, x's shape: hvtrain.data.draws.keep_mask for the current keys."""
        keys = self.keys
        if keys is None or len(keys) != len(x):
            raise ValueError(f"per-sample dropout of layer {layer}: a training forward of {len(x)} samples "
                             f"without their keys ({'none' if keys is None else len(keys)} set; "
                             "train.randomness: per_sample)")
        keys = keys.to(x.device)  # a no-op on the CPU; 16 bytes a sample to a GPU
        salts = self.salts(layer, math.prod(x.shape[1:]), x.device)
        h = mix32(mix32(keys[:, :1] ^ salts[None, :]) ^ keys[:, 1:2])
        return (h >= drop_threshold(rate)).reshape(x.shape)


def keyed(draws: SampleDraws | None, keys: np.ndarray | None) -> Any:
    """The context of a training forward: `draws` keyed by the batch's `keys` (None: nothing drawn)."""
    if draws is None:
        return nullcontext()
    return draws.keyed(None if keys is None else torch.from_numpy(keys))


def mix32(x: torch.Tensor) -> torch.Tensor:
    """hvtrain.data.draws.mix32 on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * MIX32_A) & M32
    x = x ^ (x >> 15)
    x = (x * MIX32_B) & M32
    return x ^ (x >> 15)


def dropped(x: torch.Tensor, keep: torch.Tensor, rate: float) -> torch.Tensor:
    """x / (1 - rate) where kept, 0 elsewhere (TensorFlow computes the same, element for element)."""
    return torch.where(keep, x * torch.tensor(1.0 / (1.0 - rate), dtype=x.dtype, device=x.device),
                       torch.zeros((), dtype=x.dtype, device=x.device))


class HashedDropout(nn.Module):
    """The catalogue's dropout layer under per-sample randomness."""

    def __init__(self, rate: float, layer: int, draws: SampleDraws):
        super().__init__()
        self.rate, self.layer, self.draws = rate, layer, draws

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.rate == 0.0:
            return x
        return dropped(x, self.draws.keep(self.layer, x, self.rate), self.rate)
