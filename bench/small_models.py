"""Small models, where anything per step shows: a 32-256-4 MLP at batch 32 (a step is a fraction of
a millisecond) under hvtrain, torch: one plain rank, one rank under `--elastic` (horovodrun's
elastic mode, Gloo, the world may grow), two ranks, two ranks on Horovod's path (horovod.reduction:
hooks, what hvtrain did before its direct reduction and does on GPUs), and the
two-independent-ranks ceiling; TensorFlow's two ranks and ceiling beside them (no goal).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from common import (
    CONFIGS,
    PY,
    TIMEOUT,
    Side,
    all_met,
    ceiling_side,
    check,
    hvtrain_argv,
    hvtrain_result,
    hvtrain_side,
    interleave,
    load_note,
    logger,
    med,
    paired,
    repeats,
    rss_text,
    spread,
    steady,
    tool,
)
from common import run as run_cmd

CONFIG = CONFIGS / "small_mlp.yaml"
BATCH = 32
FULL, QUICK = (300, 3), (50, 2)  # steps per epoch per rank, epochs (the first is warm-up)


def elastic_side(tmp: Path, sets: list[str]) -> Side:
    """One rank under horovodrun's elastic mode (--min-np 1 --max-np 1, a discovery script)."""
    def measure(rep: int) -> dict:
        out = tmp / f"elastic-{rep}"
        script = tmp / "discover.sh"
        script.write_text("#!/bin/sh\necho localhost:1\n")
        script.chmod(0o755)
        train = hvtrain_argv(1, CONFIG, out, sets)[3:]  # ["train", CONFIG, ...] after PY -m hvtrain
        run_cmd([tool("horovodrun"), "-np", "1", "--min-np", "1", "--max-np", "1", "--network-interface", "lo",
                 "--host-discovery-script", str(script), PY, "-m", "hvtrain", *train, "--elastic"], TIMEOUT)
        r = hvtrain_result(out)
        return {"rate": steady(r["epoch_rates"]), **r}

    return Side("1 rank, --elastic", measure)


def run(quick: bool) -> dict:
    reps, log = repeats(quick), logger("small_models")
    steps, epochs = QUICK if quick else FULL
    one = [f"data.samples={steps * BATCH}", f"train.epochs={epochs}", "train.threads=1"]
    two = [f"data.samples={steps * BATCH * 2}", f"train.epochs={epochs}", "train.threads=1"]
    with tempfile.TemporaryDirectory(prefix="bench-small-") as tmp:
        t = Path(tmp)
        torch_sides = [hvtrain_side("1 rank", 1, CONFIG, t, one), elastic_side(t, one),
                       hvtrain_side("2 ranks", 2, CONFIG, t, two),
                       hvtrain_side("2 ranks, Horovod's path (hooks)", 2, CONFIG, t, [*two, "horovod.reduction=hooks"]),
                       ceiling_side(CONFIG, t, one)]
        runs = interleave(torch_sides, reps, log)
        tf_runs = {} if quick else interleave(
            [hvtrain_side("2 ranks", 2, CONFIG, t, two, "tensorflow"),
             ceiling_side(CONFIG, t, one, "tensorflow")], reps, log)
    rows = []
    for framework, rs in (("torch", runs), ("tensorflow", tf_runs)):
        for name, side in rs.items():
            rates = [r["rate"] for r in side]
            ratio = "" if name == "ceiling" or name.startswith("1 rank") else \
                f"{med(paired(side, rs['ceiling'], lambda a, b: a / b)):.2f}"
            vs_plain = "" if name != "1 rank, --elastic" else \
                f"{med(paired(side, rs['1 rank'], lambda a, b: a / b)):.2f}"
            ranks = 1 if name.startswith("1 rank") else 2
            rows.append([framework, name, f"{med(rates):,.0f}", spread(rates),
                         f"{BATCH * ranks / med(rates) * 1000:.3f}", vs_plain, ratio, rss_text(side)])
    checks = [check("1 rank under --elastic ÷ 1 plain rank >= 0.8",
                    paired(runs["1 rank, --elastic"], runs["1 rank"], lambda a, b: a / b), lambda r: r >= 0.8, quick),
              check("2 ranks ÷ the two-independent-ranks ceiling >= 0.7",
                    paired(runs["2 ranks"], runs["ceiling"], lambda a, b: a / b), lambda r: r >= 0.7, quick)]
    return {
        "title": "Small models: a 32-256-4 MLP at batch 32 (torch; TensorFlow beside it)",
        "goal": "--elastic on 1 rank >= 0.8x a plain rank; 2 ranks >= 0.7 of the two-independent-ranks ceiling",
        "columns": ["framework", "side", "samples/s", "spread (min-max)", "ms/step", "÷ 1 plain rank", "÷ ceiling",
                    "peak RSS MiB per rank"],
        "rows": rows, "checks": checks, "met": all_met(checks),
        "notes": [
            f"MLP 32-256-4 (bench/configs/small_mlp.yaml), batch {BATCH} per rank, {steps} steps x {epochs} epochs "
            "(the first is warm-up), one thread per rank, SGD momentum 0.9, fp32, synthetic data. 2 ranks: `hvtrain "
            "launch -np 2` (horovodrun); --elastic: `horovodrun -np 1 --min-np 1 --max-np 1 "
            "--host-discovery-script` (Gloo).",
            "Why the direct reduction: on Horovod's path every step waits for Horovod's background cycle (1 ms) "
            "and the background thread's negotiation takes the rank's core; on one elastic rank there is nothing "
            "to sum, and the direct reduction skips it (a world that grows sums through Horovod, one grouped "
            "allreduce a step).",
            "TensorFlow's direct reduction runs inside the compiled step through tf.numpy_function (measured "
            "2026-12-07, this MLP at batch 32, plain Keras step: 0.32 ms a step alone, 0.61 ms with the "
            "numpy_function and the allreduce, 1.14 ms with Horovod's in-graph allreduce).",
            load_note({**{f"torch/{k}": v for k, v in runs.items()}, **{f"tf/{k}": v for k, v in tf_runs.items()}}),
        ],
        "raw": {"workload": {"per_rank_batch": BATCH, "steps_per_epoch_per_rank": steps, "epochs": epochs},
                "runs": runs, "tf_runs": tf_runs},
    }
