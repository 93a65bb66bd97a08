"""Shared helpers. Multi-process tests run the real CLI under real launchers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The environment before any test ran: in-process backend tests initialise MPI and Horovod, which
# add OMPI_*/PMIX_*/HOROVOD_* variables to os.environ that must not leak into launched jobs.
_CLEAN_ENV = dict(os.environ)


def pytest_configure(config: pytest.Config) -> None:
    """Draws made at collection are drawn once per session, before pytest-xdist starts its workers
    (they inherit the environment): every worker must collect the same tests."""
    import random

    if not os.environ.get("HVTRAIN_SIGNAL_SEED"):  # unset or empty: draw one (a given seed draws those cases again)
        os.environ["HVTRAIN_SIGNAL_SEED"] = str(random.SystemRandom().randrange(2**32))


# `make test` runs the suite on two pytest-xdist workers, a file per worker at a time (--dist loadfile:
# a module's fixtures run once) in this order: the longest files first, so that both workers finish
# together (by their seconds measured on 2 cores with both workers busy, 2026-12-02: 470 down to 60);
# unlisted files after them, the fast tiers last.
LONGEST_FIRST = ("test_multihost.py", "test_bench_smoke.py", "test_reliability.py", "test_elastic.py",
                 "test_one_loop.py", "test_pipeline.py", "test_data_parallel.py", "test_preemption.py",
                 "test_defects_signals.py", "test_predict.py", "test_horovod_knobs.py", "test_graphs.py",
                 "test_checkpoints.py", "test_user_data.py", "test_metrics.py", "test_launch.py")
TIERS = ("parallel", "backends", "unit")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def cost_rank(item: pytest.Item) -> tuple[int, int]:
        path = Path(str(item.path))
        tier = TIERS.index(path.parent.name) if path.parent.name in TIERS else len(TIERS)
        listed = LONGEST_FIRST.index(path.name) if path.name in LONGEST_FIRST else len(LONGEST_FIRST)
        return tier, listed

    items.sort(key=cost_rank)  # stable: a file's tests keep their order


def tool(name: str) -> str:
    """A launcher from the venv, else PATH; fail loudly if missing (no skipping)."""
    local = BIN / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is required for this test but not installed (run `make setup`)")
    return found


def run_env() -> dict[str, str]:
    env = dict(_CLEAN_ENV)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.pop("HVTRAIN_BACKEND", None)
    env.pop("HVTRAIN_OUTPUT_DIR", None)
    return env


def run(argv: list[str], timeout: float = 300, check: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run argv from the repository root; `env` (default run_env()) is the whole environment."""
    proc = subprocess.run(argv, cwd=ROOT, env=run_env() if env is None else env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                             f"stderr:\n{proc.stderr[-4000:]}")
    return proc


def hvtrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "hvtrain", *args]


def load_weights(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a)


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the event files in `directory`, read by tensorboard's own
    EventAccumulator: {tag: [(step, value), ...]}. Read through tensorboard's TF-free stub (the
    `tensorboard.compat.notf` marker of its no-TensorFlow build): otherwise reading imports
    TensorFlow, installed here, into the test process."""
    import types

    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
