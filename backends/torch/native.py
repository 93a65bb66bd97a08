"""An entrypoint torch model against hvtrain's native-model contract (hvtrain.model.native): what it
reads and returns on the probe batch, and its output turned into logits (`scores`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hvtrain.config.schema import Config
from hvtrain.model.native import ACTIVATIONS, ONE_BELOW, TINY, NativeInputs, OutputForm, Returned

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
# Ops that pass an activation's values on unchanged in meaning (dtype, shape, a selection).
_PASSING = {"float", "to", "type", "contiguous", "clone", "squeeze", "unsqueeze", "reshape", "view", "flatten",
            "__getitem__", "double", "half", "bfloat16"}


class _ReadsIds(Exception):
    """An embedding was handed the model's input as floats, or ids it has no row for: stop the
    forward there (torch would raise; hvtrain.model.native.check_reads says what is wrong)."""


def _run(cfg: Config, model: nn.Module, x: torch.Tensor) -> Any:
    """One forward in inference mode, no gradient (no statistics or state change); a failure is
    the user's code failing on the data, located at model.entrypoint."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(x)
    except _ReadsIds:
        raise
    except Exception as exc:  # noqa: BLE001 - user code: any failure is reported, located
        raise cfg.fail("model.entrypoint", f"{cfg.model.entrypoint} raised {type(exc).__name__} on a probe batch of "
                                           f"{len(x)} training samples {list(x.shape)} {str(x.dtype)[6:]}: "
                                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    finally:
        model.train(was)


def reads(cfg: Config, model: nn.Module, x: np.ndarray, device: torch.device) -> NativeInputs:
    """What the model reads, from its first forward on the probe batch `x` (which also
    materialises lazy modules before the optimizer is built): token ids when an embedding is
    handed the model input (up to a cast), float32 otherwise."""
    hits: list[int] = []
    xt = torch.from_numpy(np.ascontiguousarray(x)).to(device)
    current = [xt]  # the input of the forward running now

    def hook(module: nn.Module, args: tuple) -> None:
        ids = args[0] if args else None
        if isinstance(ids, torch.Tensor) and ids.numel() == xt.numel() and \
                torch.equal(ids.reshape(-1), current[0].reshape(-1).to(ids.dtype)):
            hits.append(module.num_embeddings)
            if ids.is_floating_point() or ids.numel() and (ids.min() < 0 or ids.max() >= module.num_embeddings):
                raise _ReadsIds

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, EMBEDDINGS)]
    try:
        try:
            _run(cfg, model, xt)
        except _ReadsIds:
            pass
        if not hits:
            return NativeInputs()
        hits.clear()
        current[0] = xt.long()
        try:
            _run(cfg, model, current[0])
        except _ReadsIds:
            pass
        return NativeInputs(True, min(hits) if hits else None)
    finally:
        for h in handles:
            h.remove()


class _Made(TorchFunctionMode):
    """Records which op made each tensor (and from which input), for `returned`."""

    def __init__(self) -> None:
        super().__init__()
        self.by: dict[int, tuple[str, torch.Tensor, torch.Tensor | None]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            src = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self.by[id(out)] = (getattr(func, "__name__", "").rstrip("_"), out, src)
        return out

    def activation(self, t: torch.Tensor) -> str | None:
        for _ in range(64):
            made = self.by.get(id(t))
            if made is None or made[1] is not t:
                return None
            name, _, src = made
            if name in ACTIVATIONS:
                return name
            if name not in _PASSING or src is None:
                return None
            t = src
        return None


def returned(cfg: Config, model: nn.Module, x: np.ndarray, device: torch.device) -> Returned:
    """What the model returns for the probe batch `x`, and the op that made its scores."""
    xt = torch.from_numpy(np.ascontiguousarray(x)).to(device)
    mode = _Made()
    with mode:
        out = _run(cfg, model, xt)
    if isinstance(out, Mapping):
        keys = tuple(str(k) for k in out)
        t = out.get("logits")
        if "logits" in out and not isinstance(t, torch.Tensor):
            return Returned(f"mapping whose 'logits' is a {type(t).__name__}")
        if t is None:
            return Returned("mapping", keys)
        return Returned("mapping", keys, scores=t.detach().double().cpu().numpy(), activation=mode.activation(t))
    if isinstance(out, (tuple, list)):
        return Returned("sequence", length=len(out))
    if not isinstance(out, torch.Tensor):
        return Returned(type(out).__name__)
    return Returned("tensor", scores=out.detach().double().cpu().numpy(), activation=mode.activation(out))


def scores(form: OutputForm, out: Any) -> torch.Tensor:
    """The model's output as [batch, width] float32 logits, as `form` says."""
    if form.key is not None:
        out = out[form.key]
    out = out.float()
    if form.flat:
        out = out.reshape(-1, 1)
    if form.undo == "softmax":
        return torch.log(out.clamp(min=TINY))
    if form.undo == "sigmoid":
        p = out.clamp(TINY, ONE_BELOW)
        return torch.log(p) - torch.log1p(-p)
    return out
