"""Allreduce: hvtrain's gradient path and its synchronous collectives against raw MPI (mpi4py
Allreduce) for 4 KiB..64 MiB, and a model of many small tensors, the case tensor fusion exists for;
Horovod's own path (horovod.reduction: hooks) beside them.

Each side is its own 2-rank job (bench/peers/allreduce_job.py under horovodrun as `hvtrain launch`
runs it, hvtrain.launch.horovodrun), the jobs alternating: hvtrain's jobs bring hvtrain's MPI
settings and CPU binding, raw MPI keeps MPI's defaults, so neither inherits the other's. Bus
bandwidth = 2(n-1)/n x bytes / seconds per allreduce (nccl-tests' definition; n=2: bytes / time).
"""

from __future__ import annotations

import os

import numpy as np
from common import PEERS, PY, all_met, bench_env, check, load_note, logger, med, peer_records, repeats
from common import run as run_command

from hvtrain.launch.horovodrun import MODULE as HOROVODRUN

NP = 2
MIB = 1 << 20
FULL_SIZES = [4096, 65536, MIB, 4 * MIB, 16 * MIB, 64 * MIB]
QUICK_SIZES = [4096, MIB]


def job(side: str, seconds: float, sizes: list[int], env: dict[str, str] | None = None) -> dict:
    argv = [PY, "-m", HOROVODRUN, "-np", str(NP), "-H", f"localhost:{NP}", PY, PEERS / "allreduce_job.py", side,
            str(seconds), ",".join(map(str, sizes))]
    load = round(os.getloadavg()[0], 2)
    records = peer_records(run_command(argv, 900, env or bench_env()), NP)
    return {**records[0], "peak_rss_mb": [r["peak_rss_mb"] for r in records], "load_1min_before": load}


def human(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // 1024} KiB"


def sig(x: float) -> str:
    """Three significant digits, never in exponent form (0.000123, 1.23, 123)."""
    return np.format_float_positional(x, precision=3, unique=False, fractional=False, trim="-")


def busbw(size: int, seconds: float) -> float:
    """GB/s on the bus: 2(n-1)/n x bytes / time."""
    return 2 * (NP - 1) / NP * size / seconds / 1e9


def run(quick: bool) -> dict:
    reps, log = repeats(quick), logger("allreduce")
    sizes, seconds = (QUICK_SIZES, 0.05) if quick else (FULL_SIZES, 0.25)
    jobs: dict[str, list[dict]] = {"hvtrain": [], "mpi": [], "horovod": []}
    for rep in range(reps):  # alternating jobs: each with its own start and process placement
        for side in jobs:
            jobs[side].append(job(side, seconds, sizes))
        log(f"rep {rep + 1}/{reps} done")

    def per(side: str, size: int, key: str = "seconds_per_allreduce") -> list[float]:
        return [j[key][str(size)] for j in jobs[side]]

    rows, checks = [], []
    for size in sizes:
        hv, sync, mpi, hvd = per("hvtrain", size), per("hvtrain", size, "seconds_per_sync_collective"), \
            per("mpi", size), per("horovod", size)
        ratio = [m / h for h, m in zip(hv, mpi, strict=True)]  # bandwidth ratio = time ratio inverted
        sync_ratio = [m / h for h, m in zip(sync, mpi, strict=True)]
        hvd_ratio = [m / h for h, m in zip(hvd, mpi, strict=True)]
        rows.append([human(size), sig(busbw(size, med(hv))), sig(busbw(size, med(mpi))),
                     f"{med(ratio):.2f}", f"{min(ratio):.2f}-{max(ratio):.2f}", f"{med(sync_ratio):.2f}",
                     f"{min(sync_ratio):.2f}-{max(sync_ratio):.2f}", f"{med(hvd_ratio):.2f}",
                     sig(med(hv) * 1e3), sig(med(sync) * 1e3), sig(med(mpi) * 1e3), sig(med(hvd) * 1e3)])
        if size >= MIB:
            checks.append(check(f"{human(size)}: hvtrain's gradient path bus bandwidth ÷ raw MPI's >= 0.9", ratio,
                                lambda r: r >= 0.9, quick))
            checks.append(check(f"{human(size)}: hvtrain's synchronous collective ÷ raw MPI's >= 0.9", sync_ratio,
                                lambda r: r >= 0.9, quick))
        if size == 4096:
            checks.append(check("4 KiB: hvtrain's synchronous collective latency ÷ raw MPI's <= 2",
                                [h / m for h, m in zip(sync, mpi, strict=True)], lambda r: r <= 2, quick))
    small = {"hvtrain (packed)": [j["seconds_per_small_set"]["per_tensor"] * 1e3 for j in jobs["hvtrain"]],
             "Horovod (fused)": [j["seconds_per_small_set"]["per_tensor"] * 1e3 for j in jobs["horovod"]],
             "MPI per tensor": [j["seconds_per_small_set"]["per_tensor"] * 1e3 for j in jobs["mpi"]],
             "MPI one buffer": [j["seconds_per_small_set"]["one_buffer"] * 1e3 for j in jobs["mpi"]]}
    small_text = "; ".join(f"{name} {med(ms):.3f} ms ({min(ms):.3f}-{max(ms):.3f})" for name, ms in small.items())
    knobs = jobs["hvtrain"][0]["knobs"]
    rss = {side: " / ".join(f"{r:.0f}" for r in js[0]["peak_rss_mb"]) for side, js in jobs.items()}
    return {
        "title": "Allreduce: hvtrain's gradient path and synchronous collectives vs raw MPI",
        "goal": "bus bandwidth >= 0.9x raw MPI (mpi4py Allreduce) at >= 1 MiB, gradients and synchronous "
                "collectives; a synchronous collective's 4 KiB latency <= 2x raw MPI's",
        "columns": ["size", "hvtrain gradients GB/s", "MPI GB/s", "gradients ÷ MPI", "spread",
                    "sync collective ÷ MPI", "spread", "Horovod path ÷ MPI", "hvtrain gradients ms",
                    "hvtrain sync collective ms", "MPI ms", "Horovod path ms"],
        "rows": rows, "checks": checks, "met": all_met(checks),
        "notes": [
            "2 ranks on this host (shared memory), one job per side, the jobs alternating. hvtrain: MPI and Horovod "
            "started as an hvtrain session on CPUs does (mpi4py first with MPI_THREAD_MULTIPLE, Horovod's cycle idle "
            f"at horovod.direct_cycle_ms; {', '.join(f'{k}={v}' for k, v in knobs.items())}; ranks bound to cores "
            f"{jobs['hvtrain'][0]['cpus'] or '(not bound)'} on rank 0). 'gradients': "
            "hvtrain.backends.reduce.sum_arrays on a float32 buffer (the backends' direct reduction, in place on "
            "hvtrain's own communicator); 'sync collective': Runtime.allreduce_sum of the same bytes as float64 "
            "(metrics, agreement checks). Horovod path: hvd.allreduce_async_(op=Average) + hvd.synchronize under "
            "Horovod's 1 ms cycle, what horovod.reduction: hooks (hvtrain's default on GPUs) does. Raw MPI: mpi4py "
            "Allreduce(IN_PLACE, SUM) on a numpy float32 buffer, MPI's own defaults.",
            f"Each figure: seconds per allreduce, the median of 5 timed loops (~{seconds} s in all, after two "
            "warm-up calls), each the slowest rank's; ms columns and ratios are medians over repetitions.",
            f"Many small tensors ({jobs['hvtrain'][0]['small_bytes'] // 1024} KiB in 200 float32 tensors of "
            f"1-10 KiB), ms per set of 200 (median, spread): {small_text}. hvtrain packs arrays under 64 KiB into "
            "one buffer (one call); 'MPI one buffer' is that ideal without the packing copies.",
            "Horovod's path waits for its background cycle: a synchronous allreduce takes one or two cycle times "
            "at any size up to a few MiB (Horovod 0.28 does not wake its thread when a tensor is enqueued). "
            "hvtrain's direct path does not go through it; a Horovod cycle woken on enqueue (a patch to the "
            "build) was not tried: the direct path already meets MPI's figures, and Horovod's idle cycles cost "
            "the compute (bench/small_models.py, docs/parallelism.md).",
            "peak RSS MiB per rank: " + "; ".join(f"{side} job {text}" for side, text in rss.items()) + ".",
            load_note(jobs),
        ],
        "raw": {"sizes": sizes, "jobs": jobs, "small_set_ms": small},
    }
