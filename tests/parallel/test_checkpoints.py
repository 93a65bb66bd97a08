"""One checkpoint manager (issue 8): run ids, pruning only one's own run, resume only the same
experiment, torn metrics lines, orphaned temp files, mid-epoch step checkpoints on any world size."""

from __future__ import annotations

import json
import math

from hvtrain.io.checkpoints import list_checkpoints, load, step_of
from tests.conftest import hvtrain, run
from tests.support.checks import bitwise_equal
from tests.support.launch import mpirun

MLP = "examples/digits_mlp.yaml"
SLOW = "tests/configs/slow_mlp.yaml"
CK = ["--quiet", "--set", "train.checkpoint_every=1", "--set", "train.keep=2"]


def test_a_second_run_in_a_used_output_dir_keeps_its_checkpoint_and_resumes_its_own(tmp_path):
    """Defect: a fresh run in a used output_dir pruned by step across runs, deleting its own newest
    checkpoint, and `--resume auto` then loaded the other run's."""
    run(hvtrain("train", MLP, *CK, "--set", "train.epochs=3", "--output-dir", str(tmp_path)))
    first = list_checkpoints(tmp_path)
    assert len(first) == 2
    run(hvtrain("train", MLP, *CK, "--set", "train.epochs=1", "--output-dir", str(tmp_path)))
    now = list_checkpoints(tmp_path)
    mine = [p for p in now if p not in first]
    assert len(mine) == 1 and set(first) <= set(now), "each run prunes only its own files"
    second_id = load(mine[0]).meta["run_id"]
    assert second_id != load(first[0]).meta["run_id"]
    proc = run(hvtrain("train", MLP, *CK, "--set", "train.epochs=2", "--output-dir", str(tmp_path),
                       "--resume", "auto"))
    assert f"resumed from {mine[0]} (epoch 1," in proc.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["run_id"] == second_id


def test_keep_prunes_to_exactly_the_newest(tmp_path):
    run(hvtrain("train", MLP, "--quiet", "--set", "train.epochs=5", "--set", "train.checkpoint_every=1",
                "--set", "train.keep=3", "--output-dir", str(tmp_path)))
    assert [step_of(p) for p in list_checkpoints(tmp_path)] == [225, 180, 135]


def test_resume_refuses_a_checkpoint_of_another_experiment(tmp_path):
    run(hvtrain("train", MLP, *CK, "--set", "train.epochs=1", "--output-dir", str(tmp_path)))
    (ckpt,) = list_checkpoints(tmp_path)
    changed = ["--set", "optimizer.lr=3e-2", "--set", "data.batch_size=16", "--set", "train.epochs=2"]
    for resume in ("auto", str(ckpt)):
        proc = run(hvtrain("train", MLP, *CK, *changed, "--output-dir", str(tmp_path), "--resume", resume),
                   check=False)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert "data.batch_size: checkpoint 32, this run 16" in last and "optimizer.lr: checkpoint 0.05, this run 0.03" \
            in last, last
        assert "train.epochs" not in last  # more epochs is a continuation, not another experiment
        assert "Traceback" not in proc.stderr
    assert list_checkpoints(tmp_path) == [ckpt]  # nothing lost


def test_torn_metrics_line_and_orphaned_temp_files_are_cleaned_on_resume(tmp_path):
    run(hvtrain("train", MLP, *CK, "--set", "train.epochs=2", "--output-dir", str(tmp_path)))
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write('{"epoch": 3, "train_lo')  # a kill mid-append
    orphan = tmp_path / ".ckpt-0123abcd-s00000099.safetensors.k2j3.tmp"
    orphan.write_bytes(b"half a checkpoint")
    proc = run(hvtrain("train", MLP, *CK, "--set", "train.epochs=3", "--output-dir", str(tmp_path), "--resume", "auto"))
    assert "resumed from" in proc.stdout and f"removed an unfinished checkpoint file: {orphan}" in proc.stdout
    assert not orphan.exists()
    records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3]


def test_step_checkpoint_mid_epoch_resumes_exactly_and_on_another_world_size(tmp_path):
    """Resume from a step checkpoint in the middle of an epoch: on the same world size bitwise equal
    to the uninterrupted run; on another world size the rest of that epoch's samples, once each."""
    common = ["train", SLOW, "--quiet", "--set", "train.epochs=2", "--set", "train.checkpoint_unit=step",
              "--set", "train.checkpoint_every=100", "--set", "train.keep=10"]
    full = tmp_path / "full"
    run(mpirun(2, *common, "--output-dir", str(full)), timeout=400)
    mid = next(p for p in list_checkpoints(full) if step_of(p) == 300)  # 250 steps/epoch on 2 ranks x 64
    meta = load(mid).meta
    assert meta["epoch"] == 1 and meta["offset"] == 50 * 128
    same = tmp_path / "same"
    run(mpirun(2, *common, "--output-dir", str(same), "--resume", str(mid)), timeout=400)
    bitwise_equal(full / "final.safetensors", same / "final.safetensors")
    other = tmp_path / "other"
    proc = run(hvtrain(*common, "--output-dir", str(other), "--resume", str(mid)), timeout=400)
    assert "world size changed 2 -> 1" in proc.stdout
    end = 300 + math.ceil((32000 - meta["offset"]) / 64)  # the epoch's remaining samples, 64 per step
    assert end in [step_of(p) for p in list_checkpoints(other)]
    end_meta = load(next(p for p in list_checkpoints(other) if step_of(p) == end)).meta
    assert end_meta["epoch"] == 2 and end_meta["offset"] == 0
    s = json.loads((other / "summary.json").read_text())
    assert s["world_size"] == 1 and s["val_accuracy"] > 0.8
