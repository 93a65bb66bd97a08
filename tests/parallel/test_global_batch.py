"""data.global_batch_size across world sizes (issue 24), real mpirun runs: one config trains to the
same weights on 1, 2 and 4 ranks, and a checkpoint made mid-epoch on 2 ranks resumes on 1 (and one
made on 1 resumes on 2) to the weights of the uninterrupted run, in both frameworks; with dropout,
whose masks are drawn per sample (train.randomness: per_sample, the default), and Adam with L2
weight decay (torch's start-up broadcast of the optimizer state once stepped every weight by ~lr on
N > 1 ranks and not on one: Horovod steps a fresh optimizer on zero gradients to make its state)."""

from __future__ import annotations

import pytest

from hvtrain.io.checkpoints import list_checkpoints, load, step_of
from tests.conftest import load_weights, max_abs_diff, run
from tests.support.launch import BACKENDS, mpirun

# digits: 1437 training rows, 23 steps of 64 an epoch (the last one 29 rows: its split over the
# ranks is uneven, and still the same step)
CONFIG = """name: gb
seed: 7
data: {dataset: 'sklearn:digits', global_batch_size: 64, normalize: standard}
model: {input_shape: [64], layers: [{type: dense, units: 32, activation: relu}, {type: dropout, rate: 0.25},
                                   {type: dense, units: 10}]}
optimizer: {name: adam, lr: 0.003, warmup_epochs: 1, weight_decay: 0.01}
train: {epochs: 3, threads: 1, checkpoint_unit: step, checkpoint_every: 10, keep: 20}
"""


def train(tmp_path, np_: int, name: str, backend: str, *extra: str) -> str:
    out = tmp_path / name
    proc = run(mpirun(np_, "train", str(tmp_path / "gb.yaml"), "--set", f"backend={backend}",
                      "--output-dir", str(out), *extra), timeout=400)
    return proc.stdout


def gap(tmp_path, a: str, b: str) -> float:
    return max_abs_diff(load_weights(tmp_path / a / "final.safetensors"), load_weights(tmp_path / b / "final.safetensors"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_global_batch_is_the_same_training_on_any_world_and_resumes_across_worlds(tmp_path, backend):
    (tmp_path / "gb.yaml").write_text(CONFIG)
    said = train(tmp_path, 2, "np2", backend)
    assert "global batch 64, 23 steps/epoch" in said and "dropout masks per sample" in said, said
    train(tmp_path, 1, "np1", backend)
    assert gap(tmp_path, "np1", "np2") <= 1e-6
    if backend == BACKENDS[0]:  # four ranks once: the derivation, not the framework, is what changes
        train(tmp_path, 4, "np4", backend)
        assert gap(tmp_path, "np1", "np4") <= 1e-6
    for made, resumed in (("np2", 1), ("np1", 2)):
        mid = next(p for p in list_checkpoints(tmp_path / made) if step_of(p) == 30)  # epoch 2, step 7 of 23
        assert load(mid).meta["offset"] == 7 * 64
        said = train(tmp_path, resumed, f"{made}-on-{resumed}", backend, "--resume", str(mid))
        was = 2 if made == "np2" else 1
        assert (f"world size changed {was} -> {resumed}: global batch 64 kept ({64 // was} -> {64 // resumed} per "
                "replica), the same data order, lr schedule and dropout masks (per sample)") in said, said
        assert gap(tmp_path, made, f"{made}-on-{resumed}") <= 1e-6, f"{made} resumed on {resumed} rank(s)"


def test_a_finished_global_batch_run_keeps_its_results_on_another_world_and_evaluates_on_any(tmp_path):
    """A requeue of a finished run on another node count: nothing retrained (the run's identity
    does not hold the derived per-replica batch); evaluate never needs the batch to split."""
    (tmp_path / "gb.yaml").write_text(CONFIG.replace("checkpoint_unit: step, checkpoint_every: 10, keep: 20",
                                                     "checkpoint_every: 0"))
    train(tmp_path, 1, "done", "torch")
    summary = (tmp_path / "done" / "summary.json").read_bytes()
    said = train(tmp_path, 2, "done", "torch", "--resume", "auto")
    assert "finished on this config and this data (summary.json, final.safetensors): its results are kept" in said, said
    assert (tmp_path / "done" / "summary.json").read_bytes() == summary
    proc = run(mpirun(3, "evaluate", str(tmp_path / "gb.yaml"), "--weights", str(tmp_path / "done" / "final.safetensors"),
                      "--output-dir", str(tmp_path / "eval")), timeout=300)
    assert "accuracy" in proc.stdout, proc.stdout
