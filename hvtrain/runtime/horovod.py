"""The Horovod runtime of one process: init, who it is, collectives, process sets, elastic, abort.

One `Runtime` per run, created and owned by hvtrain.runtime.session; the training loop, the
checkpoint manager and the pipeline runner talk to the other ranks only through it. Backends are
framework math: they receive the runtime when they build and ask its framework binding
(`runtime.horovod`: hvtrain.runtime.torch_horovod / tensorflow_horovod) for what their step needs
of Horovod. Nothing outside hvtrain.runtime.horovod touches Horovod itself (tests/unit/test_layers.py).
Collective names are fixed strings: Horovod matches collectives across ranks by name.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from hvtrain.backends.registry import HOROVOD
from hvtrain.errors import HvtrainError
from hvtrain.launch.process import ProcessInfo, affinity, cpu_share, launched_with_gloo, topology_key
from hvtrain.runtime.knobs import horovod_env


def grouped_allreduce(hvd: Any, tensors: list[Any], num_groups: int, name: str, **kwargs: Any) -> list[Any]:
    """Average `tensors` with Horovod, as one group (`num_groups` 0) or as `num_groups` contiguous
    groups of near-equal count (Horovod's `num_groups`: each group is one fused allreduce, so the
    first groups travel while later ones are still being computed). Works inside tf.function."""
    if num_groups <= 1 or len(tensors) <= 1:
        return list(hvd.grouped_allreduce(tensors, name=name, **kwargs))
    size, extra = divmod(len(tensors), min(num_groups, len(tensors)))
    out: list[Any] = []
    start = 0
    for i in range(min(num_groups, len(tensors))):
        stop = start + size + (1 if i < extra else 0)
        out += hvd.grouped_allreduce(tensors[start:stop], name=f"{name}.{i}", **kwargs)
        start = stop
    return out


# once per process: the CPUs it bound itself to ("cpus"); whether Horovod started idle ("idle_horovod")
_PROCESS: dict[str, Any] = {}


class Runtime:
    """Horovod for one backend's framework binding.

    Args:
        backend: a registered backend name; its Horovod binding (hvtrain.backends.registry.HOROVOD,
            e.g. hvtrain.runtime.torch_horovod) is imported now and kept as `horovod`: what the
            backend asks of Horovod goes through it. Its `collective_errors` (framework exceptions
            that mean "a collective failed": a peer died) are handed to Horovod as
            HorovodInternalError under elastic training.
    """

    def __init__(self, backend: str) -> None:
        module, _, name = HOROVOD[backend].partition(":")
        self.horovod = getattr(importlib.import_module(module), name)()
        self._hvd = self.horovod.hvd
        self._as_tensor = self.horovod.as_tensor
        self._collective_errors = self.horovod.collective_errors
        self.info = ProcessInfo()
        self.elastic = False
        self.process_sets: list[Any] = []
        self.comm: Any = None  # direct MPI, beside Horovod's: see _direct_comm

    # -- lifecycle -----------------------------------------------------------------------------
    def init(self, horovod_cfg: Any, *, elastic: bool, comm: Any = None,
             groups: list[list[int]] | None = None, out_dir: Any = None, cpu_binding: str = "none",
             direct: bool = False) -> ProcessInfo:
        """Horovod knobs (a HOROVOD_* variable set by the user wins), process sets, hvd.init.

        Args:
            horovod_cfg: the config's `horovod` section.
            elastic: this run handles worker failures and joins (`--elastic`).
            comm: an mpi4py communicator shared with Horovod (pipelines exchange activations on it).
            groups: ranks of each Horovod process set (a pipeline stage's data-parallel replicas).
            out_dir: where relative timeline / autotune log paths go (rank 0 writes them).
            cpu_binding: "auto" binds each rank's threads to its share of the host's CPUs
                (dist.cpu_share; not for elastic runs, whose hosts change; not when the user set
                HOROVOD_THREAD_AFFINITY).
            direct: the gradients go by the direct reduction (hvtrain.backends.reduce), not through
                Horovod: its cycle idles at `horovod.direct_cycle_ms`.
        """
        self.elastic = elastic
        os.environ.update(horovod_env(horovod_cfg, elastic, out_dir, direct))
        self.process_sets = [self._hvd.ProcessSet(g) for g in groups or []]
        if self._hvd.is_initialized():
            # A later session in the same process (the Python API: train, then evaluate or predict)
            # reuses Horovod: re-initialising after hvd.shutdown segfaults in 0.28.1 with an explicit
            # fusion threshold, and an MPI that Horovod finalised cannot start again.
            if groups or elastic:
                raise HvtrainError("a pipeline with data-parallel replicas (Horovod process sets) or an elastic "
                                   "run must be the first hvtrain session of its process; run it in a new process")
            if _PROCESS.get("idle_horovod") and not direct and self._hvd.size() > 1:
                raise HvtrainError("this process's first hvtrain session left Horovod's cycle idle "
                                   f"(horovod.direct_cycle_ms: {os.environ.get('HOROVOD_CYCLE_TIME')} ms), and this "
                                   "one reduces through Horovod every step (horovod.reduction: hooks, compression, "
                                   "the sharded optimizer, a GPU): run it in a new process")
        else:
            self._hvd.init(comm=comm, process_sets=self.process_sets or None)
            _PROCESS["idle_horovod"] = direct
        self.info = self._read_info("gloo" if elastic or (self._hvd.gloo_enabled() and launched_with_gloo()) else "mpi")
        if cpu_binding == "auto" and not elastic and self.info.local_size > 1:
            self.info = replace(self.info, cpus=self._bind_cpus())
        # MPI that Horovod runs on (not Gloo: importing mpi4py there would start an MPI of its own)
        on_mpi = not elastic and self.info.controller != "gloo" and self._hvd.mpi_enabled()
        self.comm = self._direct_comm(comm) if on_mpi else None
        if direct and self.comm is None:  # Horovod idles at horovod.direct_cycle_ms: its path would crawl
            raise HvtrainError("MPI gave hvtrain no communicator of its own beside Horovod's (MPI_THREAD_MULTIPLE, "
                               "the same world), which horovod.reduction needs for `direct` (and `auto` on CPUs); "
                               "set horovod.reduction: hooks")
        return self.info

    def _direct_comm(self, shared: Any) -> Any:
        """A communicator of its own on the MPI that Horovod runs on, for hvtrain's synchronous
        collectives and the flat gradient reduction: MPI's own latency, without waiting for
        Horovod's next cycle and its background thread (measured, np=2 on 2 cores: a 4 KiB
        allreduce ~1 ms through Horovod, ~10 us direct; bench/allreduce.py). Only where MPI runs
        with MPI_THREAD_MULTIPLE (Horovod's background thread calls MPI at the same time, on its
        own communicator) and its world is Horovod's, rank for rank; else None (Horovod's path)."""
        from mpi4py import MPI

        if not MPI.Is_initialized() or MPI.Query_thread() != MPI.THREAD_MULTIPLE:
            return None
        world = shared if shared is not None else MPI.COMM_WORLD
        if (world.Get_rank(), world.Get_size()) != (self.info.rank, self.info.size):
            return None
        return world.Dup()

    def _bind_cpus(self) -> tuple[int, ...]:
        """Every thread of this process (Horovod's background thread included; threads started
        later inherit it) onto this rank's share of the host's CPUs, if it is ours to choose; once
        per process (a later session keeps the first one's). No collective: it runs before the
        backend configures its framework (a TF tensor made now would fix TF's thread pools before
        the backend sizes them)."""
        if "cpus" in _PROCESS:
            return _PROCESS["cpus"]
        cpus = () if "HOROVOD_THREAD_AFFINITY" in os.environ else \
            cpu_share(self.info.local_rank, self.info.local_size, affinity(), os.cpu_count() or 0, topology_key)
        for tid in os.listdir("/proc/self/task") if cpus else ():
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:  # the thread ended meanwhile
                pass
        _PROCESS["cpus"] = cpus
        return cpus

    def _read_info(self, controller: str) -> ProcessInfo:
        size = self._hvd.size()
        return ProcessInfo(self._hvd.rank(), size, self._hvd.local_rank(), self._hvd.local_size(),
                           controller if size > 1 else "none")

    def refresh(self) -> ProcessInfo:
        """Rank and size again, after an elastic reset (elastic runs use the Gloo controller)."""
        self.info = self._read_info("gloo")
        return self.info

    @property
    def initialized(self) -> bool:
        """Horovod runs in this process already (an earlier session of the Python API)."""
        return self._hvd.is_initialized()

    @property
    def direct(self) -> bool:
        """Collectives go straight to MPI (see _direct_comm), not through Horovod's cycle."""
        return self.comm is not None

    @property
    def distributed(self) -> bool:
        """Gradients go through Horovod: several ranks now, or an elastic world that may grow."""
        return self.info.size > 1 or self.elastic

    def abort(self, code: int) -> None:
        """End every rank now. MPI: MPI_Abort (the launcher kills the job). Gloo: exit this process
        without running exit handlers (a Horovod shutdown would wait for the other ranks)."""
        sys.stderr.flush()
        sys.stdout.flush()
        if self.info.controller == "mpi":
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(code)
        os._exit(code)

    # -- collectives ---------------------------------------------------------------------------
    def allreduce_sum(self, values: np.ndarray, name: str = "hvtrain.allreduce_sum") -> np.ndarray:
        """Sum a float64 vector over all ranks; every rank gets the result. On the direct
        communicator, a writable contiguous float64 `values` is summed in place and returned (the
        callers pass temporaries; on one rank it was always returned as it is): a copy into a new
        array cost 1.3-4x the allreduce itself at 1-16 MiB (bench/allreduce.py, 2026-12-07)."""
        values = np.ascontiguousarray(values, np.float64)
        if self.info.size == 1:
            return values
        if self.comm is not None:
            from mpi4py import MPI

            if values.flags.writeable:
                self.comm.Allreduce(MPI.IN_PLACE, values)
                return values
            out = np.empty_like(values)
            self.comm.Allreduce(values, out)
            return out
        out = self._hvd.allreduce(self._as_tensor(values), op=self._hvd.Sum, name=name)
        return np.asarray(out.numpy(), np.float64)

    def sum_(self, values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """`values` (C-contiguous) summed over all ranks into `out` (None: into `values`, which
        must be writable); returned. On the direct communicator: the direct reduction's own
        primitive (its callers check `direct`; Gloo and elastic runs reduce through Horovod)."""
        from mpi4py import MPI

        target = values if out is None else out
        self.comm.Allreduce(MPI.IN_PLACE if out is None else values, target)
        return target

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        if self.info.size == 1:
            return obj
        if self.comm is not None:
            return self.comm.bcast(obj, root=root)
        return self._hvd.broadcast_object(obj, root_rank=root, name="hvtrain.object")

    def allgather_object(self, obj: Any) -> list[Any]:
        if self.info.size == 1:
            return [obj]
        return self.comm.allgather(obj) if self.comm is not None else \
            self._hvd.allgather_object(obj, name="hvtrain.objects")

    def gather_bytes(self, blob: bytes, root: int = 0, process_set: Any = None) -> list[bytes] | None:
        """Every rank's bytes on `root` (in rank order), None elsewhere: the other ranks receive nothing.
        With a Horovod `process_set`: among its ranks, `root` and the order by rank within the set."""
        rank, size = (self.info.rank, self.info.size) if process_set is None else \
            (process_set.rank(), process_set.size())
        if size == 1:
            return [blob]
        if self.comm is not None and process_set is None:
            sizes = self.comm.gather(len(blob), root=root)
            got = np.empty(sum(sizes), np.uint8) if rank == root else None
            self.comm.Gatherv(np.frombuffer(blob, np.uint8), (got, sizes) if rank == root else None, root=root)
            if rank != root:
                return None
            bounds = np.concatenate([[0], np.cumsum(sizes)])
            return [got[bounds[r]: bounds[r + 1]].tobytes() for r in range(size)]
        splits = np.zeros(size, np.int32)
        splits[root] = len(blob)
        got, received = self._alltoall(np.frombuffer(blob, np.uint8), splits, "hvtrain.gather_bytes", process_set)
        if rank != root:
            return None
        bounds = np.concatenate([[0], np.cumsum(received)])
        return [got[bounds[r]: bounds[r + 1]].tobytes() for r in range(size)]

    def scatter_bytes(self, blobs: list[bytes] | None, root: int = 0) -> bytes:
        """`blobs[r]` (given on `root`) to rank r: each rank receives only its own part."""
        size = self.info.size
        if size == 1:
            return blobs[0]
        if self.comm is not None:
            root_side = self.info.rank == root
            sizes = self.comm.bcast([len(b) for b in blobs] if root_side else None, root=root)
            got = np.empty(sizes[self.info.rank], np.uint8)
            send = (np.frombuffer(b"".join(blobs), np.uint8), sizes) if root_side else None
            self.comm.Scatterv(send, got, root=root)
            return got.tobytes()
        splits = np.zeros(size, np.int32)
        if self.info.rank == root:
            splits[:] = [len(b) for b in blobs]
            send = np.frombuffer(b"".join(blobs), np.uint8)
        else:
            send = np.zeros(0, np.uint8)
        got, _ = self._alltoall(send, splits, "hvtrain.scatter_bytes")
        return got.tobytes()

    def _alltoall(self, data: np.ndarray, splits: np.ndarray, name: str, process_set: Any = None
                  ) -> tuple[np.ndarray, np.ndarray]:
        kwargs = {"process_set": process_set} if process_set is not None else {}
        out = self._hvd.alltoall(self._as_tensor(data), splits=self._as_tensor(splits), name=name, **kwargs)
        got, received = out if isinstance(out, (tuple, list)) else (out, None)
        got = np.asarray(got.numpy(), np.uint8)
        received = np.asarray(received.numpy(), np.int64) if received is not None else np.array([len(got)])
        return got, received

    def process_set(self, index: int) -> Any:
        """The Horovod process set of group `index` (as passed to init)."""
        return self.process_sets[index]

    # -- elastic -------------------------------------------------------------------------------
    def elastic_run(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`fn(state)` under hvd.elastic.run: re-run from the last commit after a reset.

        Horovod's TF wrapper recognises a failed collective only by op names in the message (not
        GroupedAllreduce, nor a bare gloo "connection closed") and otherwise returns None; the
        backend's collective error types are translated into HorovodInternalError here."""
        from horovod.common.exceptions import HorovodInternalError

        errors = self._collective_errors

        def guarded(state: Any) -> Any:
            try:
                return fn(state)
            except errors as exc:
                raise HorovodInternalError(exc) from exc

        return self._hvd.elastic.run(guarded if errors else fn)
