"""Sharded optimizer state (train.shard_optimizer, ZeRO stage 1) against the whole state on every
rank: a 50 M-parameter MLP with Adam at np=2 (torch), the two alternated. What sharding is for is
memory: each rank keeps half of Adam's 403 MB; the gradients are reduce-scattered and the parameters
allgathered instead of allreduced, so the step must not get slower.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from common import (
    CONFIGS,
    SIDE_COLUMNS,
    all_met,
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

CONFIG = CONFIGS / "zero_mlp.yaml"
BATCH, STEPS, EPOCHS = 16, 5, 3  # per rank; the first epoch is warm-up
QUICK_STEPS, QUICK_EPOCHS = 4, 2  # 128 samples: every one of the 10 classes (32 held 9)
MIB = 2 ** 20


def side(name: str, sharded: bool, tmp: Path, steps: int, epochs: int, quick: bool):
    sets = [f"data.samples={steps * BATCH * 2}", f"train.epochs={epochs}",
            f"train.shard_optimizer={'true' if sharded else 'false'}"]
    if quick:  # the smoke run: every side for real on a 1.2 M-parameter model
        sets += [f"model.layers.{i}.units=256" for i in range(3)]
    inner = hvtrain_side(name, 2, CONFIG, tmp, sets)

    def measure(rep: int) -> dict:
        r = inner.measure(rep)
        out = tmp / f"{name}-np2-{rep}".replace(" ", "_")
        r["state_bytes"] = json.loads((out / "summary.json").read_text())["optimizer_state_bytes"]["ranks"]
        return r

    return type(inner)(name, measure)


def run(quick: bool) -> dict:
    reps, log = repeats(quick), logger("zero")
    steps, epochs = (QUICK_STEPS, QUICK_EPOCHS) if quick else (STEPS, EPOCHS)
    with tempfile.TemporaryDirectory(prefix="bench-zero-") as tmp:
        runs = interleave([side("whole state", False, Path(tmp), steps, epochs, quick),
                           side("sharded", True, Path(tmp), steps, epochs, quick)], reps, log)
    whole, sharded = runs["whole state"], runs["sharded"]
    pairs = list(zip(whole, sharded, strict=True))  # each repetition's two runs, side by side
    state = [max(s["state_bytes"]) / max(w["state_bytes"]) for w, s in pairs]
    # peak RSS saved per rank (worst rank of each run), as a fraction of the whole state it could save
    saved = [(max(w["peak_rss_mb"]) - max(s["peak_rss_mb"])) * MIB / max(w["state_bytes"]) for w, s in pairs]
    speed = paired(sharded, whole, lambda s, w: s / w)
    checks = [
        check("optimizer-state bytes per rank, sharded ÷ whole <= 0.51 (halved; + the step counters)",
              state, lambda r: r <= 0.51, quick),
        check("peak RSS per rank, whole - sharded >= 0.4 x the whole optimizer state", saved, lambda r: r >= 0.4,
              quick),
        check("samples/s, sharded ÷ whole >= 0.9", speed, lambda r: r >= 0.9, quick),
    ]
    rows = side_rows([], runs, 2 * BATCH, reference="sharded")
    whole_mb = med([max(r["state_bytes"]) for r in whole]) / MIB
    return {
        "title": "Sharded optimizer state (ZeRO-1) vs the whole state, 50 M-parameter MLP, Adam, np=2 (torch)",
        "goal": "half the optimizer state per rank; peak RSS per rank lower by >= 40% of the whole state; "
                "throughput >= 0.9x",
        "columns": SIDE_COLUMNS, "rows": rows, "checks": checks, "met": all_met(checks),
        "notes": [
            f"Adam's whole state: {whole_mb:.0f} MiB per rank; sharded: "
            f"{med([max(r['state_bytes']) for r in sharded]) / MIB:.0f} MiB (summary.json optimizer_state_bytes). "
            f"Peak RSS saved per rank: {med(saved) * whole_mb:.0f} MiB ({med(saved):.2f} of the whole state).",
            f"bench/configs/zero_mlp.yaml (4096-4096-4096-4096-10), batch {BATCH} per rank, {steps} steps an epoch, "
            f"{epochs} epochs (the first not counted), one thread per rank, `hvtrain launch -np 2` (horovodrun); "
            "the sides differ only in train.shard_optimizer.",
            "Peak RSS is summary.json's: the high-water mark of the whole run, worst rank. Training's memory is "
            "freed before the end-of-run weight copies (before that, they set both sides' peak alike); the sharded "
            "step keeps at most two chunks' allgathered copies alive (all four at once cost 0.05 of the state).",
            load_note(runs),
        ],
        "raw": {"state_ratio": state, "rss_saved_fraction": saved, "speed_ratio": speed, "runs": runs},
    }
