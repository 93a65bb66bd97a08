"""Datasets larger than memory (issue 10): the same model and batch trained for 200 steps on a
generated 0.25 GB and a 4 GB `npy:` dataset, 2 ranks, runs alternated. Peak RSS per rank and
samples/s must not depend on the dataset's size: each rank reads only its batches' rows, and
memory-mapped pages are released as it goes.

Data is generated once under BENCH_DATA (default /tmp/hvtrain-bench-data) and reused; the first
run on each dataset (the one-pass normalisation statistics, then cached beside the data) is a
warm-up and not measured. Writes bench/results/data_scale.json.

Usage: python bench/data_scale.py   (make bench runs it)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "OMPI_ALLOW_RUN_AS_ROOT": "1",
       "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
FEATURES = 1024  # 4 KiB rows
SIZES_GB = {"0.25GB": 0.25, "4GB": 4.0}
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
STEPS = 200

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


def train(data: Path, out: Path) -> dict:
    cfg = out.with_suffix(".yaml")
    cfg.write_text(CONFIG.format(data=data, features=FEATURES, steps=STEPS))
    mpirun = shutil.which("mpirun", path=ENV["PATH"]) or "mpirun"
    subprocess.run([mpirun, "-np", "2", "--bind-to", "none", "--oversubscribe", sys.executable, "-m",
                    "hvtrain", "train", str(cfg), "--quiet", "--output-dir", str(out)],
                   cwd=ROOT, env=ENV, check=True, capture_output=True)
    return json.loads((out / "summary.json").read_text())


def main() -> dict:
    base = Path(os.environ.get("BENCH_DATA", "/tmp/hvtrain-bench-data"))
    t0 = time.perf_counter()
    datasets = {name: generate(base / name, gb) for name, gb in SIZES_GB.items()}
    generated_s = time.perf_counter() - t0
    runs: dict[str, list[dict]] = {name: [] for name in datasets}
    with tempfile.TemporaryDirectory() as tmp:
        for name, d in datasets.items():  # warm-up: statistics pass (cached), page cache
            train(d, Path(tmp) / f"warm-{name}")
        for i in range(REPEATS):  # alternated, so drift on the machine hits both
            for name, d in datasets.items():
                s = train(d, Path(tmp) / f"{name}-{i}")
                runs[name].append({"samples_per_sec": s["samples_per_sec"], "peak_rss_mb_max": s["peak_rss_mb"]["max"],
                                   "peak_rss_mb_rank0": s["peak_rss_mb"]["rank0"],
                                   "data_wait_seconds_max": s["data_wait_seconds"]["max"], "steps": s["steps"]})
    small, large = (runs[n] for n in SIZES_GB)

    def med(rs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    rss_gap = med(large, "peak_rss_mb_max") - med(small, "peak_rss_mb_max")
    rate_ratio = med(large, "samples_per_sec") / med(small, "samples_per_sec")
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "ranks": 2, "steps": STEPS, "batch_per_rank": 128,
        "features": FEATURES, "generate_seconds": round(generated_s, 1),
        "datasets": {n: {"rows": int((datasets[n] / "complete").read_text()),
                         "bytes": (datasets[n] / "x.npy").stat().st_size} for n in datasets},
        "runs": runs,
        "median_peak_rss_mb": {n: med(runs[n], "peak_rss_mb_max") for n in runs},
        "median_samples_per_sec": {n: med(runs[n], "samples_per_sec") for n in runs},
        "peak_rss_gap_mb_4GB_minus_0.25GB": round(rss_gap, 1),
        "samples_per_sec_ratio_4GB_over_0.25GB": round(rate_ratio, 3),
        "goals": {"peak_rss_gap_mb_below": 150, "samples_per_sec_within": 0.10,
                  "met": abs(rss_gap) < 150 and abs(rate_ratio - 1) < 0.10},
    }
    out = ROOT / "bench/results/data_scale.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return result


if __name__ == "__main__":
    main()
