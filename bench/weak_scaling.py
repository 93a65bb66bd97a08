"""Weak scaling np=1 -> 2 of hvtrain on a compute-bound model, one thread per rank: the per-rank
workload stays the same, so ideal np=2 samples/s is twice np=1's. Measured side by side with the
two-independent-ranks ceiling (two one-rank runs at once, summed), which shows what this machine
gives two busy processes with no communication at all (shared caches, memory bandwidth, clocks).

Model (bench/configs/weak_cnn.yaml): conv 3x3 64 - pool - conv 3x3 128 - pool - dense 10 on
32x32x1, batch 32 per rank: ~4 GFLOP of compute against 0.6 MB of gradients a step.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from common import (
    CONFIGS,
    SIDE_COLUMNS,
    all_met,
    ceiling_side,
    ceiling_warnings,
    check,
    hvtrain_side,
    interleave,
    load_note,
    logger,
    med,
    paired,
    repeats,
    side_rows,
)

CONFIG = CONFIGS / "weak_cnn.yaml"
FULL = (32, 10, 5)  # per-rank batch, steps per epoch per rank, epochs (the first is warm-up)
QUICK = (32, 2, 2)


def run(quick: bool) -> dict:
    reps, log = repeats(quick), logger("weak_scaling")
    batch, steps, epochs = QUICK if quick else FULL
    per_rank = [f"data.samples={steps * batch}", f"train.epochs={epochs}", "train.threads=1"]
    both = [f"data.samples={steps * batch * 2}", f"train.epochs={epochs}", "train.threads=1"]
    with tempfile.TemporaryDirectory(prefix="bench-weak-") as tmp:
        sides = [hvtrain_side("hvtrain np=1", 1, CONFIG, Path(tmp), per_rank),
                 hvtrain_side("hvtrain np=2", 2, CONFIG, Path(tmp), both),
                 ceiling_side(CONFIG, Path(tmp), per_rank)]
        runs = interleave(sides, reps, log)
    one, two, ceiling = runs["hvtrain np=1"], runs["hvtrain np=2"], runs["ceiling"]
    efficiency = paired(two, one, lambda t, o: t / 2 / o)
    checks = [check("np=2 samples/s ÷ the two-independent-ranks ceiling >= 0.8",
                    paired(two, ceiling, lambda t, c: t / c), lambda r: r >= 0.8, quick)]
    machine = paired(ceiling, one, lambda c, o: c / 2 / o)
    rows = side_rows([], runs, {"hvtrain np=1": batch, "hvtrain np=2": 2 * batch, "ceiling": 2 * batch},
                     ceiling="ceiling", reference="hvtrain np=2")
    rows[0][4:6] = ["", ""]  # np=1 against np=2 sides: see the efficiency note instead
    return {
        "title": "Weak scaling np=1 -> 2 (compute-bound CNN, one thread per rank)",
        "goal": "np=2 samples/s >= 0.8x the two-independent-ranks ceiling",
        "columns": SIDE_COLUMNS, "rows": rows, "checks": checks, "met": all_met(checks),
        "notes": [
            f"Weak-scaling efficiency (np=2 samples/s per rank ÷ np=1 samples/s): {med(efficiency):.2f} "
            f"({min(efficiency):.2f}-{max(efficiency):.2f}); the machine's own (ceiling per process ÷ np=1 alone): "
            f"{med(machine):.2f} ({min(machine):.2f}-{max(machine):.2f}). The difference is what communication and "
            "Horovod cost; the machine's own shortfall is shared hardware.",
            f"bench/configs/weak_cnn.yaml, batch {batch} per rank, {steps} steps per epoch per rank, {epochs} epochs "
            "(the first not counted), SGD momentum 0.9, fp32. np=1: `hvtrain train`; np=2: `hvtrain launch -np 2 "
            "--hostfile hostfiles/localhost` (horovodrun).",
            load_note(runs), *ceiling_warnings(runs),
        ],
        "raw": {"workload": {"per_rank_batch": batch, "steps_per_epoch_per_rank": steps, "epochs": epochs},
                "efficiency": efficiency, "machine_efficiency": machine, "runs": runs},
    }
