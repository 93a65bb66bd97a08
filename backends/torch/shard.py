"""Sharded optimizer state in torch (train.shard_optimizer: ZeRO stage 1 on Horovod).

The trainable parameters and their gradients live in two flat buffers (the model's tensors are
views into them, so backward accumulates straight into the gradient buffer). The buffers are cut
into chunks of at most the Horovod fusion threshold, each a multiple of the world size; rank r owns
the r-th equal piece of every chunk, as a Parameter that shares the flat buffer's memory and is the
only thing its optimizer (and so its optimizer state: 1/N of it) ever sees. A step, chunk by chunk:
the gradients reduce-scattered (Horovod's average: each rank gets its piece's mean), the optimizer
step on the piece, the updated pieces allgathered back into the parameter buffer. Every optimizer
hvtrain offers is elementwise, so this is the unsharded update, element for element.

Checkpoints hold the unsharded optimizer's state_dict (`state_dict` gathers the pieces; every rank
calls it, as every rank saves), and `load_state_dict` takes one from any world size, sharded or not.
"""

from __future__ import annotations

from typing import Any

import torch

from hvtrain.config.schema import Config

from .ops import make_optimizer, state_bytes


def _per_element(key: str, value: Any, param: torch.Tensor) -> bool:
    """A state tensor with one value per parameter element (moments, momentum), not a step count."""
    return key != "step" and torch.is_tensor(value) and value.shape == param.shape


class ShardedOptimizer:
    """The optimizer of `params` (the model's trainable parameters, in order) with state sharded
    over the ranks of `horovod` (hvtrain.runtime.torch_horovod.TorchHorovod)."""

    def __init__(self, cfg: Config, params: list[torch.nn.Parameter], horovod: Any, rank: int, size: int) -> None:
        self.horovod, self.rank, self.size = horovod, rank, size
        self.params = params
        self.sizes = [p.numel() for p in params]
        total = sum(self.sizes)
        padded = -(-total // size) * size
        device, dtype = params[0].device, params[0].dtype
        self.flat = torch.zeros(padded, dtype=dtype, device=device)
        self.grads = torch.zeros(padded, dtype=dtype, device=device)
        at = 0
        with torch.no_grad():
            for p, n in zip(params, self.sizes, strict=True):
                self.flat[at: at + n].copy_(p.reshape(-1))
                p.data = self.flat[at: at + n].view_as(p)
                p.grad = self.grads[at: at + n].view_as(p)
                at += n
        # chunks: a multiple of the world size each, at most the fusion threshold (one collective each way;
        # Horovod's 64 MiB where fusion is off)
        limit = (cfg.horovod.fusion_threshold_mb or 64.0) * 2**20 / self.flat.element_size()
        step = max(size, int(limit) // size * size)
        self.chunks = [(a, min(a + step, padded)) for a in range(0, padded, step)]
        self.pieces = []
        for a, b in self.chunks:
            n = (b - a) // size
            self.pieces.append(torch.nn.Parameter(self.flat[a + rank * n: a + (rank + 1) * n]))
        self.optimizer = make_optimizer(cfg, self.pieces)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return state_bytes(self.optimizer)

    def zero_grad(self) -> None:
        self.grads.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Reduce-scatter each chunk's gradients, update this rank's piece, allgather the pieces."""
        for (a, b), piece in zip(self.chunks, self.pieces, strict=True):
            piece.grad = self.horovod.reducescatter_mean(self.grads[a:b], f"hvtrain.zero.g{a}")
            self.optimizer.step()  # only the piece with a gradient moves
            piece.grad = None
            self.flat[a:b].copy_(self.horovod.allgather(piece.detach(), f"hvtrain.zero.p{a}"))

    # -- the unsharded optimizer's state_dict ---------------------------------------------------
    def _full(self, key: str) -> torch.Tensor:
        """The flat buffer of one per-element state (`key`) gathered from every rank's pieces."""
        out = torch.zeros_like(self.flat)
        for (a, b), piece in zip(self.chunks, self.pieces, strict=True):
            out[a:b].copy_(self.horovod.allgather(self.optimizer.state[piece][key], f"hvtrain.zero.s{key}{a}"))
        return out

    def state_dict(self) -> dict[str, Any]:
        """What torch's optimizer over the model's parameters would hold (a collective: every rank)."""
        inner = self.optimizer.state_dict()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(self.params)))}
                  for g in inner["param_groups"]]
        first = self.optimizer.state.get(self.pieces[0], {})
        state: dict[int, dict[str, Any]] = {i: {} for i in range(len(self.params))} if first else {}
        for key in sorted(first):  # one order on every rank: each key is a collective
            value = first[key]
            if _per_element(key, value, self.pieces[0]):
                full, at = self._full(key), 0
                for i, (p, n) in enumerate(zip(self.params, self.sizes, strict=True)):
                    state[i][key] = full[at: at + n].view_as(p).clone()
                    at += n
            else:  # a step count: the same on every piece
                for i in state:
                    state[i][key] = value.clone() if torch.is_tensor(value) else value
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """An unsharded optimizer's state_dict (this class's, or a plain run's) cut to this rank's pieces."""
        per_param = saved["state"]
        pieces_state: dict[int, dict[str, Any]] = {}
        keys = sorted(set().union(*(s.keys() for s in per_param.values()))) if per_param else []
        for key in keys:
            i, sample = next((i, s[key]) for i, s in per_param.items() if key in s)
            if _per_element(key, sample, self.params[i]):
                flat = torch.zeros_like(self.flat)
                at = 0
                for i, n in enumerate(self.sizes):
                    if i in per_param and key in per_param[i]:
                        flat[at: at + n].copy_(per_param[i][key].reshape(-1))
                    at += n
                for j, ((a, b), _piece) in enumerate(zip(self.chunks, self.pieces, strict=True)):
                    n = (b - a) // self.size
                    pieces_state.setdefault(j, {})[key] = flat[a + self.rank * n: a + (self.rank + 1) * n].clone()
            else:
                for j in range(len(self.pieces)):
                    pieces_state.setdefault(j, {})[key] = sample.clone() if torch.is_tensor(sample) else sample
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(self.pieces)))}
                  for g in saved["param_groups"]]
        self.optimizer.load_state_dict({"state": pieces_state, "param_groups": groups})
