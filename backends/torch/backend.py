"""TorchBackend: PyTorch math under horovod.torch (DistributedOptimizer: ring-allreduce, fusion)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from hvtrain.backends.base import Backend, Collectives
from hvtrain.backends.reduce import direct_reduction
from hvtrain.config.schema import Config
from hvtrain.config.validate import per_sample_randomness
from hvtrain.launch.process import ProcessInfo, default_threads
from hvtrain.metrics.suite import MetricSet
from hvtrain.model.entrypoint import load_entrypoint
from hvtrain.model.native import PLAIN, NativeInputs, OutputForm, check_reads, decide_form
from hvtrain.model.spec import ModelSpec
from hvtrain.model.weights import Inputs

from .draws import SampleDraws, keyed
from .export import export as export_model
from .export import load as load_exported
from .model import build_model, from_native, to_native
from .native import reading, reads, returned, scores
from .ops import LOSSES, DirectGradients, eval_sums, load_training_state, make_optimizer, state_bytes, training_state
from .shard import ShardedOptimizer
from .stage import TorchStage

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _on(device: torch.device, a: np.ndarray) -> torch.Tensor:
    """A host array on `device`; to a GPU through pinned memory, the copy queued without waiting."""
    t = torch.from_numpy(a)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class TorchBackend(Backend):
    name = "torch"

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.spec: ModelSpec | None = None
        self.device = torch.device("cpu")
        self._loss_acc = torch.zeros((), dtype=torch.float64)

    def configure(self, cfg: Config, info: ProcessInfo, gpu: int | None) -> None:
        torch.set_num_threads(cfg.train.threads or default_threads(info))
        if gpu is not None:  # Horovod's local-rank pinning
            torch.cuda.set_device(gpu)
            self.device = torch.device("cuda", gpu)
            self._loss_acc = self._loss_acc.to(self.device)  # summed where the loss is: no copy per step
        # fp32 is fp32 on a GPU too: cuDNN's default TF32 convolutions (Ampere and later) round inputs to
        # 10 mantissa bits, 1e-3 from the CPU's results; bf16/fp16 are the fast paths
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.train.precision != "fp32"
        torch.manual_seed(cfg.seed * 7919 + info.rank)  # dropout masks differ per rank

    def export(self, fmt: str, path: str, inputs: Inputs) -> None:
        export_model(self.model, fmt, path, inputs, self.form)

    def load_export(self, fmt: str, path: str) -> Callable[[np.ndarray], np.ndarray]:
        return load_exported(fmt, path)

    def local_gpus(self) -> int:
        return torch.cuda.device_count()

    def native_inputs(self) -> NativeInputs:
        return self.native

    def output_form(self) -> OutputForm:
        return self.form

    def build(self, cfg: Config, spec: ModelSpec | None, weights: dict[str, np.ndarray] | None,
              num_outputs: int, runtime: Collectives, example: np.ndarray | None = None,
              form: OutputForm | None = None) -> None:
        self.cfg, self.spec, self.runtime = cfg, spec, runtime
        self.draws = SampleDraws() if per_sample_randomness(cfg) and spec is not None and spec.draws_random else None
        model = load_entrypoint(cfg, torch.nn.Module, "torch.nn.Module") if spec is None \
            else build_model(spec, draws=self.draws)
        self.model = model.to(self.device)
        self.form, self.native = PLAIN, NativeInputs(spec.integer_input) if spec is not None else None
        if spec is None:  # the first forward also materialises lazy modules, before the optimizer takes them
            self.native = reads(cfg, self.model, example, self.device)
            check_reads(cfg, self.native, example)
            _one_value_batchnorm(self.model)
        if weights is not None:
            self.set_weights(weights)
        self.optimizer = make_optimizer(cfg, self.model)
        if runtime.info.size > 1 and not runtime.elastic:  # elastic: the state's sync() broadcasts
            runtime.horovod.broadcast_model(self.model, self.optimizer)
        self.direct = None
        if cfg.train.shard_optimizer:  # replaces the whole-state optimizer (without state: never stepped)
            self.optimizer = ShardedOptimizer(cfg, [p for p in self.model.parameters() if p.requires_grad], runtime)
        elif direct_reduction(cfg, self.device.type == "cuda"):
            self.direct = DirectGradients(list(self.model.parameters()), runtime)
        elif runtime.distributed:
            self.optimizer = runtime.horovod.distributed_optimizer(
                self.optimizer, self.model, cfg.train.compression, cfg.train.grad_accumulation,
                cfg.horovod.num_groups)
        if spec is None:  # decided on the broadcast weights: the same on every rank
            x = example.astype(np.int64) if self.native.token_ids else example
            self.form = decide_form(cfg, returned(cfg, self.model, x, self.device), len(x), num_outputs, form,
                                    training=weights is None)
        self.autocast = AUTOCAST.get(cfg.train.precision)
        # 2^15 to start, as Keras and the pipeline loss scale do
        self.scaler = torch.amp.GradScaler(self.device.type, init_scale=2.0 ** 15) \
            if cfg.train.precision == "fp16" else None
        self.loss_fn = LOSSES[cfg.loss]
        self.skip_nan = cfg.train.on_nan == "skip"
        self.model.train()

    def build_stage(self, cfg: Config, spec: ModelSpec, layers: list[int], sources: tuple[int, ...],
                    outputs: tuple[int, ...], device: str, weights: dict[str, np.ndarray], replicas: int,
                    runtime: Collectives, process_set: Any) -> TorchStage:
        return TorchStage(runtime, cfg, spec, layers, sources, outputs, device, replicas, weights, process_set)

    # -- steps -----------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, x: np.ndarray, y: np.ndarray, sample_weight: np.ndarray, apply: bool,
                   keys: np.ndarray | None = None) -> bool:
        xt, yt, wt = _on(self.device, x), _on(self.device, y), _on(self.device, sample_weight)
        padding = not sample_weight.any()  # an empty share: joins the allreduce, touches no statistics
        if padding:
            self.model.eval()
        seen = reading(self.form)
        try:
            with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None), \
                    seen or nullcontext(), keyed(self.draws, keys):
                out = self.model(xt)
        finally:
            if padding:
                self.model.train()
        loss = (self.loss_fn(scores(self.form, out, seen), yt) * wt).sum()
        finite = bool(torch.isfinite(loss))
        if not finite and not self.skip_nan:
            return False  # the loop stops the job, naming this rank and step
        if finite:
            self._loss_acc += loss.detach().double()
        # Each rank's weighted sum is 1/size of the global mean: summed over ranks (direct) as it is;
        # Horovod's optimizer averages
        scaled = loss if self.direct is not None else loss * self.runtime.info.size
        if not finite:  # on_nan: skip. An inf loss can have finite gradients (an overflowing squared
            scaled = scaled * float("nan")  # error): NaN ones make every rank skip this update alike
        if apply and isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.arm()  # chunks reduce-scatter as their gradients complete
        if self.scaler is not None:
            self.scaler.scale(scaled).backward()
        else:
            scaled.backward()
        if apply:
            self._update()
        return finite

    def _update(self) -> None:
        if self.direct is not None:
            self._direct_update()
            return
        distributed = self.runtime.distributed
        if not distributed and self.spec is None and not isinstance(self.optimizer, ShardedOptimizer):
            # A native model's parameter that got no gradient (an unused head, a branch not taken)
            # steps on a zero one, as Horovod's optimizer fills it in on N > 1 ranks and the sharded
            # optimizer's buffer does: weight decay moves it the same on any rank count (a plain
            # optimizer skips a parameter without .grad)
            for param in self.model.parameters():
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
        if distributed and (self.scaler is not None or self.skip_nan):
            self.optimizer.synchronize()  # averaged gradients, before deciding anything on them
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
            self._step(distributed, lambda: self.scaler.step(self.optimizer))
            self.scaler.update()
        elif self.skip_nan:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            if all(bool(torch.isfinite(g).all()) for g in grads):  # same decision on every rank
                self._step(distributed, self.optimizer.step)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()

    def _direct_update(self) -> None:
        self.direct.sum()
        if self.scaler is not None:  # the summed gradients: every rank finds the same inf
            self.scaler.unscale_(self.optimizer)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not self.skip_nan or self.direct.finite():  # decided on summed gradients: the same on every rank
            self.optimizer.step()
        self.optimizer.zero_grad()

    def _step(self, synchronized: bool, step: Callable[[], Any]) -> None:
        if synchronized:  # gradients already averaged: Horovod must not reduce them again
            with self.optimizer.skip_synchronize():
                step()
        else:
            step()

    def discard_gradients(self) -> None:
        if isinstance(self.optimizer, ShardedOptimizer):  # the .grad tensors are views of its buffer
            self.optimizer.zero_grad()
            return
        # Horovod's restore (optimizer.load_state_dict) already dropped its pending handles; the
        # .grad tensors and the micro-batch counters of an unfinished step are ours to reset.
        for p in self.model.parameters():
            p.grad = None
        if self.runtime.distributed and self.direct is None:
            self.optimizer.set_backward_passes_per_step(self.optimizer.backward_passes_per_step)

    def on_world_change(self) -> None:
        pass  # sizes are read from the runtime at every step

    def release_training_state(self) -> None:
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.release()
            return
        self.optimizer.state.clear()
        for p in self.model.parameters():
            p.grad = None

    def optimizer_state_bytes(self) -> int:
        if isinstance(self.optimizer, ShardedOptimizer):
            return self.optimizer.state_bytes()
        return state_bytes(self.optimizer)

    def loss_sum(self, reset: bool = False) -> float:
        value = float(self._loss_acc)
        if reset:
            self._loss_acc.zero_()
        return value

    @torch.no_grad()
    def eval_batch(self, x: np.ndarray, y: np.ndarray, metrics: MetricSet, index: np.ndarray) -> np.ndarray:
        return eval_sums(self.cfg.loss, self.predict(x), y, metrics, index)

    @torch.no_grad()
    def predict(self, x: np.ndarray) -> np.ndarray:
        self.model.eval()
        seen = reading(self.form)
        try:
            with seen or nullcontext():
                out = self.model(_on(self.device, x))
            return scores(self.form, out, seen).cpu().numpy()
        finally:
            self.model.train()

    # -- state and weights -------------------------------------------------------------------
    def get_state(self) -> dict[str, np.ndarray]:
        return training_state(self.model, self.optimizer, self.scaler)

    def set_state(self, state: dict[str, np.ndarray], rng: bool = True) -> None:
        load_training_state(state, self.model, self.optimizer, self.scaler, rng)

    def elastic_state(self, counters: dict[str, Any]) -> Any:
        return self.runtime.horovod.elastic_state(self.model, self.optimizer, counters, self.scaler)

    def get_weights(self) -> dict[str, np.ndarray]:
        return from_native(self.spec, self.model)

    def trainable_names(self) -> set[str]:
        if self.spec is not None:
            return {w.name for w in self.spec.weight_specs() if w.trainable}
        return {n for n, p in self.model.named_parameters() if p.requires_grad}

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        to_native(self.spec, self.model, weights)


def _one_value_batchnorm(model: torch.nn.Module) -> None:
    """A user model's batch norm on a training batch of one value per channel (a rank's one-sample
    share of a tail batch) normalises with its running statistics and leaves them unchanged, as
    the catalogue's batchnorm and Keras do; torch would raise 'Expected more than 1 value per
    channel when training' mid-run."""
    lent: set[int] = set()

    def before(module: torch.nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        if module.training and isinstance(x, torch.Tensor) and x.dim() >= 2 and x.numel() == x.shape[1] \
                and module.track_running_stats:
            lent.add(id(module))
            module.train(False)

    def after(module: torch.nn.Module, args: tuple, out: Any) -> None:
        if id(module) in lent:
            lent.discard(id(module))
            module.train(True)

    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.register_forward_pre_hook(before)
            m.register_forward_hook(after)
