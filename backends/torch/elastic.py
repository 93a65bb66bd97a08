"""Horovod elastic state for a torch model and optimizer."""

from __future__ import annotations

from typing import Any

import torch


def make_state(hvd: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, counters: dict[str, Any]) -> Any:
    """hvd.elastic.TorchState: saves/restores model and optimizer state dicts, syncs them from rank 0."""
    return hvd.elastic.TorchState(model=model, optimizer=optimizer, **counters)
