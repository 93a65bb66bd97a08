"""The benchmark models written directly in PyTorch, as a user would (NCHW images), and the
synthetic data every torch peer trains on: the same shapes as bench/configs/{mlp,cnn}.yaml."""

from __future__ import annotations

import torch
from torch import nn

SHAPES = {"mlp": (64,), "cnn": (1, 28, 28)}


def build(name: str) -> nn.Module:
    if name == "mlp":  # 64-1024-1024-10
        return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    if name == "cnn":  # conv 3x3 32 - relu - maxpool - conv 3x3 64 - relu - maxpool - dense 10
        return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(64 * 7 * 7, 10))
    raise ValueError(f"unknown model {name!r}; expected mlp or cnn")


def data(name: str, samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share: `samples` float32 inputs and int64 labels of 10 classes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((samples, *SHAPES[name]), generator=g), torch.randint(0, 10, (samples,), generator=g)


def epochs(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, epochs: int,
           steps: int, batch: int, size: int) -> list[float]:
    """Train; samples/s of the whole job for each epoch's steps (the loop a user writes: a fresh
    permutation per epoch, mean cross-entropy, SGD step)."""
    import time

    rates = []
    for _ in range(epochs):
        perm = torch.randperm(len(x))
        t0 = time.perf_counter()
        for s in range(steps):
            idx = perm[s * batch:(s + 1) * batch]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
        loss.item()
        rates.append(steps * batch * size / (time.perf_counter() - t0))
    return rates
