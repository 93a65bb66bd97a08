"""The session of one process: the backend (math), the Horovod runtime and the failure path, the
native model's probe build, rank agreement, where ranks run (manifest, lost-host watchdog). Training
(hvtrain.training), evaluation and predict/export (hvtrain.tools) all run inside one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from hvtrain.config.schema import Config
from hvtrain.data.dataset import Dataset
from hvtrain.errors import HvtrainError
from hvtrain.launch.process import affinity, launched_with_gloo
from hvtrain.model.native import OutputForm
from hvtrain.model.spec import ModelSpec
from hvtrain.runtime.experiment import Prepared
from hvtrain.runtime.knobs import mpi_env


def build_native(cfg: Config, backend: Any, spec: ModelSpec | None, weights: dict[str, np.ndarray] | None,
                 data: Dataset, runtime: Any, form: OutputForm | None = None) -> None:
    """The backend's model for `data`: an entrypoint model is probed on the data's first training
    rows, one batch at most (hvtrain.model.native: what it reads and returns, checked before any
    optimizer step; `form`: the output form `weights` were trained with, reused; a config's model was
    checked from its spec in prepare), and the data then fed as it reads it (token ids: int64)."""
    from hvtrain.model.native import adopt_inputs, probe_batch

    backend.build(cfg, spec, weights, data.num_outputs, runtime,
                  probe_batch(data, cfg.data.batch_size) if spec is None else None, form)
    if spec is None:
        adopt_inputs(cfg, backend.native_inputs(), data)


class Session:
    """One process's run: the backend (math), the Horovod runtime, and the failure path.

    Entering initialises Horovod (sharing MPI with mpi4py for pipelines, with each stage's replicas
    as process sets), pins the local rank's GPU and seeds the framework. Any exception inside the
    block, on any rank, is reported by that rank (`rank r of N: ...`) and ends the whole job.
    """

    def __init__(self, cfg: Config, spec: ModelSpec | None, elastic: bool = False, pipelined: bool = True,
                 signals: Any = None) -> None:
        from hvtrain.backends.base import get_backend
        from hvtrain.runtime.horovod import Runtime

        self.cfg, self.elastic = cfg, elastic
        self.backend = get_backend(cfg.backend)
        self.runtime = Runtime(cfg.backend)
        if signals is not None:  # training's StopSignals: a notice during the imports ends this rank before MPI
            signals.check("Horovod's init")
        self.comm = self.plan = None
        groups = None
        if not _mpi_started(self.runtime):  # else too late: the manifest must not claim it
            os.environ.update(mpi_env(cfg.horovod))
        from hvtrain.backends.reduce import direct_reduction

        pipeline, on_mpi = pipelined and cfg.pipelined, not elastic and not launched_with_gloo()
        if pipeline or on_mpi and direct_reduction(cfg, self.backend.local_gpus() > 0):
            from mpi4py import MPI  # MPI up first, with threads: the runtime's direct communicator needs them

            self.comm = MPI.COMM_WORLD
        if pipeline:
            with _PreInit(self.comm.Get_rank(), self.comm.Get_size()):
                from hvtrain.pipeline.plan import make_plan

                self.plan = make_plan(cfg, spec, self.comm.Get_size(), {"gpu": self.backend.local_gpus()})
            groups = [self.plan.dp_group(s) for s in range(self.plan.num_stages)] if self.plan.replicas > 1 else None
        # Horovod idles when nothing of a step goes through it: the direct reduction, or a one-replica
        # pipeline (activations and gradients point to point on MPI; measured: bench/pipeline.py)
        direct = self.comm is not None and on_mpi and MPI.Query_thread() == MPI.THREAD_MULTIPLE \
            and (not pipeline or self.plan.replicas == 1 and not cfg.train.shard_optimizer)
        h = cfg.horovod
        if h.timeline or h.autotune:  # Horovod opens these files on rank 0 inside hvd.init
            from hvtrain.launch.process import launcher_rank
            from hvtrain.runtime.knobs import AUTOTUNE_LOG

            if launcher_rank() in (None, 0):
                for name in (h.timeline, h.autotune and (h.autotune_log or AUTOTUNE_LOG)):
                    if name:
                        (cfg.out_dir / name).parent.mkdir(parents=True, exist_ok=True)
        # GPU hosts: the CPU side is not the bottleneck, and a contiguous share may sit on the
        # other socket from the rank's GPU
        binding = "none" if self.backend.local_gpus() else cfg.train.cpu_binding
        self.info = self.runtime.init(h, elastic=elastic, comm=self.comm, groups=groups, out_dir=cfg.out_dir,
                                      cpu_binding=binding, direct=direct)
        if self.info.cpus and cfg.train.threads > len(self.info.cpus):
            from hvtrain.io.reporter import report_warning

            # measured (bench/levers.py): 2 threads on a rank's 1 bound core ran 5x slower
            report_warning(self.info, f"train.threads is {cfg.train.threads} but this rank bound itself to "
                           f"{len(self.info.cpus)} CPU(s) {list(self.info.cpus)}: its threads will wait on each "
                           "other; set train.threads: 0 (its CPUs) or train.cpu_binding: none")

    def __enter__(self) -> Session:
        with ending_cleanly(self.runtime):
            from hvtrain.launch.process import local_gpu

            # Pipelines place stages on the plan's devices (parallel.pipeline.devices); otherwise
            # each rank takes the GPU of its local rank, Horovod's convention.
            gpu = None if self.plan is not None else local_gpu(self.info.local_rank, self.info.local_size,
                                                                self.backend.local_gpus())
            self.backend.configure(self.cfg, self.info, gpu)
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        from hvtrain.errors import Preempted

        if exc is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit, Preempted)) \
                and self.runtime.info.size > 1:
            _end_job(self.runtime, exc)
        return False  # Horovod stays up for a later session of this process; it shuts down at exit


class _PreInit:
    """Failure handling before Horovod exists (pipeline planning): the rank says who it is and exits."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and self.size > 1 and isinstance(exc, HvtrainError):
            from mpi4py import MPI

            from hvtrain.io.reporter import report_failure
            from hvtrain.launch.process import ProcessInfo

            report_failure(ProcessInfo(self.rank, self.size), exc)
            MPI.COMM_WORLD.Abort(exc.exit_code)
        return False


@contextmanager
def ending_cleanly(runtime) -> Iterator[None]:
    """On several ranks, an error on one rank ends the whole job at once: the rank says who it
    is and why, then aborts MPI (mpirun/horovodrun kill the others) or exits (Gloo: horovodrun
    ends the others). The other ranks would otherwise wait in the next allreduce forever."""
    try:
        yield
    except BaseException as exc:
        if runtime.info.size == 1 or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        _end_job(runtime, exc)


def _end_job(runtime, exc: BaseException) -> None:
    from hvtrain.io.reporter import report_failure

    report_failure(runtime.info, exc)
    runtime.abort(exc.exit_code if isinstance(exc, HvtrainError) else 1)


def _mpi_started(runtime: Any) -> bool:
    """MPI already runs in this process (the Python API after the user's own hvd.init or mpi4py)."""
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    return runtime.initialized or bool(mpi and mpi.Is_initialized())


def where_ranks_run(runtime, listen: bool) -> tuple[list[Any], Any, list[list[int]]]:
    """Every rank's host and cores (for the manifest) and, with `listen`, each host's watchdog
    listener (its first rank opens one): one allgather. Returns the places in rank order, this
    rank's listener and every rank's cores (the affinity its main thread has now)."""
    import socket

    from hvtrain.runtime.watchdog import Listener, Place, local_addresses

    host = socket.gethostname()
    info = runtime.info
    listener = Listener() if listen and info.local_rank == 0 and info.local_size < info.size else None
    mine = (host, local_addresses(), listener.port) if listener else (host, (), 0)
    gathered = runtime.allgather_object((mine, list(affinity())))
    return [Place(*place) for place, _ in gathered], listener, [cpus for _, cpus in gathered]


def watch_hosts(runtime, places: list[Any], timeout_s: float) -> Any:
    """The lost-host watchdog (hvtrain.runtime.watchdog) of this rank, or None: one host, switched off, or
    not its host's first rank (one knocker per host: hosts x hosts knocks, not ranks x hosts)."""
    info = runtime.info
    if info.size == 1 or timeout_s <= 0 or info.local_rank != 0 or info.local_size == info.size:
        return None
    import socket

    from hvtrain.io.reporter import report_failure, report_warning
    from hvtrain.runtime.watchdog import LAUNCHER_GRACE_S, HostLost, Watchdog

    def report(message: str, failure: bool) -> None:
        if failure:
            report_failure(info, HostLost(message))
        else:
            report_warning(info, message)

    # Under MPI an abort before mpirun notices the loss (its OOB keepalive, which hvtrain launch
    # turns on) makes mpirun wait on its daemon there for good (measured): give it time first.
    grace = LAUNCHER_GRACE_S if info.controller == "mpi" else 0.0
    return Watchdog(places, socket.gethostname(), timeout_s, report, lambda: runtime.abort(HostLost.exit_code),
                    grace_s=grace).start()


def write_manifest(cfg: Config, runtime, reporter, hosts: list[str], cpus: list[list[int]]) -> None:
    """manifest.json (rank 0): versions, launcher, hosts and cores (every rank's, in rank order; an
    elastic run lists rank 0's only: the world changes anyway, metrics.jsonl has world_size per
    epoch), knobs, config hash, git."""
    from hvtrain.runtime.manifest import build

    if runtime.info.is_main:
        reporter.write_json("manifest.json", build(cfg, hosts, runtime.info.size, cpus))


def check_agreement(p: Prepared, runtime) -> None:
    """Cheap start-up check that every rank runs the same experiment on the same data: rank 0's
    fingerprints are broadcast and each rank compares its own (a rank that differs names itself)."""
    mine = fingerprints(p)
    theirs = runtime.broadcast_object(mine)
    differ = [k for k in mine if mine[k] != theirs[k]]
    agreed = runtime.allgather_object(differ)
    bad = {r: d for r, d in enumerate(agreed) if d}
    if bad:
        detail = "; ".join(f"rank {r}: {', '.join(d)}" for r, d in bad.items())
        raise HvtrainError(f"ranks disagree with rank 0 ({detail}): every rank must run the same config on the "
                           "same data and model")


def fingerprints(p: Prepared) -> dict[str, str]:
    cfg = dict(p.cfg.to_dict())
    cfg.pop("output_dir", None)

    model = [(w.name, w.shape) for w in p.spec.weight_specs()] if p.spec else [p.cfg.model.entrypoint]
    return {"config": hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16],
            "data": p.data.fingerprint(),
            "model": hashlib.sha256(repr(model).encode()).hexdigest()[:16]}


@contextmanager
def loaded_model(cfg: Config, spec: ModelSpec | None, weights: dict[str, np.ndarray],
                 num_outputs: int, data: Dataset | np.ndarray | None = None,
                 form: OutputForm | None = None) -> Iterator[Session]:
    """A session (Horovod up, failure path armed) whose backend holds `weights` (checked by the caller).
    An entrypoint model is probed on `data` (hvtrain.model.native): a Dataset (then fed as the model reads
    it), or a batch of model inputs (predict's first rows, in the weights' input dtype); `form` is the
    output form the weights' inputs record holds (reused, not decided again on them)."""
    with Session(cfg, spec, pipelined=False) as s:
        if isinstance(data, Dataset):
            build_native(cfg, s.backend, spec, weights, data, s.runtime, form)
        else:
            s.backend.build(cfg, spec, weights, num_outputs, s.runtime, data if spec is None else None, form)
        yield s
