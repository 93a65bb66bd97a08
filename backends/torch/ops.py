"""Losses (per sample) and optimizers, shared by the data-parallel model and pipeline stages."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from hvtrain.backends.reduce import sum_arrays
from hvtrain.config.schema import Config
from hvtrain.io.statefile import decode_json, encode_json
from hvtrain.metrics.suite import MetricSet, batch_stats


def _fits(out: torch.Tensor, y: torch.Tensor, width: int | None = None) -> None:
    """Outputs [batch, width] against labels [batch] (width None: targets of the outputs' shape).
    Elementwise ops would broadcast a [batch] output against [batch, 1] targets into a
    [batch, batch] loss: the batch mean is learned, silently."""
    ok = out.shape == y.shape if width is None else \
        (out.dim() == 2 and y.dim() == 1 and len(out) == len(y) and (width == 0 or out.shape[1] == width))
    if not ok:
        raise ValueError(f"loss: outputs of shape {list(out.shape)} do not fit labels of shape {list(y.shape)}")


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _fits(out, y, 0)
    return F.cross_entropy(out, y, reduction="none")


def _bce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _fits(out, y, 1)
    return F.binary_cross_entropy_with_logits(out[:, 0], y.to(out.dtype), reduction="none")


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _fits(out, y)
    return (out - y).pow(2).mean(dim=1)


def _mae(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _fits(out, y)
    return (out - y).abs().mean(dim=1)


LOSSES = {"cross_entropy": _ce, "binary_cross_entropy": _bce, "mse": _mse, "mae": _mae}


def make_optimizer(cfg: Config, model: torch.nn.Module | list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """cfg.optimizer over the trainable parameters of `model` (a module, or the parameters themselves)."""
    o = cfg.optimizer
    params = [p for p in (model.parameters() if isinstance(model, torch.nn.Module) else model) if p.requires_grad]
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov,
                               weight_decay=o.weight_decay)
    if o.name in ("adam", "adamw"):
        cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
        return cls(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    return torch.optim.RMSprop(params, lr=o.lr, alpha=o.rho, eps=o.eps, momentum=o.momentum,
                               weight_decay=o.weight_decay)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's state tensors."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v))


def eval_sums(loss: str, out: np.ndarray, y: np.ndarray, metrics: MetricSet | None = None,
              index: np.ndarray | None = None) -> np.ndarray:
    """A batch's evaluation statistics: the loss summed by torch (the training objective), the rest
    from the outputs by hvtrain.metrics.suite. Without `metrics` (pipeline stages, for now): the head
    [loss, correct, squared error, absolute error]."""
    total = LOSSES[loss](torch.from_numpy(out), torch.from_numpy(y)).sum().item()
    return batch_stats(loss, total, out, y, metrics, index)


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler=None) -> dict[str, np.ndarray]:
    """Model, optimizer (tensors + JSON metadata) and this process's torch RNG, as named arrays."""
    state = {f"model.{k}": v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    meta: dict[str, Any] = {"param_groups": opt["param_groups"], "state": {}}
    for idx, values in opt["state"].items():
        for k, v in values.items():
            if torch.is_tensor(v):
                state[f"optim.{idx}.{k}"] = v.detach().cpu().numpy().copy()
            else:
                meta["state"].setdefault(str(idx), {})[k] = v
    if scaler is not None:
        meta["scaler"] = scaler.state_dict()
    state["optim.meta"] = encode_json(meta)
    state["rng.torch"] = torch.get_rng_state().numpy().copy()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["rng.torch_cuda"] = torch.cuda.get_rng_state().numpy().copy()
    return state


def load_training_state(state: dict[str, np.ndarray], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        scaler=None, rng: bool = True) -> None:
    try:
        model.load_state_dict({k[len("model."):]: torch.from_numpy(np.array(v)) for k, v in state.items()
                               if k.startswith("model.")}, strict=True)
    except RuntimeError as exc:  # a checkpoint of another model (or hvtrain version): say so, no traceback
        from hvtrain.errors import HvtrainError

        raise HvtrainError(f"the checkpoint's model state does not fit this model ({str(exc).splitlines()[0]})"
                           ) from None
    meta = decode_json(state["optim.meta"])
    per_param: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in meta["state"].items()}
    for key, value in state.items():
        parts = key.split(".")
        if parts[0] == "optim" and parts[1].isdigit():
            per_param.setdefault(int(parts[1]), {})[".".join(parts[2:])] = torch.from_numpy(np.array(value))
    optimizer.load_state_dict({"state": per_param, "param_groups": meta["param_groups"]})
    if scaler is not None and "scaler" in meta:
        scaler.load_state_dict(meta["scaler"])
    if rng:
        torch.set_rng_state(torch.from_numpy(np.array(state["rng.torch"])))
        if "rng.torch_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.from_numpy(np.array(state["rng.torch_cuda"])))


class DirectGradients:
    """The trainable parameters' gradients summed over the ranks after backward, in place
    (backends/reduce.py). A parameter without a gradient (an unused head) gets a zero one and
    steps on it, as Horovod's DistributedOptimizer fills it in: the same on any rank count."""

    def __init__(self, params: list[torch.nn.Parameter], runtime: Any) -> None:
        self.runtime = runtime
        self.params = [p for p in params if p.requires_grad]

    def sum(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        if self.runtime.info.size == 1:
            return
        for p in self.params:
            if p.grad.is_sparse:  # nn.Embedding(sparse=True): summed dense, as TensorFlow sums IndexedSlices
                p.grad = p.grad.to_dense()
            if not p.grad.is_contiguous():  # channels_last: summed as a contiguous copy
                p.grad = p.grad.contiguous()
        grads = [p.grad for p in self.params]
        if not self.runtime.direct:  # Gloo, elastic: one grouped Horovod allreduce (one cycle)
            for grad, summed in zip(grads, self.runtime.horovod.sum(grads, "hvtrain.grads"), strict=True):
                grad.copy_(summed)
            return
        # a GPU tensor (`reduction: direct` on a GPU) or bf16 (numpy has none): through a host copy
        host = [g if g.device.type == "cpu" and g.dtype != torch.bfloat16 else g.to("cpu", torch.float32)
                for g in grads]
        sum_arrays(self.runtime, [h.numpy() for h in host])
        for g, h in zip(grads, host, strict=True):
            if h is not g:
                g.copy_(h)

    def finite(self) -> bool:
        return all(bool(torch.isfinite(p.grad).all()) for p in self.params)
