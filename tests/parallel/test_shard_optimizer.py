"""train.shard_optimizer (issue 24 point 4, ZeRO stage 1 on Horovod), real mpirun runs: each rank
keeps half the optimizer state on 2 ranks, and the training is the unsharded one to 1e-6 (torch:
SGD with momentum, Adam with L2, AdamW; TensorFlow: Adam with L2, 2 accumulation steps); its
checkpoints hold the whole state in the unsharded layout, so one made sharded on 2 ranks resumes on
1 rank (sharded or not) and on 2, and an unsharded run's resumes sharded, to the uninterrupted
run's weights. A fusion threshold of 4 KiB cuts the 2,485 parameters into 3 chunks (one
reduce-scatter and one allgather each)."""

from __future__ import annotations

import json

import pytest

from hvtrain.io.checkpoints import list_checkpoints, step_of
from tests.conftest import hvtrain, load_weights, max_abs_diff, run
from tests.support.launch import mpirun

CONFIG = """name: zero
seed: 3
data: {{dataset: 'sklearn:digits', global_batch_size: 64, normalize: standard}}
model: {{input_shape: [64], layers: [{{type: dense, units: 33, activation: relu}}, {{type: dropout, rate: 0.2}},
                                    {{type: dense, units: 10}}]}}
optimizer: {optimizer}
horovod: {{fusion_threshold_mb: 0.004}}
train: {{epochs: 2, threads: 1, checkpoint_unit: step, checkpoint_every: 10, keep: 20}}
"""
SHARD = ["--set", "train.shard_optimizer=true"]


def weights_gap(a, b) -> float:
    return max_abs_diff(load_weights(a / "final.safetensors"), load_weights(b / "final.safetensors"))


def state_bytes(out) -> list[int]:
    return json.loads((out / "summary.json").read_text())["optimizer_state_bytes"]["ranks"]


SGD = "{name: sgd, lr: 0.05, momentum: 0.9}"
ADAM = "{name: adam, lr: 0.003, weight_decay: 0.01, warmup_epochs: 1}"
ADAMW = "{name: adamw, lr: 0.003, weight_decay: 0.05}"


@pytest.mark.parametrize(("backend", "optimizer", "accumulation"), [
    ("torch", SGD, 2), ("torch", ADAM, 1), ("torch", ADAMW, 1), ("tensorflow", ADAM, 2)])
def test_sharded_state_trains_the_unsharded_run_with_half_the_state_per_rank(tmp_path, backend, optimizer,
                                                                            accumulation):
    """accumulation 2: torch starts each chunk's reduce-scatter from a gradient hook, in the
    backward of the step's last micro-batch only."""
    config = tmp_path / "zero.yaml"
    config.write_text(f"backend: {backend}\n" + CONFIG.format(optimizer=optimizer))
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    acc = ["--set", f"train.grad_accumulation={accumulation}"]
    run(mpirun(2, "train", str(config), *acc, "--quiet", "--output-dir", str(whole)), timeout=300)
    run(mpirun(2, "train", str(config), *acc, *SHARD, "--quiet", "--output-dir", str(sharded)), timeout=300)
    assert weights_gap(whole, sharded) <= 1e-6
    full, half = state_bytes(whole), state_bytes(sharded)
    assert len(set(full)) == 1 and all(abs(h - full[0] / 2) <= 16 for h in half), (full, half)  # + step counts
    if optimizer != ADAM:
        return

    def mid(out):  # epoch 2, step 7 of 23
        return next(p for p in list_checkpoints(out) if step_of(p) == 30)

    for name, argv, made in (("one-sharded", hvtrain("train", str(config), *acc, *SHARD), sharded),
                             ("one-whole", hvtrain("train", str(config), *acc), sharded),
                             ("two-sharded", mpirun(2, "train", str(config), *acc, *SHARD), sharded),
                             ("two-sharded-from-whole", mpirun(2, "train", str(config), *acc, *SHARD), whole)):
        said = run([*argv, "--output-dir", str(tmp_path / name), "--resume", str(mid(made))], timeout=300).stdout
        assert "resumed from" in said, said
        assert weights_gap(whole, tmp_path / name) <= 1e-6, name


HYBRID = """name: zero-hybrid
seed: 5
data: {{dataset: 'sklearn:digits', global_batch_size: 64, normalize: minmax}}
model: {{input_shape: [64], layers: [{{type: dense, units: 48, activation: relu}}, {{type: dropout, rate: 0.2}},
                                    {{type: dense, units: 32, activation: relu}}, {{type: dense, units: 10}}]}}
parallel: {{pipeline: {{stages: 2, micro_batches: 2, placement: {{0: [0, 1], 1: [2, 3]}}}}}}
optimizer: {optimizer}
horovod: {{fusion_threshold_mb: 0.004}}
train: {{epochs: 1, threads: 1, checkpoint_unit: step, checkpoint_every: 10, keep: 5}}
"""


@pytest.mark.parametrize(("backend", "optimizer"), [("torch", ADAM), ("tensorflow", SGD)])
def test_a_hybrid_shards_each_stage_over_its_replicas(tmp_path, backend, optimizer):
    """2 stages x 2 replicas (np=4): each stage's state is cut over its two replicas (a Horovod
    process set each), the training is the unsharded hybrid's, and its checkpoint (each stage's
    whole state, gathered on the stage's first replica) resumes to the uninterrupted run's
    weights: cut again over the replicas (torch), and as a 2-rank pipeline without replicas (TF)."""
    config = tmp_path / "hybrid.yaml"
    config.write_text(f"backend: {backend}\n" + HYBRID.format(optimizer=optimizer))
    whole, sharded, resumed = tmp_path / "whole", tmp_path / "sharded", tmp_path / "resumed"
    run(mpirun(4, "train", str(config), "--quiet", "--output-dir", str(whole)), timeout=400)
    run(mpirun(4, "train", str(config), *SHARD, "--quiet", "--output-dir", str(sharded)), timeout=400)
    assert weights_gap(whole, sharded) <= 1e-6
    full, half = state_bytes(whole), state_bytes(sharded)
    assert all(abs(h - f / 2) <= 16 for f, h in zip(full, half, strict=True)) and min(half) > 0, (full, half)
    mid = next(p for p in list_checkpoints(sharded) if step_of(p) == 10)
    again = mpirun(4, "train", str(config), *SHARD) if backend == "torch" else mpirun(2, "train", str(config))
    said = run([*again, "--quiet", "--output-dir", str(resumed), "--resume", str(mid)], timeout=400).stdout
    assert weights_gap(sharded, resumed) <= 1e-6, said
