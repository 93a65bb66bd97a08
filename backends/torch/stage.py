"""TorchStage: one pipeline stage (a slice of the neutral layers) on this rank."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from hvtrain.backends.base import Collectives
from hvtrain.backends.stage import StageEngine
from hvtrain.config.schema import Config
from hvtrain.config.validate import per_sample_randomness
from hvtrain.metrics.suite import MetricSet
from hvtrain.model.spec import INPUT, ModelSpec, draws_random, per_layer

from .draws import SampleDraws, keyed
from .model import build_model, layer_from_native, layer_to_native
from .ops import LOSSES, eval_sums, load_training_state, make_optimizer, state_bytes, training_state
from .shard import ShardedOptimizer

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _on(device: torch.device, a: np.ndarray) -> torch.Tensor:
    """A received or host array on `device`; to a GPU through pinned memory, queued without waiting."""
    t = torch.from_numpy(a)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class TorchStage(StageEngine):
    def __init__(self, runtime: Collectives, cfg: Config, spec: ModelSpec, layers: list[int],
                 sources: tuple[int, ...], outputs: tuple[int, ...], device: str, replicas: int,
                 weights: dict[str, np.ndarray], process_set: Any) -> None:
        self.horovod, self.cfg, self.replicas, self.process_set = runtime.horovod, cfg, replicas, process_set
        self.layers = [spec.layers[i] for i in layers]
        self.device = torch.device("cpu" if device == "cpu" else f"cuda:{device.split(':')[1]}")
        if self.device.type == "cuda":  # the current device: pinned memory, the CUDA RNG state saved
            torch.cuda.set_device(self.device)
        self.draws = SampleDraws() if per_sample_randomness(cfg) and draws_random(self.layers) else None
        self.module = build_model(spec, None, sources, outputs, self.layers, self.draws)
        self.first = sources == (INPUT,) and self.layers[0].index == 0
        grouped = per_layer(spec, weights)
        for layer, native in zip(self.layers, self.module.layers, strict=True):
            layer_to_native(layer, native, grouped[layer.index])
        self.module.to(self.device).train()
        # train.shard_optimizer: 1/replicas of the stage's optimizer state on each of its replicas
        # (one replica has nothing to share it with: the whole-state optimizer, the same update)
        self.sharded = cfg.train.shard_optimizer and process_set is not None
        self.optimizer = ShardedOptimizer(cfg, [p for p in self.module.parameters() if p.requires_grad], runtime,
                                          process_set) if self.sharded else make_optimizer(cfg, self.module)
        self.loss_fn = LOSSES[cfg.loss]
        self.autocast = AUTOCAST.get(cfg.train.precision)
        self.graphs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.loss_acc = torch.zeros((), dtype=torch.float64)
        self.param_ptrs = {p.data_ptr() for p in self.module.parameters()}
        self.saved: dict[int, int] = {}  # micro-batch -> bytes saved for its backward
        self.peak_bytes = 0

    def _run(self, key: int, xs: list[np.ndarray], padding: bool, draws: np.ndarray | None
             ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        inps = [_on(self.device, x) for x in xs]
        if not self.first:
            for t in inps:
                if t.is_floating_point():
                    t.requires_grad_(True)
        nbytes = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal nbytes
            if t.data_ptr() not in self.param_ptrs:
                nbytes += t.numel() * t.element_size()
            return t

        if padding:  # a zero-weight sample: no statistics updated
            self.module.eval()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack), self._autocast(), \
                    keyed(self.draws, draws):
                out = self.module(*inps)
        finally:
            if padding:
                self.module.train()
        self.saved[key] = nbytes
        self.peak_bytes = max(self.peak_bytes, sum(self.saved.values()))
        return inps, out if isinstance(out, tuple) else (out,)

    def _autocast(self) -> Any:
        """Autocast for bf16/fp16; fp32 enters no context at all."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def forward(self, key: int, xs: list[np.ndarray], padding: bool = False,
                draws: np.ndarray | None = None) -> list[np.ndarray]:
        inps, outs = self._run(key, xs, padding, draws)
        self.graphs[key] = (inps, outs)
        return [o.detach().float().cpu().numpy() for o in outs]

    def forward_loss(self, key: int, xs: list[np.ndarray], y: np.ndarray, sample_weight: np.ndarray,
                     scale: float = 1.0, draws: np.ndarray | None = None) -> float:
        inps, (out,) = self._run(key, xs, not sample_weight.any(), draws)
        loss = (self.loss_fn(out.float(), _on(self.device, y)) * _on(self.device, sample_weight)).sum()
        value = float(loss.detach())
        if np.isfinite(value):
            self.loss_acc += value
        self.graphs[key] = (inps, (loss * (self.replicas * scale),))  # Horovod averages over the replicas
        return value

    def backward(self, key: int, grads: list[np.ndarray] | None) -> list[np.ndarray] | None:
        inps, outs = self.graphs.pop(key)
        if grads is None:
            outs[0].backward()
        else:
            pairs = [(o, _on(self.device, g).to(o.dtype)) for o, g in zip(outs, grads, strict=True)
                     if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self.saved.pop(key, None)
        if self.first:
            return None
        return [t.grad.float().cpu().numpy() if t.grad is not None else np.zeros(t.shape, np.float32)
                for t in inps]

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad and p.grad is not None]

    def reduce_gradients(self, inv_scale: float = 1.0, check_finite: bool = True) -> bool:
        if self.sharded:  # the optimizer's step reduces each chunk (fp16 and on_nan: skip are refused with it)
            return True
        params = self._params()
        if self.process_set is not None:
            reduced = self.horovod.average([p.grad for p in params], self.cfg.horovod.num_groups,
                                           "hvtrain.stage_grads", self.cfg.train.compression, self.process_set)
            for p, g in zip(params, reduced, strict=True):
                p.grad.copy_(g)
        if inv_scale != 1.0:
            for p in params:
                p.grad.mul_(inv_scale)
        return not check_finite or all(bool(torch.isfinite(p.grad).all()) for p in params)

    def apply_update(self, update: bool = True) -> None:
        if update:
            self.optimizer.step()
        self.optimizer.zero_grad()

    def discard_gradients(self) -> None:
        self.graphs.clear()
        self.saved.clear()
        if self.sharded:  # the .grad tensors are views of its buffer
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @torch.no_grad()
    def predict(self, xs: list[np.ndarray]) -> list[np.ndarray]:
        self.module.eval()
        try:
            out = self.module(*[_on(self.device, x) for x in xs])
        finally:
            self.module.train()
        return [o.float().cpu().numpy() for o in (out if isinstance(out, tuple) else (out,))]

    def eval_sums(self, xs: list[np.ndarray], y: np.ndarray, metrics: MetricSet, index: np.ndarray) -> np.ndarray:
        return eval_sums(self.cfg.loss, self.predict(xs)[0], y, metrics, index)

    def loss_sum(self, reset: bool = False) -> float:
        value = float(self.loss_acc)
        if reset:
            self.loss_acc.zero_()
        return value

    def get_weights(self) -> dict[str, np.ndarray]:
        pairs = zip(self.layers, self.module.layers, strict=True)
        return {f"layers.{layer.index}.{param}": v for layer, native in pairs
                for param, v in layer_from_native(layer, native).items()}

    def get_state(self) -> dict[str, np.ndarray]:
        return training_state(self.module, self.optimizer)

    def set_state(self, state: dict[str, np.ndarray], rng: bool = True) -> None:
        load_training_state(state, self.module, self.optimizer, rng=rng)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.module.parameters() if p.requires_grad)

    def optimizer_state_bytes(self) -> int:
        return self.optimizer.state_bytes() if self.sharded else state_bytes(self.optimizer)

    def peak_activation_bytes(self) -> int | None:
        return self.peak_bytes
