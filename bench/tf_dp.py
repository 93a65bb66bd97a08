"""TensorFlow data parallelism, np=2: hvtrain vs a hand-written Horovod TF2 loop (Keras 3) vs
tf.distribute.MultiWorkerMirroredStrategy (ring all-reduce), plus the two-independent-ranks
ceiling. The MLP 64-1024-1024-10 (per-rank batch 128) and a CIFAR-style ResNet-18 (batch 8), SGD
momentum 0.9, fp32, one intra-op and one inter-op thread per rank, synthetic data of the same
shape; no compression anywhere.

Launchers: hvtrain `hvtrain launch -np 2 --hostfile hostfiles/localhost -- train --backend
tensorflow` (horovodrun); the hand-written loop `horovodrun -np 2 -H localhost:2` with Horovod's
default knobs; MWMS as TensorFlow documents it: one process per worker, TF_CONFIG naming both
workers on free localhost ports.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from common import (
    CONFIGS,
    PEERS,
    PY,
    SIDE_COLUMNS,
    TIMEOUT,
    Side,
    all_met,
    bench_env,
    ceiling_side,
    ceiling_warnings,
    check,
    free_ports,
    hvtrain_side,
    interleave,
    load_note,
    logger,
    paired,
    peer_records,
    peer_side,
    repeats,
    run_together,
    side_rows,
    steady,
    tool,
)

NP = 2
# model: (config, per-rank batch, steps per epoch per rank, epochs); the first epoch is warm-up (tracing)
FULL = {"mlp": (CONFIGS / "mlp.yaml", 128, 40, 4), "resnet18": (CONFIGS / "resnet18.yaml", 8, 4, 2)}
QUICK = {"mlp": (CONFIGS / "mlp.yaml", 128, 6, 2)}
CEILING_GOAL = 0.85  # np=2 samples/s ÷ the two-independent-ranks ceiling (issue 26)


def mwms_side(epochs: int, steps: int, batch: int, model: str) -> Side:
    def measure(rep: int) -> dict:
        workers = [f"localhost:{port}" for port in free_ports(NP)]
        envs = [bench_env(TF_CONFIG=json.dumps({"cluster": {"worker": workers},
                                                "task": {"type": "worker", "index": i}})) for i in range(NP)]
        argv = [PY, PEERS / "tf_mwms.py", str(epochs), str(steps), str(batch), model]
        procs = run_together([argv] * NP, TIMEOUT, envs)
        records = [peer_records(p, [i])[0] for i, p in enumerate(procs)]  # each worker prints its own line
        return {"rate": steady(records[0]["samples_per_sec"]), "epoch_rates": records[0]["samples_per_sec"],
                "peak_rss_mb": [r["peak_rss_mb"] for r in records]}

    return Side("MWMS (ring)", measure)


def run(quick: bool) -> dict:
    reps, log = repeats(quick), logger("tf_dp")
    rows, checks, raw, warnings = [], [], {}, []
    with tempfile.TemporaryDirectory(prefix="bench-tf-") as tmp:
        for model, (config, batch, steps, epochs) in (QUICK if quick else FULL).items():
            log(model)
            sets = [f"data.samples={steps * batch * NP}", f"data.batch_size={batch}", f"train.epochs={epochs}",
                    "train.threads=1"]
            one_rank = [f"data.samples={steps * batch}", f"data.batch_size={batch}", f"train.epochs={epochs}",
                        "train.threads=1"]
            hand = [tool("horovodrun"), "-np", str(NP), "-H", f"localhost:{NP}", PY, PEERS / "tf_horovod.py",
                    str(epochs), str(steps), str(batch), model]
            sides = [hvtrain_side(f"hvtrain-{model}", NP, config, Path(tmp), sets, backend="tensorflow"),
                     peer_side("hand-written Horovod", hand, NP),
                     mwms_side(epochs, steps, batch, model),
                     ceiling_side(config, Path(tmp), one_rank, backend="tensorflow", np=NP)]
            runs = interleave(sides, reps, log)
            runs = {("hvtrain" if k.startswith("hvtrain-") else k): v for k, v in runs.items()}
            raw[model] = runs
            warnings += [f"{model}: {w}" for w in ceiling_warnings(runs)]
            rows += side_rows([model, NP], runs, batch * NP, ceiling="ceiling")
            hv = runs["hvtrain"]
            checks += [
                check(f"{model} np=2: hvtrain time/step ÷ hand-written Horovod's <= 1.03",
                      paired(runs["hand-written Horovod"], hv, lambda h, v: h / v), lambda r: r <= 1.03, quick),
                check(f"{model} np=2: hvtrain samples/s ÷ MWMS's >= 1.0",
                      paired(hv, runs["MWMS (ring)"], lambda v, m: v / m), lambda r: r >= 1.0, quick),
                check(f"{model} np=2: hvtrain samples/s ÷ the two-independent-ranks ceiling >= {CEILING_GOAL}",
                      paired(hv, runs["ceiling"], lambda v, c: v / c), lambda r: r >= CEILING_GOAL, quick),
            ]
    workload = {m: {"per_rank_batch": b, "steps_per_epoch_per_rank": s, "epochs": e}
                for m, (_, b, s, e) in (QUICK if quick else FULL).items()}
    return {
        "title": "TensorFlow: hvtrain vs hand-written Horovod TF2 vs MultiWorkerMirroredStrategy",
        "goal": "time/step <= 1.03x the hand-written Horovod TF2 loop; samples/s >= 1.0x MWMS and >= "
                f"{CEILING_GOAL}x the two-independent-ranks ceiling at np=2",
        "columns": ["model", "np", *SIDE_COLUMNS],
        "rows": rows,
        "checks": checks, "met": all_met(checks),
        "notes": [
            "MLP 64-1024-1024-10 and CIFAR-style ResNet-18 (bench/configs/resnet18.yaml; the peers' Keras "
            "functional twin in bench/peers/tf_models.py) on 28x28x3 images; per-rank batch, steps and epochs in the "
            "raw workload (the first epoch, with tf.function tracing, not counted); SGD momentum 0.9, fp32, one "
            "thread per rank.",
            "hand-written loop: bench/peers/tf_horovod.py (tensorflow2_synthetic_benchmark style: tf.function step, "
            "hvd.DistributedGradientTape, Keras 3 variables passed to Horovod as `.value`); Horovod's default knobs.",
            "MWMS: bench/peers/tf_mwms.py, CommunicationImplementation.RING, custom loop with strategy.run, loss "
            "averaged over the global batch (tf.nn.compute_average_loss), gradients summed by the optimizer.",
            "ceiling: two one-rank `hvtrain train --backend tensorflow` runs started together, samples/s summed.",
            load_note({f"{m}/{k}": v for m, runs in raw.items() for k, v in runs.items()}), *warnings,
        ],
        "raw": {"workload": workload, "runs": raw},
    }
