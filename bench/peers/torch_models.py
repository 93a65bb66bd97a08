"""The benchmark models written directly in PyTorch, as a user would (NCHW images), and the
synthetic data every torch peer trains on: the same shapes as bench/configs/{mlp,cnn,resnet18}.yaml."""

from __future__ import annotations

import torch
from torch import nn

SHAPES = {"mlp": (64,), "cnn": (1, 28, 28), "resnet18": (3, 28, 28)}


class BasicBlock(nn.Module):
    """ResNet's basic block (He et al. 2016), as the common CIFAR ResNet code writes it."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR-style ResNet-18: 3x3 stem, no max-pool, 4 stages of 2 basic blocks (64-512 channels)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        blocks, cin = [], 64
        for i, width in enumerate((64, 128, 256, 512)):
            for b in range(2):
                blocks.append(BasicBlock(cin, width, 2 if i > 0 and b == 0 else 1))
                cin = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1))


def build(name: str) -> nn.Module:
    if name == "mlp":  # 64-1024-1024-10
        return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    if name == "cnn":  # conv 3x3 32 - relu - maxpool - conv 3x3 64 - relu - maxpool - dense 10
        return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(64 * 7 * 7, 10))
    if name == "resnet18":
        return ResNet18()
    raise ValueError(f"unknown model {name!r}; expected mlp, cnn or resnet18")


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
