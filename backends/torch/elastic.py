"""Horovod elastic state for a torch model and optimizer, with this rank's random stream and loss
scaler: a rollback to a commit then continues exactly as a resume from a checkpoint taken there."""

from __future__ import annotations

from typing import Any

import torch


def make_state(hvd: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, counters: dict[str, Any],
               scaler: Any = None) -> Any:
    """hvd.elastic.TorchState (model and optimizer saved, restored, synced from rank 0) plus the
    per-rank parts that must not be synced: the torch RNG and the fp16 GradScaler."""

    class State(hvd.elastic.TorchState):
        def save(self) -> None:
            self._local = (torch.get_rng_state(), scaler.state_dict() if scaler is not None else None)
            super().save()

        def restore(self) -> None:
            super().restore()
            rng, scaled = self._local
            torch.set_rng_state(rng)
            if scaler is not None:
                scaler.load_state_dict(scaled)

    state = State(model=model, optimizer=optimizer, **counters)
    state._local = (torch.get_rng_state(), scaler.state_dict() if scaler is not None else None)
    return state
