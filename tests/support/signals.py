"""Real jobs held at a phase of a rank's life and signalled there (tests/fixtures/signal_phases):
the launch lines, the job's processes, and how a signalled job ended, shared by the signal tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from hvtrain.errors import PREEMPTED_EXIT
from hvtrain.io.checkpoints import list_checkpoints, load, step_of
from tests.conftest import ROOT, hvtrain, run_env, tool
from tests.support.checks import preempted_step

CFG = "examples/digits_mlp.yaml"
COMMON = ["--quiet", "--set", "train.signal_check_every=1"]
HARNESS = ROOT / "tests" / "fixtures" / "signal_phases"
STEPS_PER_EPOCH = {1: 45, 2: 23}  # 1438 training samples, batch 32 per rank
BEFORE_TRAINING = ("config", "data", "import", "init", "broadcast", "build")


def job_argv(launcher: str, *train: str) -> list[str]:
    """The job as users start it: `hvtrain train` alone, `hvtrain launch` (horovodrun over MPI,
    --gloo, --launcher mpirun), or a plain horovodrun / horovodrun --gloo / mpirun of the
    `hvtrain` script (the design card's own line), 2 ranks on this host."""
    args = ["train", CFG, *COMMON, *train]
    if launcher == "train":
        return hvtrain(*args)
    if launcher.startswith("launch"):
        extra = {"launch": [], "launch-gloo": ["--gloo"], "launch-mpirun": ["--launcher", "mpirun"]}[launcher]
        return hvtrain("launch", "-np", "2", *extra, "--", *args)
    if launcher.startswith("horovodrun"):
        return [tool("horovodrun"), "-np", "2", "-H", "localhost:2", *(["--gloo"] if "gloo" in launcher else []),
                tool("hvtrain"), *args]
    return [tool("mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none", tool("hvtrain"), *args]


def name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return ""


def is_rank(process: psutil.Process) -> bool:
    try:
        return process.cmdline()[1:4] == ["-m", "hvtrain", "train"]
    except psutil.Error:
        return False


def the_job(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every process of the job: what Slurm signals on pre-emption (the job's cgroup)."""
    try:
        top = psutil.Process(proc.pid)
        return [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def send(processes: list[psutil.Process], sig: int) -> None:
    for p in processes:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


@dataclass
class Ended:
    code: int
    out: str
    err: str


def finish(proc: subprocess.Popen, out_dir: Path, timeout: float = 180) -> Ended:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.time() + 10  # nothing of the job is left running (horovodrun's middlemen, ranks)
    while time.time() < deadline and subprocess.run(["pgrep", "-f", str(out_dir)], capture_output=True).stdout:
        time.sleep(0.1)
    assert not subprocess.run(["pgrep", "-f", str(out_dir)], capture_output=True).stdout, "a process was left"
    return Ended(proc.returncode, out, err)


def held_at(phase: str, launcher: str, where: Path, *train: str, step: int = 30) -> tuple[subprocess.Popen, int]:
    """Start the job with rank 0 held at `phase` (`step`: before that optimizer step); return it and
    rank 0's pid once it is there."""
    where.mkdir(parents=True, exist_ok=True)
    env = {**run_env(), "PYTHONPATH": str(HARNESS), "HVTRAIN_TEST_PHASE": phase, "HVTRAIN_TEST_PHASE_DIR": str(where),
           "HVTRAIN_TEST_PHASE_STEP": str(step)}
    proc = subprocess.Popen(job_argv(launcher, *train, "--output-dir", str(where / "run")), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 240
    while not (where / "at").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"rank 0 never reached {phase}"
        time.sleep(0.02)
    return proc, int((where / "at").read_text())


def go(where: Path) -> None:
    time.sleep(0.3)  # the signal is handled (and passed on) while rank 0 is still held
    (where / "go").touch()


def assert_nothing_written(out_dir: Path) -> None:
    assert not list_checkpoints(out_dir) and not (out_dir / "final.safetensors").exists()
    assert not (out_dir / "summary.json").exists() and not list(out_dir.glob(".*.tmp"))


def assert_stopped_before_training(end: Ended, out_dir: Path) -> None:
    assert end.code == PREEMPTED_EXIT, (end.code, end.out[-2000:], end.err[-3000:])
    assert "preempted before training started: nothing trained, nothing to lose" in end.out, end.out[-2000:]
    assert_nothing_written(out_dir)
    assert "Traceback" not in end.err, end.err[-3000:]


def assert_checkpointed(end: Ended, out_dir: Path, ranks: int) -> int:
    """Exit 75 with one checkpoint at the step the job says, in the one numbering; its step."""
    assert end.code == PREEMPTED_EXIT, (end.code, end.out[-2000:], end.err[-3000:])
    assert "Traceback" not in end.err, end.err[-3000:]
    step = preempted_step(end.out)
    newest = list_checkpoints(out_dir)[0]
    meta = load(newest).meta  # verifies every tensor's checksum
    assert step_of(newest) == step and meta["world_size"] == ranks
    epoch = (step - 1) // STEPS_PER_EPOCH[ranks] + 1
    assert f"preempted at epoch {epoch}, step {step}: checkpoint {newest}" in end.out, end.out[-2000:]
    assert not (out_dir / "final.safetensors").exists() and not list(out_dir.glob(".*.tmp"))
    return step


# ----------------------------------------------------------------------------- the numbered defects
