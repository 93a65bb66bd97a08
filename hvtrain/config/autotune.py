"""horovod.autotune_from: the best knobs in a previous run's Horovod autotune log (read when the
config is validated, and again when they are exported)."""

from __future__ import annotations

from pathlib import Path

AUTOTUNE_COLUMNS = ("hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce", "cache_enabled",
                    "cycle_time_ms", "tensor_fusion_threshold", "score")


def best_autotuned(path: str) -> dict[str, float]:
    """The best-scoring sample of a Horovod autotune log (HOROVOD_AUTOTUNE_LOG, 0.28 format): its
    cycle time (ms), fusion threshold (MB), response cache and hierarchical flags.

    Raises:
        ValueError: no such file, or not an autotune log (the message says which line).
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read autotune log {path}: {exc.strerror or exc}") from None
    if not lines or tuple(c.strip() for c in lines[0].split(",")) != AUTOTUNE_COLUMNS:
        raise ValueError(f"{path}:1: not a Horovod autotune log (expected the header {','.join(AUTOTUNE_COLUMNS)})")
    best = None
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            row = dict(zip(AUTOTUNE_COLUMNS, (float(v) for v in line.split(",")), strict=True))
        except ValueError:
            raise ValueError(f"{path}:{number}: expected {len(AUTOTUNE_COLUMNS)} numbers, got {line!r}") from None
        if best is None or row["score"] > best["score"]:
            best = row
    if best is None:
        raise ValueError(f"{path}: the autotune log has no samples yet (autotune ran too briefly)")
    return {"cycle_time_ms": best["cycle_time_ms"], "fusion_threshold_mb": best["tensor_fusion_threshold"],
            "cache_enabled": best["cache_enabled"], "hierarchical_allreduce": best["hierarchical_allreduce"],
            "hierarchical_allgather": best["hierarchical_allgather"], "score": best["score"]}
