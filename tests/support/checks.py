"""Comparisons and process control shared by the multi-process tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np

from hvtrain.io.checkpoints import list_checkpoints, step_of
from tests.conftest import ROOT, load_weights, run_env


def bitwise_equal(a: Path, b: Path) -> None:
    """Two weight files hold the same tensors, bit for bit."""
    wa, wb = load_weights(a), load_weights(b)
    assert sorted(wa) == sorted(wb)
    for k in wa:
        assert np.array_equal(wa[k], wb[k]), f"{k} differs by {np.abs(wa[k] - wb[k]).max()}"


def records(out: Path) -> list[dict]:
    """metrics.jsonl's complete lines (a line being appended right now is left out)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    got = []
    for line in path.read_text().splitlines():
        try:
            got.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return got


def kill_after_checkpoint(argv: list[str], out: Path, min_step: int, timeout: float = 240) -> None:
    """Start a run, SIGKILL its whole process group once a checkpoint at >= min_step exists."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=run_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if [p for p in list_checkpoints(out) if step_of(p) >= min_step]:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.02)
        else:
            raise AssertionError("no checkpoint appeared in time")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not (out / "final.safetensors").exists(), "killed too late: the run had finished"


def start(argv: list[str], out: Path) -> subprocess.Popen:
    """Start a run; return once it trains (after its first epoch line)."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.time() + 240
    while not records(out):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the run did not start training"
        time.sleep(0.05)
    return proc


def preempted_step(stdout: str) -> int:
    """The step a pre-empted run stopped at, from its 'preempted at epoch E, step S' line."""
    line = next(ln for ln in stdout.splitlines() if "preempted at epoch" in ln)  # horovodrun prefixes [1,0]
    return int(line.split(" step ")[1].split(":")[0])


def regression_npy_with_outlier(directory: Path, row: int = 100, n: int = 1797, features: int = 64) -> str:
    """A linear regression as npy:DIR (float32, y = x.w + noise) whose target in `row` is 1e30:
    finite, so the data checks pass it, but its squared error overflows float32, so the MSE loss of
    the batch holding that sample is inf on both backends and on every pipeline stage's schedule
    (a NaN feature would be refused at load). Returns the data.dataset value."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, features)).astype(np.float32)
    w = rng.standard_normal(features).astype(np.float32) / np.sqrt(features)
    y = (x @ w + 0.05 * rng.standard_normal(n)).astype(np.float32)
    y[row] = 1e30
    directory.mkdir(parents=True, exist_ok=True)
    np.save(directory / "x.npy", x)
    np.save(directory / "y.npy", y)
    return f"npy:{directory}"


def row_at(position: int, seed: int = 1234, n: int = 1797, validation_split: float = 0.2) -> int:
    """The raw row that is training sample `position` without shuffling (hvtrain.data.dataset's seeded split)."""
    perm = np.random.default_rng([seed, 0xDA7A]).permutation(n)
    return int(perm[int(round(n * validation_split)):][position])
