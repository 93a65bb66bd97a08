"""Benchmarks, side by side in one run (these machines are noisy: compare ratios, not absolutes).

1. CLI start-up of login-node commands (`hosts check`, `launch --dry-run`): wall time.
2. hvtrain vs a hand-written Horovod loop (bench/handwritten_torch.py), torch, 2 ranks,
   same model/batch/threads/Horovod settings, runs interleaved; median samples/s of the
   epochs after the first (warm-up).
3. The transformer example (examples/digits_transformer.yaml) vs the same model written natively
   in each framework (bench/native_transformer.py), 1 process, runs interleaved, same medians.
4. Datasets larger than memory (bench/data_scale.py): 0.25 GB vs 4 GB `npy:` data, 2 ranks,
   peak RSS per rank and samples/s (bench/results/data_scale.json).

Writes bench/results/latest.json and prints a summary. Usage: make bench  (or python bench/run.py)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "OMPI_ALLOW_RUN_AS_ROOT": "1",
       "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "HOROVOD_CYCLE_TIME": os.environ.get("HOROVOD_CYCLE_TIME", "5")}
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, env=ENV, check=True, capture_output=True)
    return time.perf_counter() - t0


def startup() -> dict:
    hv = [sys.executable, "-m", "hvtrain"]
    cases = {"hosts_check": hv + ["hosts", "check", "hostfiles/example-cluster"],
             "launch_dry_run": hv + ["launch", "-np", "2", "--dry-run", "--", "train", "examples/digits_mlp.yaml"],
             "python_baseline": [sys.executable, "-c", "pass"]}
    return {name: statistics.median(timed(argv) for _ in range(5)) for name, argv in cases.items()}


def hvtrain_rate(tmp: Path) -> float:
    out = tmp / "hv"
    subprocess.run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", sys.executable, "-m", "hvtrain",
                    "train", "bench/mlp.yaml", "--quiet", "--output-dir", str(out)],
                   cwd=ROOT, env=ENV, check=True, capture_output=True)
    rates = [json.loads(line)["samples_per_sec"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(rates[1:])


def handwritten_rate() -> float:
    proc = subprocess.run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", sys.executable,
                           "bench/handwritten_torch.py", "4", "10", "512"],
                          cwd=ROOT, env=ENV, check=True, capture_output=True, text=True)
    line = next(ln for ln in proc.stdout.splitlines() if "samples_per_sec" in ln)
    return statistics.median(json.loads(line[line.index("{"):line.rindex("}") + 1])["samples_per_sec"][1:])


def transformer_rates(framework: str, tmp: Path, epochs: int = 5) -> tuple[float, float]:
    out = tmp / f"tr-{framework}"
    subprocess.run([sys.executable, "-m", "hvtrain", "train", "examples/digits_transformer.yaml", "--backend",
                    framework, "--quiet", "--set", f"train.epochs={epochs}", "--output-dir", str(out)],
                   cwd=ROOT, env=ENV, check=True, capture_output=True)
    hv = [json.loads(line)["samples_per_sec"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    proc = subprocess.run([sys.executable, "bench/native_transformer.py", framework, str(epochs)],
                          cwd=ROOT, env=ENV, check=True, capture_output=True, text=True)
    native = json.loads(proc.stdout.strip().splitlines()[-1])["samples_per_sec"]
    return statistics.median(hv[1:]), statistics.median(native[1:])


def main() -> None:
    results: dict = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "startup_seconds": startup()}
    hv, hand = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(REPEATS):  # interleaved, so drift on the machine hits both
            hv.append(hvtrain_rate(Path(tmp)))
            hand.append(handwritten_rate())
        results["torch_np2_mlp"] = {
            "hvtrain_samples_per_sec": hv, "handwritten_samples_per_sec": hand,
            "time_per_step_ratio_hvtrain_over_handwritten": statistics.median(hand) / statistics.median(hv),
            "horovod_cycle_time_ms": ENV["HOROVOD_CYCLE_TIME"]}
        for framework in ("torch", "tensorflow"):
            pairs = [transformer_rates(framework, Path(tmp)) for _ in range(REPEATS)]
            hv_t, native_t = [p[0] for p in pairs], [p[1] for p in pairs]
            results[f"{framework}_transformer_example"] = {
                "hvtrain_samples_per_sec": hv_t, "native_samples_per_sec": native_t,
                "time_per_step_ratio_hvtrain_over_native": statistics.median(native_t) / statistics.median(hv_t)}
    out = ROOT / "bench/results/latest.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    sys.path.insert(0, str(ROOT / "bench"))
    import data_scale

    data_scale.main()


if __name__ == "__main__":
    main()
