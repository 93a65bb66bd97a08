"""Issue 21, every signal at every phase, without a framework: the real training loop, checkpoint
manager and signal handlers (faked runtime and steps, tests/support/one_rank.py) under
real signals at every point of a run; `hvtrain launch`'s launcher start and notice passing with
stand-in launchers (srun, a remote-only mpirun: not available here); the Slurm template's exit
status as bash sees it."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvtrain.config.load import load_config
from hvtrain.data.dataset import load_dataset
from hvtrain.errors import PREEMPTED_EXIT, Preempted
from hvtrain.io.checkpoints import list_checkpoints, load, step_of
from hvtrain.training.preempt import StopSignals
from tests.conftest import ROOT
from tests.support.one_rank import LOOP, FakeRuntime, FakeSteps

STEPS = 40  # LOOP: 400 training samples, batch 10, one rank


class SignalledSteps(FakeSteps):
    """FakeSteps that signal this process (a real SIGUSR1/SIGTERM) before micro-batch `at`."""

    def __init__(self, metrics, at: int | None, sig: int = signal.SIGUSR1) -> None:
        super().__init__(metrics)
        self.at, self.sig, self.calls = at, sig, 0

    def train_batch(self, batch, x, y) -> bool:
        self.calls += 1
        if self.calls == self.at:
            signal.raise_signal(self.sig)
        return super().train_batch(batch, x, y)


def loop(out: Path, *overrides: str, resume: str | None = None, at: int | None = None, sig: int = signal.SIGUSR1,
         hook=None) -> tuple[dict | None, SignalledSteps]:
    """hvtrain.training.loop.fit on LOOP as `hvtrain train` runs it: StopSignals installed, checked every
    step; `at`: the micro-batch before which a real signal arrives; `hook(run)` before fit.
    Returns (summary, or None when Preempted; the steps)."""
    from hvtrain.metrics.suite import MetricSet

    cfg = load_config({**LOOP, "output_dir": str(out)}, ["train.signal_check_every=1", *overrides])
    data = load_dataset(cfg)
    rt, metrics = FakeRuntime(), MetricSet.of(cfg, data)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        return _fit(cfg, data, rt, metrics, out, resume, at, sig, hook)
    finally:  # StopSignals keeps its handlers once a signal came (the process is on its way out)
        for number, handler in handlers.items():
            signal.signal(number, handler)


def _fit(cfg, data, rt, metrics, out, resume, at, sig, hook):
    from hvtrain.io.reporter import Reporter
    from hvtrain.training.checkpoint import CheckpointManager
    from hvtrain.training.loop import fit
    from hvtrain.training.run import Run

    with StopSignals() as signals:
        reporter = Reporter(rt.info, out, keep_metrics=resume is not None)
        steps = SignalledSteps(metrics, at, sig)
        run = Run(cfg, None, data, steps, rt, reporter, CheckpointManager(cfg, rt, reporter, None, None), metrics,
                  signals=signals)
        if hook is not None:
            hook(run)
        try:
            return fit(run, resume), steps
        except Preempted:
            return None, steps


# ----------------------------------------------------------------------------- item 19


def test_defect_19_one_position_has_one_epoch_number_in_every_line(tmp_path, capsys):
    """Defect: a mid-epoch pre-emption printed `checkpoint: ... (epoch 1, step 53)` then `preempted
    at epoch 2 step 53`, and the resume `(epoch 1, step 53)` again: the checkpoint and resume lines
    counted epochs done, the pre-emption line the epoch it was in. Now every line names the epoch
    the step belongs to, counted from 1 like the progress bar and the epoch lines (step 53 of 40
    a epoch is in epoch 2; an epoch-end checkpoint's step is that epoch's last)."""
    summary, _ = loop(tmp_path, "train.epochs=3", at=53)
    assert summary is None
    text = capsys.readouterr().out
    ckpt, epoch_end = list_checkpoints(tmp_path)
    assert step_of(ckpt) == 53 and step_of(epoch_end) == STEPS
    assert f"checkpoint: {epoch_end} (epoch 1, step 40)" in text, text
    assert f"checkpoint: {ckpt} (epoch 2, step 53)" in text, text
    assert f"preempted at epoch 2, step 53: checkpoint {ckpt}; resume with --resume auto" in text, text
    summary, _ = loop(tmp_path, "train.epochs=3", resume="auto")
    assert f"resumed from {ckpt} (epoch 2, step 53)" in capsys.readouterr().out
    assert summary["steps"] == 3 * STEPS


# ----------------------------------------------------------------------------- signals at every point of a run


def uninterrupted(tmp_path_factory) -> tuple[dict, list]:
    if not hasattr(uninterrupted, "cache"):
        summary, steps = loop(tmp_path_factory.mktemp("full"), "train.epochs=2", "train.checkpoint_every=0")
        uninterrupted.cache = summary, steps.lrs
    return uninterrupted.cache


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(point=st.one_of(st.sampled_from(["start", "checkpoint", "final"]), st.integers(1, 2 * STEPS)),
       sig=st.sampled_from([signal.SIGTERM, signal.SIGUSR1]), every=st.sampled_from([0, 1]))
def test_a_signal_anywhere_in_a_run_stops_at_one_step_and_resumes_exactly(tmp_path_factory, point, sig, every):
    """A real SIGTERM/SIGUSR1 during start-up (before fit), before any micro-batch, inside the
    epoch-end checkpoint's save, or inside the final write: the run stops at the first step it
    checks after the signal, with a checkpoint there that verifies (during start-up: none, nothing
    to lose), or it has finished (the final write: its outputs whole); `--resume auto` then ends
    exactly where an uninterrupted run ends (the model is the update count; every lr the same)."""
    import hvtrain.io.checkpoints as checkpoint
    import hvtrain.io.reporter as output

    full, full_lrs = uninterrupted(tmp_path_factory)
    out = tmp_path_factory.mktemp("part")
    every = 1 if point == "checkpoint" else every
    args = ("train.epochs=2", f"train.checkpoint_every={every}")
    with pytest.MonkeyPatch.context() as mp:
        if point == "checkpoint":
            write = checkpoint.atomic_write
            mp.setattr(checkpoint, "atomic_write", lambda path, data: (signal.raise_signal(sig), write(path, data))[1])
        if point == "final":
            weights = output.Reporter.write_weights
            mp.setattr(output.Reporter, "write_weights", lambda *a: (signal.raise_signal(sig), weights(*a))[1])
        summary, steps = loop(out, *args, at=point if isinstance(point, int) else None, sig=sig,
                              hook=(lambda run: signal.raise_signal(sig)) if point == "start" else None)
    if point == "final":
        assert summary is not None and summary["steps"] == full["steps"] and (out / "final.safetensors").exists()
        return
    assert summary is None, "stopped by the signal"
    ckpts = list_checkpoints(out)
    for path in ckpts:
        load(path)  # verifies every tensor's checksum
    assert not list(out.glob(".*.tmp"))
    stop = {"start": 0, "checkpoint": STEPS + 1}.get(point, point)
    assert len(steps.lrs) == stop and (step_of(ckpts[0]) == stop if stop else ckpts == [])
    resumed, rest = loop(out, *args, resume="auto")
    assert steps.lrs + rest.lrs == full_lrs and resumed["steps"] == full["steps"]
    assert resumed["val_loss"] == full["val_loss"]  # the weights: one update per step, none lost or doubled


def test_defect_08_the_loop_stops_before_its_first_step_on_a_start_up_notice(tmp_path, capsys):
    """A notice recorded during start-up (the CLI installs the handlers first): the loop asks every
    rank once before its first step and stops there, exit 75, with nothing trained or written
    but what start-up writes; a resumed run says its checkpoint still holds it."""
    summary, steps = loop(tmp_path, "train.epochs=1", hook=lambda run: signal.raise_signal(signal.SIGTERM))
    assert summary is None and steps.lrs == [] and not list_checkpoints(tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "final.safetensors").exists()
    assert "preempted before training started: nothing trained, nothing to lose; run it again" in capsys.readouterr().out
    loop(tmp_path, "train.epochs=1", at=15)
    (ckpt,) = list_checkpoints(tmp_path)
    capsys.readouterr()
    summary, steps = loop(tmp_path, "train.epochs=1", resume="auto", hook=lambda run: signal.raise_signal(signal.SIGUSR1))
    assert summary is None and steps.lrs == [] and list_checkpoints(tmp_path) == [ckpt]
    assert f"nothing to lose; {ckpt} still holds the run at epoch 1, step 15; resume with --resume auto" \
        in capsys.readouterr().out
    assert PREEMPTED_EXIT == Preempted.exit_code == 75


# ----------------------------------------------------------------------------- hvtrain launch: starting, passing on


def script(path: Path, body: str) -> Path:
    """An executable Python script (Python leaves the signal mask it inherits as it is)."""
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def launch_in_thread_signalled(plan, sig: int = signal.SIGTERM, after: float = 0.3) -> int:
    """execute.run(plan) here, with `sig` sent to this process `after` seconds in (a scheduler's
    notice to hvtrain launch)."""
    from hvtrain.launch.execute import run

    timer = threading.Timer(after, os.kill, (os.getpid(), sig))
    timer.start()
    try:
        return run(plan)
    finally:
        timer.cancel()


MASK = "import sys\nopen(sys.argv[0] + '.status', 'w').write(open('/proc/self/status').read())\n"


def test_hvtrain_launch_starts_mpirun_and_horovodrun_with_sigterm_blocked_and_srun_not(tmp_path):
    """A SIGTERM to the whole job (Slurm's pre-emption) must not reach mpirun (it kills the ranks
    2 s later and exits 1) nor horovodrun --gloo (5 s): hvtrain launch starts its launcher with
    SIGTERM blocked. srun passes a SIGTERM on to its tasks itself and keeps it."""
    from hvtrain.launch.execute import Plan, run

    for name, blocked in (("mpirun", True), ("srun", False)):
        fake = script(tmp_path / name, MASK)
        assert run(Plan([str(fake)], dict(os.environ), None)) == 0
        status = (tmp_path / f"{name}.status").read_text()
        mask = int(next(ln for ln in status.splitlines() if ln.startswith("SigBlk:")).split()[1], 16)
        assert bool(mask >> (signal.SIGTERM - 1) & 1) is blocked, (name, hex(mask))
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set(), "this process's own mask is restored"


FAKE_RANK = """import os, signal, sys, time
ready = os.environ["FAKE_RANK_DIR"]
time.sleep(float(os.environ.get("FAKE_RANK_LATE", "0")))  # a rank's start-up, before hvtrain's handler
signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75))
open(os.path.join(ready, str(os.getpid())), "w").close()
time.sleep(30)
"""


def fake_ranks(tmp_path: Path, command: str, late: float) -> dict[str, str]:
    """A launcher that starts two local `python -m hvtrain COMMAND` ranks (a stand-in hvtrain
    package on PYTHONPATH: its handler comes `late` seconds after it starts) and exits with the
    first's code; the environment to run it with."""
    (tmp_path / "pkg" / "hvtrain").mkdir(parents=True)
    (tmp_path / "pkg" / "hvtrain" / "__main__.py").write_text(FAKE_RANK)
    script(tmp_path / "launcher", f"import subprocess, sys\nranks = [subprocess.Popen([sys.executable, '-m', "
                                  f"'hvtrain', '{command}'], cwd={str(tmp_path)!r}) for _ in range(2)]\n"
                                  "codes = [r.wait() for r in ranks]\nsys.exit(128 - codes[0] if codes[0] < 0 else codes[0])\n")
    return {**os.environ, "PYTHONPATH": str(tmp_path / "pkg"), "FAKE_RANK_DIR": str(tmp_path), "FAKE_RANK_LATE": str(late)}


def test_defect_09_a_notice_waits_for_each_training_ranks_handler(tmp_path):
    """Defect: hvtrain launch passed a notice on at once: to nobody before the launcher had started
    its ranks (dropped), and to ranks without a handler yet (they died of it, exit 138). Now it is
    kept and each `train` rank gets it once /proc shows its SIGUSR1 handler: here 1.5 s after the
    notice, which both ranks then take (exit 75, not 138)."""
    from hvtrain.launch.execute import Plan

    env = fake_ranks(tmp_path, "train", late=1.5)
    started = time.time()
    assert launch_in_thread_signalled(Plan([str(tmp_path / "launcher")], env, None), after=0.05) == PREEMPTED_EXIT
    assert time.time() - started >= 1.5 and len(list(tmp_path.glob("[0-9]*"))) == 2


def test_a_notice_reaches_a_rank_of_another_command_at_once(tmp_path):
    """A rank that does not train (predict, export: no handler) gets the notice at once and ends of
    it, as under any launcher (SIGUSR1: 128 + 10)."""
    from hvtrain.launch.execute import Plan

    env = fake_ranks(tmp_path, "predict", late=20)
    assert launch_in_thread_signalled(Plan([str(tmp_path / "launcher")], env, None), after=0.5) == 128 + signal.SIGUSR1


def test_with_no_rank_on_this_host_the_notice_goes_to_the_mpi_launcher_once_it_has_run_a_while(tmp_path, monkeypatch):
    """Ranks on other hosts only (srun's tasks, mpirun's remote ranks) cannot be looked at from
    here: the notice goes to srun/mpirun, which passes SIGUSR1 on to every task, once it has run
    SETTLE_S (the remote ranks' start-up)."""
    from hvtrain.launch import notice
    from hvtrain.launch.execute import Plan

    monkeypatch.setattr(notice, "SETTLE_S", 1.5)
    fake = script(tmp_path / "srun", "import signal, sys, time\nsignal.signal(signal.SIGUSR1, lambda *a: sys.exit(75))\n"
                                     "time.sleep(30)\n")
    started = time.time()
    assert launch_in_thread_signalled(Plan([str(fake)], dict(os.environ), None), after=0.1) == PREEMPTED_EXIT
    assert time.time() - started >= 1.5


def test_a_notice_no_one_below_could_take_is_reported(tmp_path, capsys):
    """horovodrun --gloo with remote ranks only (ssh passes no signal on): the notice cannot be
    delivered from here; the launch says so instead of pretending."""
    from hvtrain.launch.execute import Plan

    fake = script(tmp_path / "horovodrun", "import time\ntime.sleep(1.0)\n")
    assert launch_in_thread_signalled(Plan([str(fake)], dict(os.environ), None), after=0.1) == 0
    assert "hvtrain launch: the SIGTERM it received was not passed on: no rank and no MPI launcher below pid" \
        in capsys.readouterr().err


def test_stop_signals_unblock_what_a_launcher_blocked():
    """hvtrain launch starts horovodrun with SIGTERM blocked, and horovodrun --gloo's ranks inherit
    that mask: a training rank must take SIGTERM all the same."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        with StopSignals() as signals:
            assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
            signal.raise_signal(signal.SIGTERM)
            assert signals.received == "SIGTERM"
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)


# ----------------------------------------------------------------------------- the Slurm template (item 23)

FAKE_HVTRAIN = """#!/bin/sh
[ "$1" = launch ] || exit 0                # hosts check
sleep 0.2
kill -USR1 "$PPID"                          # Slurm's --signal=B:USR1 to the batch script, as the job ends
exit 75                                     # ... with 75: pre-empted cleanly
"""


def test_defect_23_the_slurm_template_requeues_on_the_launchers_75_not_an_interrupted_waits_138(tmp_path):
    """Defect: examples/slurm.sbatch took `wait`'s 138 (a trap interrupted it) for the job's exit
    status when the launcher ended as the signal came (the template's `kill -0` then found it
    gone): no requeue, exit 138. It now takes the launcher's own status, 75, and requeues. Three
    runs of the template as Slurm runs it (bash, in SLURM_SUBMIT_DIR), with hvtrain and scontrol
    stand-ins: the old template lost the 75 in about 9 of 10."""
    submit, fake = tmp_path / "submit", tmp_path / "bin"
    (submit / ".venv" / "bin").mkdir(parents=True)
    (submit / ".venv" / "bin" / "activate").write_text(f'PATH="{fake}:$PATH"\n')
    fake.mkdir()
    calls = tmp_path / "scontrol.calls"
    for name, body in (("hvtrain", FAKE_HVTRAIN), ("scontrol", f'#!/bin/sh\necho "$@" >> {calls}\n')):
        (fake / name).write_text(body)
        (fake / name).chmod(0o755)
    env = {**os.environ, "SLURM_SUBMIT_DIR": str(submit), "SLURM_JOB_ID": "4242"}
    for attempt in range(3):
        proc = subprocess.run(["bash", str(ROOT / "examples" / "slurm.sbatch")], env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == PREEMPTED_EXIT, (attempt, proc.returncode, proc.stderr)
    assert calls.read_text().split("\n")[:3] == ["requeue 4242"] * 3
