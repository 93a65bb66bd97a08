"""TorchStage: one pipeline stage (a slice of the neutral layers) on this rank."""

from __future__ import annotations

import numpy as np
import torch

from hvtrain.config import Config
from hvtrain.placement.plan import Stage
from hvtrain.placement.stage import StageEngine
from hvtrain.spec import ModelSpec, per_layer

from .model import build_layer, neutral_to_torch, torch_to_neutral
from .ops import LOSSES, eval_sums, load_training_state, make_optimizer, training_state


class TorchStage(StageEngine):
    def __init__(self, hvd, cfg: Config, spec: ModelSpec, stage: Stage, replicas: int,
                 weights: dict[str, np.ndarray], process_set) -> None:
        self.hvd, self.cfg, self.replicas, self.process_set = hvd, cfg, replicas, process_set
        self.layers = [spec.layers[i] for i in stage.layers]
        self.device = torch.device("cpu" if stage.device == "cpu" else f"cuda:{stage.device.split(':')[1]}")
        self.module = torch.nn.Sequential(*[build_layer(layer) for layer in self.layers])
        grouped = per_layer(spec, weights)
        state = {}
        for j, layer in enumerate(self.layers):
            for k, v in neutral_to_torch(layer, grouped[layer.index]).items():
                state[f"{j}.{k}"] = torch.from_numpy(np.ascontiguousarray(v, np.float32))
        self.module.load_state_dict(state, strict=False)
        self.module.to(self.device).train()
        self.optimizer = make_optimizer(cfg, self.module)
        self.loss_fn = LOSSES[cfg.loss]
        self.graphs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.loss_acc = torch.zeros((), dtype=torch.float64)
        self.param_ptrs = {p.data_ptr() for p in self.module.parameters()}
        self.saved: dict[int, int] = {}  # micro-batch -> bytes saved for its backward
        self.peak_bytes = 0

    def _run(self, key: int, x: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        inp = torch.from_numpy(x).to(self.device)
        if inp.is_floating_point() and self.layers[0].index > 0:
            inp.requires_grad_(True)
        nbytes = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal nbytes
            if t.data_ptr() not in self.param_ptrs:
                nbytes += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.module(inp)
        self.saved[key] = nbytes
        self.peak_bytes = max(self.peak_bytes, sum(self.saved.values()))
        return inp, out

    def forward(self, key: int, x: np.ndarray) -> np.ndarray:
        inp, out = self._run(key, x)
        self.graphs[key] = (inp, out)
        return out.detach().cpu().numpy()

    def forward_loss(self, key: int, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> bool:
        inp, out = self._run(key, x)
        loss = (self.loss_fn(out.float(), torch.from_numpy(y).to(self.device)) *
                torch.from_numpy(w).to(self.device)).sum()
        self.loss_acc += loss.detach().cpu()
        self.graphs[key] = (inp, loss * self.replicas)  # Horovod averages over the replicas
        return bool(torch.isfinite(loss))

    def backward(self, key: int, grad: np.ndarray | None) -> np.ndarray | None:
        inp, out = self.graphs.pop(key)
        if grad is None:
            out.backward()
        else:
            out.backward(torch.from_numpy(grad).to(self.device))
        self.saved.pop(key, None)
        return inp.grad.cpu().numpy() if inp.requires_grad else None

    def step(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad and p.grad is not None]
        if self.process_set is not None:
            compression = self.hvd.Compression.fp16 if self.cfg.train.compression == "fp16" else \
                self.hvd.Compression.none
            reduced = self.hvd.grouped_allreduce([p.grad for p in params], op=self.hvd.Average,
                                                 compression=compression, process_set=self.process_set,
                                                 name="hvtrain.stage_grads")
            for p, g in zip(params, reduced, strict=True):
                p.grad.copy_(g)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @torch.no_grad()
    def predict(self, x: np.ndarray) -> np.ndarray:
        self.module.eval()
        try:
            return self.module(torch.from_numpy(x).to(self.device)).float().cpu().numpy()
        finally:
            self.module.train()

    def eval_sums(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return eval_sums(self.cfg.loss, torch.from_numpy(self.predict(x)), torch.from_numpy(y))

    def loss_sum(self, reset: bool = False) -> float:
        value = float(self.loss_acc)
        if reset:
            self.loss_acc.zero_()
        return value

    def get_weights(self) -> dict[str, np.ndarray]:
        state = {k: v.detach().cpu().numpy().copy() for k, v in self.module.state_dict().items()
                 if v.is_floating_point()}
        out = {}
        for j, layer in enumerate(self.layers):
            local = {k[len(f"{j}."):]: v for k, v in state.items() if k.startswith(f"{j}.")}
            for param, v in torch_to_neutral(layer, local).items():
                out[f"layers.{layer.index}.{param}"] = np.asarray(v, np.float32)
        return out

    def get_state(self) -> dict[str, np.ndarray]:
        return training_state(self.module, self.optimizer)

    def set_state(self, state: dict[str, np.ndarray], rng: bool = True) -> None:
        load_training_state(state, self.module, self.optimizer, rng=rng)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.module.parameters() if p.requires_grad)

    def peak_activation_bytes(self) -> int | None:
        return self.peak_bytes
