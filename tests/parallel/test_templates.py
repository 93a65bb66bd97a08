"""The scheduler templates work as written (issue 11): examples/slurm.sbatch run as Slurm would
run it (allocation variables set, SIGUSR1 to the batch script before walltime) stops the job
with a checkpoint, exits 75 and requeues itself."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time

from hvtrain.errors import PREEMPTED_EXIT
from hvtrain.io.checkpoints import list_checkpoints
from tests.conftest import ROOT, run_env


def test_slurm_template_passes_the_walltime_signal_on_and_requeues(tmp_path):
    out, calls = tmp_path / "run", tmp_path / "scontrol.calls"
    fake = tmp_path / "bin"
    fake.mkdir()
    env = {**run_env(), "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_TASKS_PER_NODE": "2", "HVTRAIN_OUTPUT_DIR": str(out), "PATH": f"{fake}:{run_env()['PATH']}"}
    # scontrol on PATH: `hosts` asks it to expand the node list, so it must answer that too
    (fake / "scontrol").write_text(f"#!/bin/sh\nif [ \"$1\" = show ]; then echo localhost; exit 0; fi\n"
                                   f"echo \"$@\" >> {calls}\n")
    (fake / "scontrol").chmod(0o755 | stat.S_IEXEC)
    proc = subprocess.Popen(["bash", "examples/slurm.sbatch"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 240
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@90 does: the batch script only
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == PREEMPTED_EXIT, stderr[-3000:]
    assert "preempted at epoch" in stdout and list_checkpoints(out), stdout[-2000:]
    assert calls.read_text().split() == ["requeue", "4242"]
    assert not os.path.exists(out / "final.safetensors")
