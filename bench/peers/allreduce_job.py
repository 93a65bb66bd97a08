"""One allreduce benchmark job (bench/allreduce.py starts it under horovodrun -np 2), one side:

hvtrain: MPI and Horovod started as an hvtrain session starts them, with the settings of
    hvtrain's config defaults (MPI environment, Horovod knobs, CPU binding), and each gradient
    reduced as the torch backend's DistributedOptimizer does it: `hvd.allreduce_async_(grad, name,
    op=hvd.Average)` for every tensor, then `hvd.synchronize` of each handle.
mpi: raw MPI as a user gets it under the same launcher: mpi4py `Comm.Allreduce(IN_PLACE, buffer,
    SUM)` on numpy float32 buffers, MPI's own defaults, no Horovod, no hvtrain.

    python bench/peers/allreduce_job.py hvtrain|mpi SECONDS SIZE_BYTES[,SIZE...]
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
KNOBS = ("HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CACHE_CAPACITY", "OMPI_MCA_mpi_yield_when_idle",
         "BENCH_ALLREDUCE_OP")
SMALL_TENSORS = 200  # 1-10 KiB each: the case tensor fusion exists for
if SIDE == "hvtrain":
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


def hvtrain_reducer():
    """arrays -> a call that reduces them all the way hvtrain's torch gradient path does."""
    import torch

    from hvtrain.runtime.horovod import Runtime

    runtime = Runtime("torch")
    info = runtime.init(CFG.horovod, elastic=False, cpu_binding=CFG.train.cpu_binding)
    torch.set_num_threads(1)
    import horovod.torch as hvd  # the peer job: Horovod itself, under hvtrain's runtime settings
    # BENCH_ALLREDUCE_OP=sum (a diagnostic): without Average's pass that scales the result by 1/size
    op = hvd.Sum if os.environ.get("BENCH_ALLREDUCE_OP") == "sum" else hvd.Average

    def make(arrays: list[np.ndarray], prefix: str):
        tensors = [torch.from_numpy(a.copy()) for a in arrays]

        def once() -> None:
            handles = [hvd.allreduce_async_(t, name=f"{prefix}.{i}", op=op) for i, t in enumerate(tensors)]
            for h in handles:
                hvd.synchronize(h)
        return once

    return make, list(info.cpus)


def mpi_reducer(arrays: list[np.ndarray], prefix: str):
    buffers = [a.copy() for a in arrays]

    def once() -> None:
        for b in buffers:
            comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM)
    return once


def main() -> None:
    seconds = float(sys.argv[2])
    sizes = [int(s) for s in sys.argv[3].split(",") if s]
    make, cpus = hvtrain_reducer() if SIDE == "hvtrain" else (mpi_reducer, [])
    rng = np.random.default_rng(0)
    small = [rng.standard_normal(int(rng.integers(256, 2561)), dtype=np.float32) for _ in range(SMALL_TENSORS)]
    by_size = {str(size): timed(make([rng.standard_normal(size // 4, dtype=np.float32)], f"size{size}"), seconds)
               for size in sizes}
    small_sets = {"per_tensor": timed(make(small, "small"), seconds)}
    if SIDE == "mpi":
        small_sets["one_buffer"] = timed(make([np.concatenate(small)], "small_fused"), seconds)
    emit(comm.Get_rank(), side=SIDE, size=comm.Get_size(), seconds_per_allreduce=by_size,
         seconds_per_small_set=small_sets, small_bytes=int(sum(a.nbytes for a in small)),
         knobs={k: os.environ[k] for k in KNOBS if k in os.environ}, cpus=cpus)


if __name__ == "__main__":
    main()
