"""Pipelines get everything the data-parallel loop does, by the same code (issue 8): precision,
per-rank RNG, step checkpoints with exact mid-epoch resume, on_nan, fp16 loss scaling."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from hvtrain.io.checkpoints import list_checkpoints, load, step_of
from tests.conftest import hvtrain, load_weights, max_abs_diff, run
from tests.support.checks import bitwise_equal, kill_after_checkpoint
from tests.support.launch import BACKENDS, mpirun

PIPE = "examples/digits_pipeline.yaml"
DROPOUT = "tests/configs/dropout_pipeline.yaml"
PLAIN = ["--set", "train.epochs=1", "--set", "optimizer.momentum=0", "--quiet"]


def summary(d) -> dict:
    return json.loads((d / "summary.json").read_text())


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_pipeline_matches_unpipelined_bf16(tmp_path, backend):
    """Defect: pipelines ignored train.precision silently (they trained in fp32)."""
    b = ["--backend", backend, *PLAIN, "--set", "train.precision=bf16"]
    run(hvtrain("train", PIPE, *b, "--set", "parallel.pipeline.stages=1", "--output-dir", str(tmp_path / "flat")))
    run(mpirun(2, "train", PIPE, *b, "--output-dir", str(tmp_path / "pipe")), timeout=300)
    run(hvtrain("train", PIPE, "--backend", backend, *PLAIN, "--set", "parallel.pipeline.stages=1",
                "--output-dir", str(tmp_path / "fp32")))
    flat, pipe = load_weights(tmp_path / "flat/final.safetensors"), load_weights(tmp_path / "pipe/final.safetensors")
    fp32 = load_weights(tmp_path / "fp32/final.safetensors")
    gap, to_fp32 = max_abs_diff(pipe, flat), max_abs_diff(pipe, fp32)
    # bf16 keeps 8 mantissa bits (eps 3.9e-3); micro-batched matmuls round differently than whole ones
    assert gap <= 5e-3 and gap < to_fp32, f"{backend}: pipelined bf16 vs unpipelined bf16 {gap}, vs fp32 {to_fp32}"
    # an fp32 pipeline matches the fp32 run to 1e-5 (test_pipeline): this one computed in bf16
    assert to_fp32 > 1e-3, f"{backend}: precision was not applied ({to_fp32})"
    assert summary(tmp_path / "pipe")["val_accuracy"] > 0.8  # one epoch of plain SGD


@pytest.mark.parametrize("backend", BACKENDS)
def test_hybrid_dropout_masks_differ_per_rank_and_resume_mid_epoch_is_bitwise(tmp_path, backend):
    """Defects: pipeline ranks never seeded the framework RNG (torch replicas shared dropout masks),
    checkpointed only at epoch ends, and resumed only there. The pipeline's resume proof (each
    backend): bitwise the uninterrupted run, and a resume under another placement is refused.
    Under train.randomness: per_rank, the frameworks' streams (per_sample draws no stream at all:
    test_per_sample_dropout)."""
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["train", DROPOUT, "--backend", backend, "--quiet", "--set", "train.epochs=3",
              "--set", "train.randomness=per_rank"]
    run(mpirun(4, *common, "--output-dir", str(full)), timeout=400)
    steps_per_epoch = -(-1438 // 32)  # 2 replicas x 16
    # checkpoints every 7 steps, and no epoch end (45, 90, 135) is a multiple of 7: the newest is mid-epoch
    kill_after_checkpoint(mpirun(4, *common, "--output-dir", str(part)), part, steps_per_epoch)
    ckpt = load(next(p for p in list_checkpoints(part) if step_of(p) % steps_per_epoch))  # a mid-epoch one
    assert 0 < ckpt.meta["offset"] < 1438
    rngs = [b"".join(v.tobytes() for k, v in sorted(ckpt.tensors.items()) if k.startswith(f"rng.rank{r}."))
            for r in range(4)]
    assert all(rngs) and len(set(rngs)) == 4, "every rank (each replica of each stage) has its own random stream"
    proc = run(mpirun(4, *common, "--output-dir", str(part), "--resume", "auto"), timeout=400)
    resumed = re.search(r"resumed from \S+ \(epoch (\d+), step (\d+)\)", proc.stdout)
    assert resumed and int(resumed.group(2)) % steps_per_epoch, f"must resume mid-epoch: {proc.stdout}"
    bitwise_equal(full / "final.safetensors", part / "final.safetensors")
    records = [json.loads(ln) for ln in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(1, 4))
    s = summary(part)
    assert s["replicas_agree"] and s["resumed_from"] and s["pipeline"]["replicas"] == 2
    # a different placement cannot silently load another layout's stage states
    bad = run(mpirun(4, *common, "--set", "train.epochs=4", "--set", "parallel.pipeline.placement={0: [0, 0], 1: [1, 4]}",
                     "--output-dir", str(part), "--resume", "auto"), check=False, timeout=300)
    assert bad.returncode != 0 and "resume with the same placement" in bad.stdout + bad.stderr, bad.stderr[-2000:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_pipeline_with_loss_scaling_learns(tmp_path, backend):
    run(mpirun(2, "train", PIPE, "--backend", backend, "--quiet", "--set", "train.epochs=4",
               "--set", "train.precision=fp16", "--output-dir", str(tmp_path)), timeout=300)
    s = summary(tmp_path)
    assert s["val_accuracy"] > 0.9 and np.isfinite(s["train_loss"])


def test_pipeline_on_nan_skip_skips_on_every_stage(tmp_path):
    """Defect: pipelines could not `on_nan: skip`. One outlier target (an inf MSE, on the last
    stage): its step is skipped on every rank (same decision everywhere), the rest trains, nothing
    non-finite is written."""
    from tests.support.checks import regression_npy_with_outlier

    dataset = regression_npy_with_outlier(tmp_path / "data")
    args = ["train", PIPE, "--quiet", "--set", f"data.dataset={dataset}", "--set", "loss=mse",
            "--set", "metrics=[r2]", "--set", "model.layers.3.units=1", "--set", "optimizer.lr=0.01",
            "--set", "train.epochs=3"]
    stop = run(mpirun(2, *args, "--output-dir", str(tmp_path / "stop")), check=False, timeout=300)
    assert stop.returncode != 0 and "hvtrain: error: rank 1 of 2: non-finite loss at epoch 1" in stop.stderr, stop.stderr[-2000:]
    for accumulation in (1, 2):  # 2: the inf loss in the step's first batch, its update in the second's call
        out = tmp_path / f"skip{accumulation}"
        run(mpirun(2, *args, "--set", "train.on_nan=skip", "--set", f"train.grad_accumulation={accumulation}",
                   "--output-dir", str(out)), timeout=300)
        weights = load_weights(out / "final.safetensors")
        assert all(np.isfinite(v).all() for v in weights.values())
        s = summary(out)
        assert s["replicas_agree"] and s["val_r2"] > 0.9, (accumulation, s)
