"""Review of issue 21's signal fixes on real 2-rank jobs: a start-up notice ends the rank it
reaches at its next phase boundary (not at the first step), with the job's exit 75; and a
`horovodrun --gloo` rank takes SIGTERM as any process does (the launcher patch's edit 8)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from hvtrain.launch.horovodrun import MODULE as HOROVODRUN_MODULE
from tests.conftest import ROOT, run_env
from tests.support.signals import assert_stopped_before_training, finish, go, held_at


def test_defect_05_a_notice_during_data_loading_ends_that_rank_before_the_framework_and_the_job_with_75(tmp_path):
    """Defect: a start-up notice was acted on only at the first training step: after a signal
    during data loading the rank still imported the framework, started Horovod, built and probed
    the model and wrote the manifest, then exited 75 (a long start-up is SIGKILLed first: Slurm's
    KillWait is 30 s). Now rank 0, signalled alone while it loads its data (plain mpirun, 2 ranks),
    stops right after, before the framework's import; rank 1, waiting for it in Horovod's init, is
    ended by mpirun, whose exit is rank 0's 75."""
    proc, rank0 = held_at("data", "mpirun", tmp_path)
    os.kill(rank0, signal.SIGUSR1)
    go(tmp_path)
    out_dir = tmp_path / "run"
    end = finish(proc, out_dir)
    assert_stopped_before_training(end, out_dir)
    assert ("hvtrain: rank 0 of 2: preempted before training started: nothing trained, nothing to lose (SIGUSR1 "
            "during start-up, before the framework's import); run it again") in end.out, end.out[-2000:]
    assert not (out_dir / "manifest.json").exists(), "rank 0 went on to train's set-up"


SLEEPER = textwrap.dedent("""
    import os, signal, time
    print("rank", os.environ["HOROVOD_RANK"], signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
          signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []), flush=True)
    time.sleep(120)
""")


def test_defect_11_plain_horovodrun_gloo_ends_ranks_without_a_handler_on_sigterm_at_once():
    """Defect: the launcher patch made Horovod's middlemen ignore SIGTERM, and every rank inherited
    it: a command without a handler of its own (here a script that sleeps; an elastic rank,
    predict) could not be ended by SIGTERM, and horovodrun's teardown on a SIGTERM to it waited
    5 s, then SIGKILLed the ranks (137, 10 s in all). Now each rank starts with SIGTERM at its
    default: it dies of horovodrun's SIGTERM at once, 143 for each. (`hvtrain train` still
    pre-empts with 75 under horovodrun --gloo: tests/parallel/test_defects_signals.py.) Horovod's
    launcher as `hvtrain launch` runs it, unchanged but for its build check, cached (4 s less)."""
    proc = subprocess.Popen([sys.executable, "-m", HOROVODRUN_MODULE, "--gloo", "-np", "2", "-H", "localhost:2",
                             sys.executable, "-c", SLEEPER], cwd=ROOT, env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        while sum("rank" in line for line in lines) < 2:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
        started = [line.split(":", 1)[1].split() for line in lines if "]<stdout>:rank" in line]
        assert sorted(started) == [["rank", "0", "True", "False"], ["rank", "1", "True", "False"]], lines
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, out)
    assert took < 4, f"{took:.1f} s: Horovod's teardown waited for a SIGKILL (5 s)\n{out}"
    for rank in (0, 1):
        assert f"Process {rank} exit with status code 143." in out, out
