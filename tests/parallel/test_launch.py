"""Real launches through the CLI: `hvtrain launch --launcher mpirun --hostfile`, HOROVOD_* precedence
on the ranks, and `hvtrain doctor` as a user runs it. Two ranks, one epoch each."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

from tests.conftest import hvtrain, run, run_env, tool

PROBE = "tests.fixtures.native_models:torch_mlp_recording_horovod_env"


def test_launch_mpirun_with_a_hostfile_trains_on_two_ranks(tmp_path):
    hostfile, out = tmp_path / "hosts", tmp_path / "run"
    hostfile.write_text("# the test machine\nlocalhost slots=2\n")
    proc = run(hvtrain("launch", "-np", "2", "--launcher", "mpirun", "--hostfile", str(hostfile), "--",
                       "train", "examples/digits_mlp.yaml", "--set", "train.epochs=1", "--output-dir", str(out),
                       "--quiet"))
    # launch prints the command it runs (stderr) before the ranks start; the hostfile goes to mpirun as a
    # temporary file in OpenMPI syntax, named by its placeholder in the printed line
    argv = shlex.split(proc.stderr.splitlines()[0])
    assert Path(argv[0]).name == "mpirun", argv
    assert argv[1:5] == ["-np", "2", "--hostfile", "<hostfile>"]
    assert argv[argv.index(sys.executable):] == [sys.executable, "-m", "hvtrain", "train", "examples/digits_mlp.yaml",
                                                 "--set", "train.epochs=1", "--output-dir", str(out), "--quiet"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["controller"] == "mpi"
    assert summary["val_samples"] == 359  # digits: 20% of 1797, evaluated once over both ranks


def test_a_horovod_variable_set_by_the_user_wins_on_every_rank(tmp_path):
    """The config asks for cycle time 7 ms and fusion 3 MB; the user exported HOROVOD_CYCLE_TIME=2.5.
    Each rank records the HOROVOD_* environment it runs with once Horovod is initialised: the user's
    cycle time, and the config's fusion threshold (so the probe does see what hvtrain sets)."""
    env = run_env()
    env.pop("HOROVOD_FUSION_THRESHOLD", None)
    env["HOROVOD_CYCLE_TIME"] = "2.5"
    run([tool("mpirun"), "-np", "2", "--bind-to", "none", "--oversubscribe",
         *hvtrain("train", "tests/configs/entrypoint.yaml", "--quiet", "--output-dir", str(tmp_path / "run"),
                  "--set", "train.epochs=1", "--set", f"model.entrypoint={PROBE}",
                  "--set", f"model.kwargs.probe_dir={tmp_path}",
                  "--set", "horovod.cycle_time_ms=7", "--set", "horovod.fusion_threshold_mb=3")], env=env)
    for rank in (0, 1):
        knobs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert knobs["HOROVOD_CYCLE_TIME"] == "2.5", (rank, knobs)
        assert knobs["HOROVOD_FUSION_THRESHOLD"] == str(3 * 1024 * 1024), (rank, knobs)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2


def test_doctor_reports_both_frameworks_and_horovod_built_with_mpi():
    proc = run(hvtrain("doctor"))
    out = proc.stdout
    for framework in ("torch", "tensorflow"):
        assert re.search(rf"^  {framework} +\d+\.\d+", out, re.M), out  # a version, not "not installed"
    for binding in ("horovod.torch", "horovod.tensorflow"):
        assert re.search(rf"^  {re.escape(binding)} +mpi=yes, ", out, re.M), out
    assert re.search(r"^  flavour +openmpi$", out, re.M), out
    assert out.rstrip().endswith("ok: backend 'torch' can run") and "problem:" not in proc.stderr, proc.stderr


def test_doctor_unknown_backend_is_a_usage_error():
    proc = run(hvtrain("doctor", "--backend", "nosuch"), check=False)
    assert proc.returncode == 2 and proc.stdout == ""  # refused before collecting anything
    assert proc.stderr.startswith("Usage: hvtrain doctor [OPTIONS]")
    assert "Invalid value for '--backend': 'nosuch' is not one of 'torch', 'tensorflow'." in proc.stderr
    assert "Traceback" not in proc.stderr


FORBID_BUILD_CHECK = """import os
if os.environ.get("FORBID_HOROVOD_BUILD_CHECK"):  # Horovod's build check, as horovodrun asks it, now fails
    import horovod.common.util as util

    def forbidden(*args, **kwargs):
        raise SystemExit("horovod build check asked")

    util._check_extension_lambda = forbidden
"""


def test_hvtrain_launch_horovodrun_answers_the_build_check_from_its_cache(tmp_path):
    """horovodrun imported TensorFlow (horovod.tensorflow, in a forked process) on every launch to
    ask whether Horovod has MPI: ~3-4 s before any rank starts, a torch job's too. hvtrain launch
    runs Horovod's launcher with that answer cached per installed build. Proof: once the cache
    holds the answer, a launch whose build check would fail still trains; without the entry, the
    same launch asks and fails."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FORBID_BUILD_CHECK)
    env = {**run_env(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    forbid = {**env, "PYTHONPATH": str(tmp_path / "site"), "FORBID_HOROVOD_BUILD_CHECK": "1"}
    argv = hvtrain("launch", "-np", "1", "--", "train", "examples/digits_mlp.yaml", "--set", "train.epochs=1",
                   "--output-dir", str(tmp_path / "run"), "--quiet")
    first = run(argv, env=env)
    assert shlex.split(first.stderr.splitlines()[0])[:3] == [sys.executable, "-m", "hvtrain.launch.horovodrun"]
    (entry,) = (tmp_path / "cache" / "hvtrain").glob("horovod-build-*.json")
    assert json.loads(entry.read_text()) == {"mpi": True}  # asked Horovod once (MPI mode: no Gloo question)
    (tmp_path / "run" / "summary.json").unlink()
    run(argv, env=forbid)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 1
    entry.unlink()
    asked = run(argv, env=forbid, check=False)
    assert asked.returncode != 0 and "horovod build check asked" in asked.stderr, asked.stderr[-2000:]
