"""TorchBackend: PyTorch under horovod.torch (DistributedOptimizer, ring-allreduce, fusion)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hvtrain.backend import Backend
from hvtrain.collectives import HorovodCollectives, load_entrypoint
from hvtrain.config import Config
from hvtrain.dist import (
    ProcessInfo,
    default_threads,
    elastic_launch,
    local_size_from_env,
)
from hvtrain.placement.plan import PipelinePlan, Stage
from hvtrain.spec import ModelSpec, check_weights, from_layers, per_layer

from .model import build_module, neutral_to_torch, torch_to_neutral
from .ops import LOSSES, eval_sums, load_training_state, make_optimizer, training_state
from .stage import TorchStage

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class TorchBackend(HorovodCollectives, Backend):
    name = "torch"

    def __init__(self) -> None:
        import horovod.torch as hvd

        self.hvd = hvd
        self.model: torch.nn.Module | None = None
        self.spec: ModelSpec | None = None
        self._loss_acc = torch.zeros((), dtype=torch.float64)

    # -- lifecycle -------------------------------------------------------------------------
    def init(self, cfg: Config, comm: Any = None, groups: list[list[int]] | None = None) -> ProcessInfo:
        torch.set_num_threads(cfg.train.threads or default_threads(local_size_from_env()))
        return self._init_horovod(cfg, comm, groups)

    def build(self, cfg: Config, spec: ModelSpec | None, weights: dict[str, np.ndarray] | None,
              num_outputs: int) -> None:
        hvd = self.hvd
        self.cfg, self.spec = cfg, spec
        torch.manual_seed(cfg.seed * 7919 + self.info.rank)  # dropout masks differ per rank
        self.model = load_entrypoint(cfg, torch.nn.Module, "torch.nn.Module") if spec is None else build_module(spec)
        if weights is not None:
            self.set_weights(weights)
        self.optimizer = make_optimizer(cfg, self.model)
        if self.info.size > 1 and not elastic_launch():  # elastic: state.sync() broadcasts
            hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)
        if self.info.size > 1 or elastic_launch():  # elastic: the world may grow later
            compression = hvd.Compression.fp16 if cfg.train.compression == "fp16" else hvd.Compression.none
            self.optimizer = hvd.DistributedOptimizer(
                self.optimizer, named_parameters=self.model.named_parameters(), compression=compression,
                backward_passes_per_step=cfg.train.grad_accumulation, op=hvd.Average)
        self.autocast = _AUTOCAST.get(cfg.train.precision)
        self.scaler = torch.amp.GradScaler("cpu") if cfg.train.precision == "fp16" else None
        self.loss_fn = LOSSES[cfg.loss]
        self.skip_nan = cfg.train.on_nan == "skip"
        self.model.train()

    def shutdown(self) -> None:
        self.hvd.shutdown()

    def local_gpus(self) -> int:
        return torch.cuda.device_count()

    def build_stage(self, cfg: Config, spec: ModelSpec, stage: Stage, plan: PipelinePlan,
                    weights: dict[str, np.ndarray]) -> TorchStage:
        ps = self.process_sets[stage.index] if plan.replicas > 1 else None
        return TorchStage(self.hvd, cfg, spec, stage, plan.replicas, weights, ps)

    # -- steps -----------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, x: np.ndarray, y: np.ndarray, weights: np.ndarray, apply: bool) -> bool:
        xt, yt, wt = torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(weights)
        with torch.autocast("cpu", dtype=self.autocast, enabled=self.autocast is not None):
            out = self.model(xt)
        loss = (self.loss_fn(out.float(), yt) * wt).sum()
        finite = bool(torch.isfinite(loss))  # CPU eager: no extra synchronisation
        if not finite and not self.skip_nan:
            return False  # the trainer stops the job, naming this rank and step
        if finite:
            self._loss_acc += loss.detach()
        # Horovod averages over ranks; each rank's weighted sum is 1/size of the global mean.
        scaled = loss * self.info.size
        if self.scaler is not None:
            self.scaler.scale(scaled).backward()
        else:
            scaled.backward()
        if apply:
            self._update()
        return finite

    def _update(self) -> None:
        distributed = self.info.size > 1 or elastic_launch()
        if distributed and (self.scaler is not None or self.skip_nan):
            self.optimizer.synchronize()  # averaged gradients, before deciding anything on them
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
            if distributed:
                with self.optimizer.skip_synchronize():
                    self.scaler.step(self.optimizer)
            else:
                self.scaler.step(self.optimizer)
            self.scaler.update()
        elif self.skip_nan:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            if all(bool(torch.isfinite(g).all()) for g in grads):  # same decision on every rank
                if distributed:
                    with self.optimizer.skip_synchronize():
                        self.optimizer.step()
                else:
                    self.optimizer.step()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()

    def loss_sum(self, reset: bool = False) -> float:
        value = float(self._loss_acc)
        if reset:
            self._loss_acc.zero_()
        return value

    @torch.no_grad()
    def eval_batch(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        self.model.eval()
        try:
            out = self.model(torch.from_numpy(x)).float()
        finally:
            self.model.train()
        return eval_sums(self.cfg.loss, out, torch.from_numpy(y))

    @torch.no_grad()
    def predict(self, x: np.ndarray) -> np.ndarray:
        self.model.eval()
        try:
            return self.model(torch.from_numpy(x)).float().numpy()
        finally:
            self.model.train()

    def allreduce_sum(self, values: np.ndarray) -> np.ndarray:
        if self.info.size == 1:
            return values
        t = torch.from_numpy(np.ascontiguousarray(values, np.float64))
        return self.hvd.allreduce(t, op=self.hvd.Sum, name="hvtrain.allreduce_sum").numpy()

    def elastic_state(self, counters: dict[str, Any]) -> Any:
        return self.hvd.elastic.TorchState(model=self.model, optimizer=self.optimizer, **counters)

    def elastic_run(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return self.hvd.elastic.run(fn)

    def refresh(self) -> ProcessInfo:
        self.info = self._read_info("gloo")  # elastic runs use the Gloo controller
        return self.info

    # -- state and weights -------------------------------------------------------------------
    def get_state(self) -> dict[str, np.ndarray]:
        return training_state(self.model, self.optimizer, self.scaler)

    def set_state(self, state: dict[str, np.ndarray], rng: bool = True) -> None:
        load_training_state(state, self.model, self.optimizer, self.scaler, rng)

    # -- weights ---------------------------------------------------------------------------
    def get_weights(self) -> dict[str, np.ndarray]:
        state = {k: v.detach().cpu().numpy().copy() for k, v in self.model.state_dict().items()
                 if v.is_floating_point()}
        if self.spec is None:
            return state
        grouped = []
        for layer in self.spec.layers:
            prefix = f"{layer.index}."
            grouped.append(torch_to_neutral(layer, {k[len(prefix):]: v for k, v in state.items()
                                                    if k.startswith(prefix)}))
        return from_layers(self.spec, grouped)

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        if self.spec is None:
            state = {k: torch.from_numpy(np.array(v)) for k, v in weights.items()}
            self.model.load_state_dict(state, strict=False)
            return
        check_weights(self.spec, weights, "weights")
        native = {}
        for layer, w in zip(self.spec.layers, per_layer(self.spec, weights), strict=True):
            for k, v in neutral_to_torch(layer, w).items():
                native[f"{layer.index}.{k}"] = torch.from_numpy(np.ascontiguousarray(v, np.float32))
        missing, unexpected = self.model.load_state_dict(native, strict=False)
        missing = [m for m in missing if not m.endswith("num_batches_tracked")]
        if missing or unexpected:
            raise AssertionError(f"weight conversion bug: missing {missing}, unexpected {unexpected}")


# ----------------------------------------------------------------------------- helpers
