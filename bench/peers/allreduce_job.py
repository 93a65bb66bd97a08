"""One allreduce benchmark job (bench/allreduce.py starts it under horovodrun -np 2), one side:

hvtrain: MPI and Horovod started as an hvtrain session on CPUs starts them (mpi4py first, the
    direct reduction's idle Horovod cycle, hvtrain's MPI environment and CPU binding), gradients
    reduced as the backends do (hvtrain.backends.reduce.sum_arrays: in place, small ones packed),
    and hvtrain's synchronous collective (Runtime.allreduce_sum, float64: metrics, agreement) timed
    at each size too.
horovod: Horovod's path, what the torch backend's DistributedOptimizer does (horovod.reduction:
    hooks, hvtrain's default on GPUs): `hvd.allreduce_async_(grad, name, op=hvd.Average)` for every
    tensor, then `hvd.synchronize` of each handle, Horovod's 1 ms cycle.
mpi: raw MPI as a user gets it under the same launcher: mpi4py `Comm.Allreduce(IN_PLACE, buffer,
    SUM)` on numpy float32 buffers, MPI's own defaults, no Horovod, no hvtrain.

    python bench/peers/allreduce_job.py hvtrain|horovod|mpi SECONDS SIZE_BYTES[,SIZE...]
Prints one line per rank (bench.common.MARK + JSON): seconds per allreduce of each size, and
seconds per set of the many-small-tensors model (200 tensors of 1-10 KiB; the mpi side also
times them as one concatenated buffer, the fused ideal).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import CONFIGS, emit  # noqa: E402

SIDE = sys.argv[1]
KNOBS = ("HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CACHE_CAPACITY", "OMPI_MCA_mpi_yield_when_idle")
SMALL_TENSORS = 200  # 1-10 KiB each: the case tensor fusion exists for
if SIDE in ("hvtrain", "horovod"):
    from hvtrain.config.load import load_config
    from hvtrain.runtime.knobs import mpi_env

    CFG = load_config(CONFIGS / "mlp.yaml")
    os.environ.update(mpi_env(CFG.horovod))  # before MPI starts, as hvtrain.runtime.session does
from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD


def timed(fn, seconds: float, chunks: int = 5) -> float:
    """Seconds per call: warm up (negotiation, response cache), calibrate, then `chunks` timed
    loops, each started together on every rank and worth the slowest rank's time; the median
    chunk, so that one burst of other load on the machine does not decide the figure."""
    fn()
    fn()
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    one = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    iters = int(min(200, max(1, seconds / chunks / max(one, 1e-6))))
    per_call = []
    for _ in range(chunks):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        per_call.append(comm.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX))
    return statistics.median(per_call)


def runtime():
    import torch

    from hvtrain.runtime.horovod import Runtime

    rt = Runtime("torch")
    rt.init(CFG.horovod, elastic=False, cpu_binding=CFG.train.cpu_binding, direct=SIDE == "hvtrain")
    torch.set_num_threads(1)
    assert rt.direct, "no direct communicator: MPI without MPI_THREAD_MULTIPLE?"
    return rt


def hvtrain_reducer(rt):
    """arrays -> a call that reduces them as hvtrain's direct gradient path does."""
    from hvtrain.backends.reduce import sum_arrays

    def make(arrays: list[np.ndarray], prefix: str):
        buffers = [a.copy() for a in arrays]
        return lambda: sum_arrays(rt, buffers)

    return make


def sync_reducer(rt):
    """hvtrain's synchronous collective (metrics, agreement): Runtime.allreduce_sum, float64, on a
    temporary as hvtrain's callers pass (summed in place)."""
    def make(arrays: list[np.ndarray], prefix: str):
        values = np.concatenate(arrays).astype(np.float64)[: max(1, sum(a.nbytes for a in arrays) // 8)]
        return lambda: rt.allreduce_sum(values, name=prefix)

    return make


def horovod_reducer(rt):
    """arrays -> a call that reduces them as Horovod's DistributedOptimizer does."""
    import horovod.torch as hvd
    import torch

    def make(arrays: list[np.ndarray], prefix: str):
        tensors = [torch.from_numpy(a.copy()) for a in arrays]

        def once() -> None:
            handles = [hvd.allreduce_async_(t, name=f"{prefix}.{i}", op=hvd.Average) for i, t in enumerate(tensors)]
            for h in handles:
                hvd.synchronize(h)
        return once

    return make


def mpi_reducer(arrays: list[np.ndarray], prefix: str):
    buffers = [a.copy() for a in arrays]

    def once() -> None:
        for b in buffers:
            comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM)
    return once


def main() -> None:
    seconds = float(sys.argv[2])
    sizes = [int(s) for s in sys.argv[3].split(",") if s]
    rt = runtime() if SIDE != "mpi" else None
    make = {"hvtrain": hvtrain_reducer, "horovod": horovod_reducer}[SIDE](rt) if rt else mpi_reducer
    rng = np.random.default_rng(0)
    small = [rng.standard_normal(int(rng.integers(256, 2561)), dtype=np.float32) for _ in range(SMALL_TENSORS)]
    buffers = {size: [rng.standard_normal(size // 4, dtype=np.float32)] for size in sizes}
    by_size = {str(size): timed(make(buffers[size], f"size{size}"), seconds) for size in sizes}
    sync = {str(size): timed(sync_reducer(rt)(buffers[size], f"sync{size}"), seconds) for size in sizes} \
        if SIDE == "hvtrain" else {}
    small_sets = {"per_tensor": timed(make(small, "small"), seconds)}
    if SIDE == "mpi":
        small_sets["one_buffer"] = timed(make([np.concatenate(small)], "small_fused"), seconds)
    emit(comm.Get_rank(), side=SIDE, size=comm.Get_size(), seconds_per_allreduce=by_size,
         seconds_per_sync_collective=sync, seconds_per_small_set=small_sets,
         small_bytes=int(sum(a.nbytes for a in small)),
         knobs={k: os.environ[k] for k in KNOBS if k in os.environ},
         cpus=list(rt.info.cpus) if rt else [])


if __name__ == "__main__":
    main()
