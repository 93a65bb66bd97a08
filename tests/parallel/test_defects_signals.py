"""Issue 21, every signal at every phase: real jobs under every launcher, signalled where a user's
scheduler signals them (the launcher alone, every process of the job at once as Slurm's
pre-emption does, one rank), at every phase of a rank's life. A test hook
(tests/fixtures/signal_phases) holds rank 0 at the phase drawn, so the signal lands exactly there;
the job then runs on through the real code. What each gives is the signal table of docs/hpc.md."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hvtrain.errors import PREEMPTED_EXIT
from hvtrain.io.checkpoints import list_checkpoints, load, step_of
from hvtrain.launch.notice import catches
from tests.conftest import ROOT, load_weights, run, run_env
from tests.support.checks import bitwise_equal, start
from tests.support.signals import (
    BEFORE_TRAINING,
    STEPS_PER_EPOCH,
    assert_checkpointed,
    assert_nothing_written,
    assert_stopped_before_training,
    finish,
    go,
    held_at,
    is_rank,
    job_argv,
    name,
    send,
    the_job,
)


def test_defect_07_slurm_preemption_of_plain_horovodrun_checkpoints_exits_75_and_resumes_exactly(tmp_path):
    """Defect: Slurm sends SIGTERM to every process of `horovodrun -np 2 hvtrain train ...` at
    once; horovodrun (its /bin/sh -c mpirun) died of it (exit 143, no requeue) and mpirun killed
    the ranks, often before they had checkpointed (2 of 3 tries in the report). A race, so two
    tries (before the fix each lost with odds 2/3: both pass with 1/9): each must checkpoint at the
    step it names and exit 75; the last one's resume ends bitwise where an uninterrupted run does."""
    for attempt in range(2):
        part = tmp_path / f"part{attempt}"
        proc = start(job_argv("horovodrun", "--set", "train.epochs=400", "--output-dir", str(part)), part)
        send(the_job(proc), signal.SIGTERM)
        step = assert_checkpointed(finish(proc, part), part, ranks=2)
    # the epoch it stopped in: the second, unless the notice landed later (an epoch is ~0.1 s; CI's load
    # once delayed it to step 338) — the reference and the resume then run to the end of that epoch
    epochs = step // STEPS_PER_EPOCH[2] + 1
    full, (ckpt,) = tmp_path / "full", list_checkpoints(part)
    run(job_argv("horovodrun", "--set", f"train.epochs={epochs}", "--output-dir", str(full)), timeout=300)
    resumed = run(job_argv("horovodrun", "--set", f"train.epochs={epochs}", "--resume", "auto",
                           "--output-dir", str(part)), timeout=300)
    assert f"resumed from {ckpt} (epoch " in resumed.stdout and f", step {step})" in resumed.stdout, resumed.stdout
    bitwise_equal(full / "final.safetensors", part / "final.safetensors")


def test_defect_08_a_notice_during_start_up_ends_before_training_with_75(tmp_path):
    """Defect: the handlers were installed after the config and the data were loaded: a notice
    then (SIGUSR1, as hvtrain launch passes it on) killed the run, exit 138, and a requeue script
    requeues only on 75. Now `hvtrain train` installs them first: the run stops before its first
    step, exit 75, nothing to lose and nothing written but its manifest."""
    proc, rank0 = held_at("data", "train", tmp_path)
    os.kill(rank0, signal.SIGUSR1)
    go(tmp_path)
    out_dir = tmp_path / "run"
    assert_stopped_before_training(finish(proc, out_dir), out_dir)


def test_defect_09_a_notice_to_hvtrain_launch_before_mpirun_exists_is_kept_and_delivered(tmp_path):
    """Defect: SIGTERM to `hvtrain launch` before mpirun existed was dropped (its message blamed
    --gloo over ssh) and the job trained to the end, exit 0. Now the notice is kept until the
    ranks can take it: they stop before training, exit 75."""
    out_dir = tmp_path / "run"
    proc = subprocess.Popen(job_argv("launch", "--set", "train.epochs=1", "--output-dir", str(out_dir)), cwd=ROOT,
                            env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    while not catches(proc.pid, signal.SIGTERM):  # hvtrain launch is listening; its launcher starts now
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.002)
    assert "mpirun" not in [name(p) for p in the_job(proc)], "mpirun exists already"
    proc.send_signal(signal.SIGTERM)
    end = finish(proc, out_dir)
    assert_stopped_before_training(end, out_dir)
    assert "cannot pass" not in end.err


def test_defect_09_a_notice_just_after_the_ranks_started_waits_for_their_handlers(tmp_path):
    """Defect: a SIGTERM to `hvtrain launch` just after mpirun had started its ranks reached them
    (as SIGUSR1) before they had a handler: they died of it, exit 138. Now each rank gets it once
    its handler is there (/proc SigCgt): the job stops before training, exit 75."""
    out_dir = tmp_path / "run"
    proc = subprocess.Popen(job_argv("launch", "--set", "train.epochs=1", "--output-dir", str(out_dir)), cwd=ROOT,
                            env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 120
    while not [p for p in the_job(proc)[1:] if is_rank(p) and catches(p.pid, signal.SIGUSR1) is False]:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)  # a rank exists, without its handler yet
    assert_stopped_before_training(finish(proc, out_dir), out_dir)


def test_defect_10_hvtrain_launch_gloo_on_a_clean_preemption_exits_75_without_a_traceback(tmp_path):
    """Defect: under --gloo, every rank checkpointed and exited 75, and horovodrun raised
    RuntimeError (a traceback, exit 1) for their non-zero exits. Now it exits with their 75."""
    part = tmp_path / "part"
    proc = start(job_argv("launch-gloo", "--set", "train.epochs=40", "--output-dir", str(part)), part)
    proc.send_signal(signal.SIGTERM)
    end = finish(proc, part)
    assert_checkpointed(end, part, ranks=2)
    assert "RuntimeError" not in end.err


# ----------------------------------------------------------------------------- every signal at every phase

LAUNCHERS = ("train", "launch", "launch-gloo", "launch-mpirun", "horovodrun", "horovodrun-gloo", "mpirun")
PHASES = ("python", *BEFORE_TRAINING, "step", "checkpoint", "final")
TARGETS = ("launcher", "job", "rank")


def fits(launcher: str, phase: str, target: str, sig: int) -> bool:
    """The combinations docs/hpc.md's table promises an outcome for. `hvtrain train` alone is its
    own launcher; a scheduler signals the whole job with SIGTERM; plain horovodrun --gloo passes
    a signal to it on as SIGTERM and SIGKILLs the ranks 5 s later: a start-up gets there only
    from the config or the data (the rank's next check is then at once), not from the framework's
    import on."""
    if launcher == "train" and target != "launcher" or target == "job" and sig != signal.SIGTERM:
        return False
    return not (launcher == "horovodrun-gloo" and target != "rank" and phase in BEFORE_TRAINING
                and phase not in ("config", "data"))


def mpirun_kills(launcher: str, target: str, sig: int) -> bool:
    """Plain mpirun turns a SIGTERM to it into SIGKILLs 2 s later and exit 1 (OpenMPI's own)."""
    return launcher == "mpirun" and target != "rank" and sig == signal.SIGTERM


def kept_for_the_handlers(launcher: str, target: str) -> bool:
    """Before a rank's handler exists, a signal that reaches it ends it (Python's default); only
    `hvtrain launch` keeps a notice sent to it until the ranks can take it."""
    return launcher.startswith("launch") and target == "launcher"


# Every combination, and a seeded draw of a few per run (the suite's time): each run covers others,
# and a failure names its seed, to draw the same cases again, and its case, to run it alone.
CASES = [c for c in itertools.product(LAUNCHERS, PHASES, TARGETS, (signal.SIGTERM, signal.SIGUSR1)) if fits(*c)]
# drawn once per session by tests/conftest.py, before the xdist workers start: one draw on every worker
SEED = int(os.environ.get("HVTRAIN_SIGNAL_SEED") or random.SystemRandom().randrange(2**32))
DRAWN = random.Random(SEED).sample(CASES, 5)


def case_id(case: tuple[str, str, str, int]) -> str:
    launcher, phase, target, sig = case
    return f"{launcher}-{phase}-{target}-{signal.Signals(sig).name}"


@pytest.mark.parametrize("case", DRAWN, ids=case_id)
def test_every_signal_at_every_phase_ends_in_75_with_nothing_lost(tmp_path, case):
    """A job signalled at a drawn phase, by a drawn target, under a drawn launcher: before
    training it stops with 75 and nothing to lose; mid-step and during a checkpoint's write it
    checkpoints at one step (every checkpoint verifies) and exits 75; during the final write the
    run completes, exit 0. Never a kill, a traceback, a half-written file or a process left; plain
    mpirun's own SIGTERM handling (exit 1) excepted, which leaves no half-written file either, and
    a signal that reaches a rank before its handler (Python's start-up), which ends it, with
    nothing trained or written (hvtrain launch keeps one sent to it for the handlers: 75)."""
    try:
        signalled_at_a_phase(tmp_path, *case)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n(these draws again: HVTRAIN_SIGNAL_SEED={SEED}; this case alone: "
                             f"-k {case_id(case)!r})") from exc


def signalled_at_a_phase(where: Path, launcher: str, phase: str, target: str, sig: int) -> None:
    ranks = 1 if launcher == "train" else 2
    train = ["--set", f"train.epochs={1 if phase in ('python', *BEFORE_TRAINING) else 2}",
             "--set", f"train.checkpoint_every={1 if phase == 'checkpoint' else 0}"]
    at_step = STEPS_PER_EPOCH[ranks] + 7  # mid-epoch 2
    proc, rank0 = held_at(phase, launcher, where, *train, step=at_step)
    if target == "launcher":
        proc.send_signal(sig)
    elif target == "job":
        send(the_job(proc), sig)
    else:
        os.kill(rank0, sig)
    go(where)
    out_dir = where / "run"
    end = finish(proc, out_dir)
    if phase == "python" and not kept_for_the_handlers(launcher, target) or mpirun_kills(launcher, target, sig):
        # the rank died of it, or mpirun's exit 1; nothing trained, or whatever was written is whole
        assert end.code not in (0, PREEMPTED_EXIT), (end.code, end.out[-2000:], end.err[-3000:])
        if phase == "python":
            assert_nothing_written(out_dir)
        for path in [*list_checkpoints(out_dir), *out_dir.glob("final.safetensors")]:
            load(path) if path.name.startswith("ckpt-") else load_weights(path)
        assert not list(out_dir.glob(".*.tmp"))
    elif phase in ("python", *BEFORE_TRAINING):
        assert_stopped_before_training(end, out_dir)
    elif phase == "final":
        assert end.code == 0, (end.code, end.out[-2000:], end.err[-3000:])
        assert json.loads((out_dir / "summary.json").read_text())["steps"] == 2 * STEPS_PER_EPOCH[ranks]
        assert (out_dir / "final.safetensors").exists() and "preempted" not in end.out
    else:
        step = assert_checkpointed(end, out_dir, ranks)
        if phase == "step":
            assert step == at_step, (step, at_step)  # checked every step: the step it was signalled in
        else:  # the epoch-end checkpoint being saved is complete, the stop one step after it
            assert [step_of(p) for p in list_checkpoints(out_dir)] == [step, STEPS_PER_EPOCH[ranks]]
            assert step == STEPS_PER_EPOCH[ranks] + 1
