"""Object collectives and process facts that read the same from every horovod.<framework> module.

Mixed into both backends; `self.hvd` is the framework's Horovod module, `self.info` the ProcessInfo.
Names are fixed because Horovod matches collectives across ranks by name (its default name is the
object's type, which differs between the root and the receivers)."""

from __future__ import annotations

from typing import Any

from hvtrain.dist import ProcessInfo


class HorovodCollectives:
    hvd: Any
    info: ProcessInfo

    def _read_info(self, controller: str) -> ProcessInfo:
        hvd = self.hvd
        size = hvd.size()
        return ProcessInfo(hvd.rank(), size, hvd.local_rank(), hvd.local_size(), controller if size > 1 else "none")

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj if self.info.size == 1 else self.hvd.broadcast_object(obj, root_rank=root, name="hvtrain.object")

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj] if self.info.size == 1 else self.hvd.allgather_object(obj, name="hvtrain.objects")
