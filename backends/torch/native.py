"""An entrypoint torch model against hvtrain's native-model contract (hvtrain.model.native): what it
reads and returns on the probe batch, and its output turned into logits (`scores`: the input of
its final softmax/sigmoid where the probe saw that call, read in every forward by `reading`)."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hvtrain.config.schema import Config
from hvtrain.errors import HvtrainError
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


class Provenance(TorchFunctionMode):
    """Which softmax / sigmoid / log_softmax call of one forward made each tensor, through the ops
    that pass its values on (_PASSING), for `returned` and `scores`.

    Records hold weak references, never a tensor: the probe kept every intermediate alive (a model
    whose forward needs 483 MiB under no_grad peaked at 3364 MiB). Only with `keep`, the input of
    the latest activation call (its logits) is kept, one at a time, and the ops that follow that
    activation are applied to it as well, so `scores` trains on the logits it was given."""

    def __init__(self, keep: bool = False) -> None:
        super().__init__()
        self.keep, self.calls = keep, 0
        self.made: dict[int, tuple[weakref.ref, str, int, bool]] = {}  # id -> (tensor, op, call, input readable)
        self.logits: dict[int, torch.Tensor] = {}  # id -> the logits of the latest call's tensors

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        name = getattr(func, "__name__", "")
        inplace = name.endswith("_") and not name.endswith("__")  # x.sigmoid_(): its input is gone
        name = name[:-1] if inplace else name
        src = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if name in ACTIVATIONS:
            self.made[id(out)] = (weakref.ref(out), name, self.calls, not inplace)
            self.calls += 1
            if self.keep:
                self.logits = {} if inplace else {id(out): src}
        elif name in _PASSING and src is not None:
            made = self.of(src)
            if made is not None:
                self.made[id(out)] = (weakref.ref(out), *made[1:3], made[3] and not inplace)
                logits = self.logits.get(id(src)) if self.keep and made[2] == self.calls - 1 else None
                if logits is not None and not inplace:  # the same op on the logits (a dtype, a shape, a selection)
                    self.logits[id(out)] = func(*[logits if a is src else a for a in args], **kwargs)
        return out

    def of(self, t: torch.Tensor) -> tuple[weakref.ref, str, int, bool] | None:
        """The record of `t` (None: no activation made it)."""
        made = self.made.get(id(t))
        return made if made is not None and made[0]() is t else None

    def logits_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The logits behind `t`, if the forward's last activation call made it and its input was kept."""
        made = self.of(t)
        return self.logits.get(id(t)) if made is not None and made[2] == self.calls - 1 else None


def returned(cfg: Config, model: nn.Module, x: np.ndarray, device: torch.device) -> Returned:
    """What the model returns for the probe batch `x`, and the op that made its scores."""
    xt = torch.from_numpy(np.ascontiguousarray(x)).to(device)
    seen = Provenance()
    with seen:
        out = _run(cfg, model, xt)
    want = cfg.model.output_key
    if isinstance(out, Mapping):
        keys = tuple(str(k) for k in out)
        key = want if isinstance(want, str) else "logits"
        t = out.get(key)
        if key in out and not isinstance(t, torch.Tensor):
            return Returned(f"mapping whose {key!r} is a {type(t).__name__}")
        if t is None or not isinstance(want, (str, type(None))):
            return Returned("mapping", keys)
        return Returned("mapping", keys, scores=t.detach().double().cpu().numpy(), **_made(seen, t))
    if isinstance(out, (tuple, list)):
        index = want if type(want) is int else 0
        t = out[index] if 0 <= index < len(out) else None
        if not isinstance(t, torch.Tensor):
            return Returned("sequence", length=len(out))
        return Returned("sequence", length=len(out), scores=t.detach().double().cpu().numpy(), **_made(seen, t))
    if not isinstance(out, torch.Tensor):
        return Returned(type(out).__name__)
    return Returned("tensor", scores=out.detach().double().cpu().numpy(), **_made(seen, out))


def _made(seen: Provenance, t: torch.Tensor) -> dict[str, Any]:
    """The op that made `t`; its input can be read in training when that was the forward's last
    activation call (the one whose input `reading` keeps) and not an in-place one."""
    made = seen.of(t)
    return {} if made is None else {"activation": made[1], "pre": made[3] and made[2] == seen.calls - 1}


def reading(form: OutputForm) -> Provenance | None:
    """What a forward runs under so that `scores` can read the logits of its final activation:
    None where the form reads none."""
    return Provenance(keep=True) if form.pre else None


def scores(form: OutputForm, out: Any, seen: Provenance | None = None) -> torch.Tensor:
    """The model's output as [batch, width] float32 logits, as `form` says; `seen`: what the
    forward ran under (`reading`), whose logits are read where the form says so.

    Raises:
        HvtrainError: the form reads the final activation's input, and this forward's output was not
            made by that call (a forward that differs from the probe's).
    """
    if form.key is not None:
        out = out[form.key]
    elif isinstance(out, (tuple, list)) and out:  # a tensor in inference (the probe), a tuple in training:
        out = out[0]  # torchvision's Inception/GoogLeNet (logits, aux): the contract's first value
    elif isinstance(out, Mapping) and "logits" in out:
        out = out["logits"]
    if form.pre:
        logits = seen.logits_of(out) if seen is not None else None
        if logits is None:
            raise HvtrainError(f"model.entrypoint: this forward's output was not made by its last {form.undo} call, "
                               "as the probe batch's was, whose input hvtrain trains on: a forward must end the "
                               "same way on every call")
        out = logits
    out = out.float()
    if form.flat:
        out = out.reshape(-1, 1)
    if form.pre:
        return out
    if form.undo == "softmax":
        return torch.log(out.clamp(min=TINY))
    if form.undo == "sigmoid":
        p = out.clamp(TINY, ONE_BELOW)
        return torch.log(p) - torch.log1p(-p)
    return out
