"""The environment Horovod and OpenMPI read, from the config's `horovod` section: cycle time,
fusion, cache, timeline, autotune (or a previous autotune log's best), MPI's yield when idle.
A HOROVOD_* variable the user set wins.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hvtrain.config.autotune import best_autotuned


def mpi_env(h: Any) -> dict[str, str]:
    """MPI settings from the config's `horovod` section, for the environment before MPI starts
    (mpi4py or hvd.init); a variable the user set wins. `mpi_yield`: OpenMPI's progress loop
    yields the core while it waits (measured here: np=2 on 2 cores, 1.4x the spinning default)."""
    wanted = {"OMPI_MCA_mpi_yield_when_idle": "1"} if h.mpi_yield else {}
    return {k: v for k, v in wanted.items() if k not in os.environ}


AUTOTUNE_LOG = "autotune.csv"  # in output_dir, when horovod.autotune_log is not given


def horovod_env(h: Any, elastic: bool = False, out_dir: Path | None = None, direct: bool = False) -> dict[str, str]:
    """Horovod knobs from the config's `horovod` section; a HOROVOD_* variable already set by the
    user wins. Relative paths (timeline, autotune log) are in `out_dir`.

    With `direct` (hvtrain's direct reduction carries the gradients, hvtrain.runtime.session), the
    cycle time is `direct_cycle_ms`: Horovod only broadcasts at start-up, and idles.

    With `autotune`, the cycle time and fusion threshold are left to Horovod's search: Horovod
    takes a HOROVOD_CYCLE_TIME / HOROVOD_FUSION_THRESHOLD it finds as fixed (operations.cc,
    SetCycleTimeMs(..., fixed=true)) and tunes only the rest.

    With `elastic` (the run handles resets) the fusion threshold is left to Horovod: measured
    with 0.28.1, a survivor segfaults in hvd.init() on the reset after a peer dies when
    HOROVOD_FUSION_THRESHOLD is set explicitly (HOROVOD_CYCLE_TIME alone is fine)."""
    out = Path(out_dir or ".")
    tuned = best_autotuned(h.autotune_from) if h.autotune_from else {}
    cycle = h.direct_cycle_ms if direct else tuned.get("cycle_time_ms", h.cycle_time_ms)
    wanted = {"HOROVOD_CYCLE_TIME": f"{cycle:g}"}
    if h.autotune:  # Horovod fixes (leaves out of its search) a knob whose variable is set: search both
        wanted = {}
    elif not elastic:
        fusion_mb = tuned.get("fusion_threshold_mb", h.fusion_threshold_mb)
        wanted["HOROVOD_FUSION_THRESHOLD"] = str(int(fusion_mb * 1024 * 1024))
    if tuned:
        if not tuned["cache_enabled"]:
            wanted["HOROVOD_CACHE_CAPACITY"] = "0"
        wanted["HOROVOD_HIERARCHICAL_ALLREDUCE"] = str(int(tuned["hierarchical_allreduce"]))
        wanted["HOROVOD_HIERARCHICAL_ALLGATHER"] = str(int(tuned["hierarchical_allgather"]))
    if h.cache_capacity is not None:
        wanted["HOROVOD_CACHE_CAPACITY"] = str(h.cache_capacity)
    if h.autotune:
        wanted["HOROVOD_AUTOTUNE"] = "1"
        wanted["HOROVOD_AUTOTUNE_LOG"] = str(out / (h.autotune_log or AUTOTUNE_LOG))
    if h.timeline:
        wanted["HOROVOD_TIMELINE"] = str(out / h.timeline)
    return {k: v for k, v in wanted.items() if k not in os.environ}
