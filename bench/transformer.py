"""The transformer example (examples/digits_transformer.yaml) trained by hvtrain against the same
model written natively in each framework (bench/native_transformer.py: nn.MultiheadAttention /
keras.layers.MultiHeadAttention, a plain loop), one process, same data, batch, optimizer, threads.
For reference (no goal): what hvtrain's neutral layer catalogue costs over hand-written layers."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from common import (
    BENCH,
    PY,
    SIDE_COLUMNS,
    Side,
    hvtrain_argv,
    hvtrain_result,
    interleave,
    load_note,
    logger,
    side_rows,
    steady,
)
from common import run as run_command

CONFIG = "examples/digits_transformer.yaml"


def hvtrain_side(framework: str, epochs: int, threads: int, tmp: Path) -> Side:
    def measure(rep: int) -> dict:
        out = tmp / f"tr-{framework}-{rep}"
        sets = [f"train.epochs={epochs}", f"train.threads={threads}"]
        run_command(hvtrain_argv(1, CONFIG, out, sets, framework), 900)
        r = hvtrain_result(out)
        return {"rate": steady(r["epoch_rates"]), **r}

    return Side("hvtrain", measure)


def native_side(framework: str, epochs: int, threads: int) -> Side:
    def measure(rep: int) -> dict:
        proc = run_command([PY, BENCH / "native_transformer.py", framework, str(epochs), str(threads)], 900)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        return {"rate": steady(r["samples_per_sec"]), "epoch_rates": r["samples_per_sec"],
                "peak_rss_mb": [r["peak_rss_mb"]]}

    return Side("native", measure)


def run(quick: bool) -> dict:
    reps, log = 1, logger("transformer")  # no goal: one repetition keeps make bench within its time
    epochs = 2 if quick else 4
    # every core, as a one-process user gets; quick (CI, maybe a loaded machine): one thread, so that
    # intra-op threads never wait on a descheduled sibling
    threads = 1 if quick else len(os.sched_getaffinity(0))
    rows, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-tr-") as tmp:
        for framework in ("torch", "tensorflow"):
            sides = [hvtrain_side(framework, epochs, threads, Path(tmp)), native_side(framework, epochs, threads)]
            runs = interleave(sides, reps, log)
            raw[framework] = runs
            rows += side_rows([framework], runs, 32)
    return {
        "title": "Transformer example: hvtrain vs the same model written natively (1 process)", "repeats": reps,
        "goal": None, "columns": ["framework", *SIDE_COLUMNS], "rows": rows, "met": None,
        "notes": [f"{CONFIG}, {epochs} epochs (the first not counted), batch 32, {threads} intra-op thread(s) on "
                  "both sides; no Horovod communication (one process), so the ratio is the cost of hvtrain's layers "
                  "and loop.",
                  load_note({f"{fw}/{side}": rs for fw, runs in raw.items() for side, rs in runs.items()})],
        "raw": {"epochs": epochs, "runs": raw},
    }
