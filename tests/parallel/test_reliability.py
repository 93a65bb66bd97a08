"""Failure and recovery with real processes: SIGKILL, corrupted checkpoints, resume, failing ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from hvtrain.io.checkpoints import list_checkpoints, load, step_of
from tests.conftest import ROOT, hvtrain, load_weights, run, run_env, tool
from tests.support.checks import bitwise_equal, kill_after_checkpoint, regression_npy_with_outlier, row_at
from tests.support.launch import BACKENDS, horovodrun, launch, mpirun

SLOW = "tests/configs/slow_mlp.yaml"


@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_run_resumes_to_identical_weights(tmp_path, backend):
    """SIGKILL after a checkpoint, --resume auto: bitwise the uninterrupted run, on 2 ranks (the
    one-rank resume is the same path; tests/unit/test_loop.py resumes on simulated worlds)."""
    np_ = 2
    full, part = tmp_path / "full", tmp_path / "part"
    # 10,000 samples: an epoch of ~60 steps, still far longer than the 20 ms the kill waits on a checkpoint
    samples = 10_000
    common = ["train", SLOW, "--backend", backend, "--quiet", "--set", f"data.samples={samples}"]
    run(launch(np_, *common, "--output-dir", str(full)), timeout=400)
    steps_per_epoch = -(-int(samples * 0.8) // (64 * np_))  # validation_split 0.2
    kill_after_checkpoint(launch(np_, *common, "--output-dir", str(part)), part, 2 * steps_per_epoch)
    proc = run(launch(np_, *common, "--output-dir", str(part), "--resume", "auto"), timeout=400)
    assert "resumed from" in proc.stdout
    bitwise_equal(full / "final.safetensors", part / "final.safetensors")
    records = [json.loads(ln) for ln in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3, 4]  # history continued, nothing repeated
    # keep: 3 — exactly the newest three of this run (it kept its run id across the resume)
    assert [step_of(p) for p in list_checkpoints(part)] == [4 * steps_per_epoch, 3 * steps_per_epoch,
                                                              2 * steps_per_epoch]


def test_corrupted_checkpoints_are_reported_and_skipped(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["train", SLOW, "--quiet", "--set", "train.epochs=3", "--set", "data.samples=10000"]
    run(hvtrain(*common, "--output-dir", str(full)))
    run(hvtrain(*common, "--output-dir", str(part)))
    newest, middle, oldest = list_checkpoints(part)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    data = bytearray(middle.read_bytes())
    data[-100] ^= 0x01  # one flipped bit in the tensor data
    middle.write_bytes(bytes(data))
    corrupted = tmp_path / "corrupted.safetensors"
    corrupted.write_bytes(bytes(data))  # the resumed run below rewrites `middle` with a good checkpoint
    (part / "final.safetensors").unlink()
    proc = run(hvtrain(*common, "--output-dir", str(part), "--resume", "auto"))
    assert f"skipping checkpoint: {newest}: not a readable checkpoint" in proc.stdout
    assert f"skipping checkpoint: {middle}: checksum mismatch" in proc.stdout
    assert f"resumed from {oldest}" in proc.stdout
    bitwise_equal(full / "final.safetensors", part / "final.safetensors")
    # naming a corrupted checkpoint explicitly is an error, not a silent fresh start
    bad = run(hvtrain(*common, "--output-dir", str(tmp_path / "x"), "--resume", str(corrupted)), check=False)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == f"hvtrain: error: {corrupted}: checksum mismatch (the file is corrupted)"


@pytest.mark.parametrize("launcher", ["horovodrun", "gloo", "mpirun"])
def test_a_rank_that_raises_ends_the_job_quickly_and_says_why(tmp_path, launcher):
    args = ["train", "tests/configs/entrypoint.yaml", "--set",
            "model.entrypoint=tests.fixtures.native_models:torch_mlp_failing_on_rank", "--set", "model.kwargs={}",
            "--set", "train.epochs=50", "--output-dir", str(tmp_path)]
    argv = mpirun(2, *args) if launcher == "mpirun" else horovodrun(2, *args, gloo=launcher == "gloo")
    started = time.time()
    proc = run(argv, check=False, timeout=120)
    assert time.time() - started < 60
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "hvtrain: error: rank 1 of 2: RuntimeError: user model failed on call 6" in text, text[-3000:]


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_a_killed_rank_ends_the_job_quickly(tmp_path, launcher):
    marker = str(tmp_path / "killme")
    args = ["train", SLOW, "--quiet", "--set", "train.epochs=30", "--output-dir", marker]
    argv = mpirun(2, *args) if launcher == "mpirun" else horovodrun(2, *args)
    proc = subprocess.Popen(argv, cwd=ROOT, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        victim = None
        while victim is None and time.time() < deadline:  # the rank-1 worker: `python -m hvtrain` with our marker
            time.sleep(0.5)
            ps = subprocess.run(["pgrep", "-f", f"hvtrain train {SLOW}.*{marker}"], capture_output=True, text=True)
            pids = sorted(int(p) for p in ps.stdout.split())
            # (not horovodrun itself: a python process too, whose command line holds the ranks')
            workers = [p for p in pids if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"hvtrain"]]
            if len(workers) == 2 and (Path(marker) / "metrics.jsonl").exists():
                victim = workers[1]
        assert victim, "workers not found"
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        out, _ = proc.communicate(timeout=90)
        assert time.time() - killed < 60
        assert proc.returncode != 0
        assert "signal 9" in out or "Killed" in out or "exit with status" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("change,differs", [
    (["--set", "optimizer.lr=0.2"], "rank 1: config"),
    (["--set", "data.validation_split=0.3"], "rank 1: config, data"),
    (["--set", "model.layers.0.units=96"], "rank 1: config, model"),
])
def test_ranks_that_disagree_are_named_at_start(tmp_path, change, differs):
    base = hvtrain("train", "examples/digits_mlp.yaml", "--output-dir", str(tmp_path))
    argv = [tool("mpirun"), "--oversubscribe", "-np", "1", *base, ":", "-np", "1", *base, *change]
    proc = run(argv, check=False, timeout=120)
    assert proc.returncode != 0
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "hvtrain: error:" in ln]
    assert errors and f"ranks disagree with rank 0 ({differs})" in errors[0], errors
    assert "epoch 1/" not in proc.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_loss_stops_or_skips(tmp_path, backend):
    """The outlier target sits in step 16 of epoch 1 (2 ranks x 32, unshuffled): its MSE is inf.
    Step checkpoints every 3 steps exist before it, all finite, and none is written at or after it;
    under on_nan: skip that step is skipped every epoch and the rest learns."""
    dataset = regression_npy_with_outlier(tmp_path / "data", row_at(15 * 64 + 10))
    args = ["train", "examples/digits_mlp.yaml", "--backend", backend, "--set", f"data.dataset={dataset}",
            "--set", "data.shuffle=false", "--set", "loss=mse", "--set", "metrics=[r2]",
            "--set", "model.layers.2.units=1", "--set", "optimizer.lr=0.01", "--set", "train.epochs=3",
            "--set", "train.checkpoint_every=3", "--set", "train.checkpoint_unit=step", "--set", "train.keep=10"]
    stop = run(horovodrun(2, *args, "--output-dir", str(tmp_path / "stop")), check=False, timeout=120)
    assert stop.returncode != 0
    text = stop.stdout + stop.stderr
    assert "non-finite loss at epoch 1, step 16 on rank" in text and "(train.on_nan: stop" in text, text[-2000:]
    written = list_checkpoints(tmp_path / "stop")
    assert [step_of(p) for p in written] == [15, 12, 9, 6, 3]
    for p in written:
        assert all(np.isfinite(v).all() for k, v in load(p).tensors.items() if v.dtype.kind == "f"), p
    run(horovodrun(2, *args, "--set", "train.on_nan=skip", "--output-dir", str(tmp_path / "skip")))
    weights = load_weights(tmp_path / "skip/final.safetensors")
    assert all(np.isfinite(v).all() for v in weights.values())
    summary = json.loads((tmp_path / "skip/summary.json").read_text())
    assert np.isfinite(summary["train_loss"]) and summary["val_r2"] > 0.9, summary
