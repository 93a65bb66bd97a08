"""Datasets larger than memory (issue 10): the same model and batch trained for 200 steps on a
generated 0.25 GB and a 4 GB `npy:` dataset, 2 ranks, runs alternated. Peak RSS per rank and
samples/s must not depend on the dataset's size: each rank reads only its batches' rows, and
memory-mapped pages are released as it goes.

Data is generated once under BENCH_DATA (default /tmp/hvtrain-bench-data) and reused; the first
run on each dataset (the one-pass normalisation statistics, then cached beside the data) is a
warm-up and not measured. Quick mode: 8 MB and 16 MB datasets in a temporary directory, 5 steps.

Usage: python bench/run.py --only data_scale   (make bench runs it)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import PY, logger, repeats, tool
from common import run as run_command

FEATURES = 1024  # 4 KiB rows
SIZES_GB = {"0.25GB": 0.25, "4GB": 4.0}
QUICK_SIZES_GB = {"8MB": 8 / 1024, "16MB": 16 / 1024}
STEPS, QUICK_STEPS = 200, 5

CONFIG = """
name: data-scale
seed: 0
data: {{dataset: "npy:{data}", batch_size: 128, validation_split: 0.002}}
model:
  input_shape: [{features}]
  layers:
    - {{type: dense, units: 256, activation: relu}}
    - {{type: dense, units: 10}}
optimizer: {{name: sgd, lr: 0.01}}
train: {{epochs: 1, max_steps: {steps}, threads: 1, log_every: 1000}}
"""


def generate(directory: Path, gigabytes: float) -> Path:
    """x.npy (float32, FEATURES wide) and y.npy (10 classes), written in chunks, never whole in memory."""
    rows = int(gigabytes * 2**30) // (FEATURES * 4)
    done = directory / "complete"
    if done.is_file() and done.read_text() == str(rows):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    x = np.lib.format.open_memmap(directory / "x.npy", mode="w+", dtype=np.float32, shape=(rows, FEATURES))
    y = np.empty(rows, np.int64)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((FEATURES, 10)).astype(np.float32)
    chunk = 16384
    for start in range(0, rows, chunk):
        block = rng.standard_normal((min(chunk, rows - start), FEATURES), dtype=np.float32)
        x[start: start + len(block)] = block
        y[start: start + len(block)] = (block @ w).argmax(axis=1)
    x.flush()
    del x
    np.save(directory / "y.npy", y)
    done.write_text(str(rows))
    return directory


def train(data: Path, out: Path, steps: int) -> dict:
    cfg = out.with_suffix(".yaml")
    cfg.write_text(CONFIG.format(data=data, features=FEATURES, steps=steps))
    run_command([tool("mpirun"), "-np", "2", "--bind-to", "none", "--oversubscribe", PY, "-m", "hvtrain", "train",
                 str(cfg), "--quiet", "--output-dir", str(out)], 900)
    return json.loads((out / "summary.json").read_text())


def run(quick: bool) -> dict:
    log = logger("data_scale")
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        base = Path(tmp) if quick else Path(os.environ.get("BENCH_DATA", "/tmp/hvtrain-bench-data"))
        return measure(base, Path(tmp), QUICK_SIZES_GB if quick else SIZES_GB, QUICK_STEPS if quick else STEPS,
                       repeats(quick), quick, log)


def measure(base: Path, tmp: Path, sizes: dict[str, float], steps: int, reps: int, quick: bool, log) -> dict:
    t0 = time.perf_counter()
    datasets = {name: generate(base / name, gb) for name, gb in sizes.items()}
    generated_s = time.perf_counter() - t0
    log(f"data ready in {generated_s:.0f} s")
    runs: dict[str, list[dict]] = {name: [] for name in datasets}
    if not quick:
        for name, d in datasets.items():  # warm-up: statistics pass (cached), page cache
            train(d, tmp / f"warm-{name}", steps)
    for i in range(reps):  # alternated, so drift on the machine hits both
        for name, d in datasets.items():
            s = train(d, tmp / f"{name}-{i}", steps)
            runs[name].append({"samples_per_sec": s["samples_per_sec"], "peak_rss_mb_max": s["peak_rss_mb"]["max"],
                               "peak_rss_mb_ranks": s["peak_rss_mb"]["ranks"],
                               "data_wait_seconds_max": s["data_wait_seconds"]["max"], "steps": s["steps"]})
            log(f"{name} rep {i + 1}/{reps}: {s['samples_per_sec']:,.0f} samples/s")
    small, large = (runs[n] for n in sizes)

    def med(rs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    rss_gap = med(large, "peak_rss_mb_max") - med(small, "peak_rss_mb_max")
    rate_ratio = med(large, "samples_per_sec") / med(small, "samples_per_sec")
    ratios = [b["samples_per_sec"] / a["samples_per_sec"] for a, b in zip(small, large, strict=True)]
    names = list(sizes)
    rows = []
    for name in names:
        rs = runs[name]
        rates = [r["samples_per_sec"] for r in rs]
        per_rank = " / ".join(f"{statistics.median(r['peak_rss_mb_ranks'][k] for r in rs):.0f}"
                              for k in range(len(rs[0]["peak_rss_mb_ranks"])))
        rows.append([name, int((datasets[name] / "complete").read_text()), f"{med(rs, 'samples_per_sec'):,.0f}",
                     f"{min(rates):,.0f}-{max(rates):,.0f}", per_rank, f"{med(rs, 'data_wait_seconds_max'):.3f}"])
    gaps = [b["peak_rss_mb_max"] - a["peak_rss_mb_max"] for a, b in zip(small, large, strict=True)]
    checks = [
        {"goal": f"peak RSS per rank, {names[1]} minus {names[0]} < 150 MB", "measured": round(rss_gap, 1),
         "spread": [round(min(gaps), 1), round(max(gaps), 1)], "met": None if quick else abs(rss_gap) < 150},
        {"goal": f"samples/s {names[1]} ÷ {names[0]} within 1 ± 0.10", "measured": round(rate_ratio, 3),
         "spread": [round(min(ratios), 3), round(max(ratios), 3)],
         "met": None if quick else abs(rate_ratio - 1) < 0.10},
    ]
    return {
        "title": "Datasets larger than memory (npy:, 2 ranks)",
        "goal": "peak RSS per rank and samples/s do not depend on the dataset's size",
        "columns": ["dataset", "rows", "samples/s", "spread", "peak RSS MiB per rank", "data wait s (max rank)"],
        "rows": rows, "checks": checks,
        "met": None if quick else all(c["met"] for c in checks),
        "notes": [f"MLP {FEATURES}-256-10, batch 128 per rank, {steps} steps, `mpirun -np 2 hvtrain train`; the "
                  f"datasets alternated; data generated in {generated_s:.0f} s (reused when already there)."],
        "raw": {"steps": steps, "batch_per_rank": 128, "features": FEATURES, "generate_seconds": round(generated_s, 1),
                "datasets": {n: {"rows": int((datasets[n] / "complete").read_text()),
                                 "bytes": (datasets[n] / "x.npy").stat().st_size} for n in datasets},
                "runs": runs},
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(json.dumps(run(os.environ.get("BENCH_QUICK") == "1"), indent=2))
