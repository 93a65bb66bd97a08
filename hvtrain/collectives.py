"""Object collectives and process facts that read the same from every horovod.<framework> module.

Mixed into both backends; `self.hvd` is the framework's Horovod module, `self.info` the ProcessInfo.
Names are fixed because Horovod matches collectives across ranks by name (its default name is the
object's type, which differs between the root and the receivers)."""

from __future__ import annotations

import importlib
import os
from typing import Any

from hvtrain.config import Config
from hvtrain.dist import ProcessInfo, horovod_env, launched_with_gloo


class HorovodCollectives:
    hvd: Any
    info: ProcessInfo

    def _init_horovod(self, cfg: Config, comm: Any, groups: list[list[int]] | None) -> ProcessInfo:
        """Horovod knobs from the config, process sets (pipeline stages), hvd.init, ProcessInfo."""
        os.environ.update(horovod_env(cfg.horovod.cycle_time_ms, cfg.horovod.fusion_threshold_mb))
        self.process_sets = [self.hvd.ProcessSet(g) for g in groups or []]
        self.hvd.init(comm=comm, process_sets=self.process_sets or None)
        self.info = self._read_info("gloo" if self.hvd.gloo_enabled() and launched_with_gloo() else "mpi")
        return self.info

    def _read_info(self, controller: str) -> ProcessInfo:
        hvd = self.hvd
        size = hvd.size()
        return ProcessInfo(hvd.rank(), size, hvd.local_rank(), hvd.local_size(), controller if size > 1 else "none")

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj if self.info.size == 1 else self.hvd.broadcast_object(obj, root_rank=root, name="hvtrain.object")

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj] if self.info.size == 1 else self.hvd.allgather_object(obj, name="hvtrain.objects")


def load_entrypoint(cfg: Config, expected: type, what: str) -> Any:
    """Call the configured `package.module:function` (the only user code hvtrain imports) and check
    that it returned an `expected` model (`what` names it in the error)."""
    module_name, _, func_name = cfg.model.entrypoint.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as exc:
        raise cfg.fail("model.entrypoint", f"cannot import {cfg.model.entrypoint!r}: {exc}") from None
    model = func(**cfg.model.kwargs)
    if not isinstance(model, expected):
        raise cfg.fail("model.entrypoint", f"expected the function to return a {what} for backend "
                       f"{cfg.backend}, got {type(model).__name__}")
    return model
