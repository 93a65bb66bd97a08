"""Pipeline schedules: the order of forward (F) and backward (B) micro-batch ops on one stage.

GPipe: all M forwards, then all M backwards -> up to M micro-batches of activations alive.
1F1B (PipeDream-flush): stage s runs min(S-s-1, M) warm-up forwards, then alternates one
forward / one backward, then drains -> at most S-s <= S micro-batches alive.
"""

from __future__ import annotations

from typing import Literal

Op = tuple[Literal["F", "B"], int]


def stage_ops(schedule: str, stages: int, stage: int, micro: int) -> list[Op]:
    if schedule == "gpipe":
        return [("F", m) for m in range(micro)] + [("B", m) for m in reversed(range(micro))]
    if schedule == "1f1b":
        warmup = min(stages - stage - 1, micro)
        ops: list[Op] = [("F", m) for m in range(warmup)]
        f, b = warmup, 0
        while f < micro:
            ops.append(("F", f))
            f += 1
            ops.append(("B", b))
            b += 1
        ops += [("B", m) for m in range(b, micro)]
        return ops
    raise ValueError(f"unknown schedule {schedule!r}")


def peak_in_flight(ops: list[Op]) -> int:
    """Most micro-batches forwarded but not yet backwarded at any point."""
    live = peak = 0
    for kind, _ in ops:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def bubble_fraction(stages: int, micro: int) -> float:
    """Idle fraction of an ideal pipeline step: (S-1)/(M+S-1), the same for GPipe and 1F1B."""
    return (stages - 1) / (micro + stages - 1)
