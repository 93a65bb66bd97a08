"""Graph models (issue 9): residual and attention examples on 2 ranks in both frameworks, and
pipelines whose stage boundaries carry skip connections."""

from __future__ import annotations

import json

import pytest

from tests.conftest import hvtrain, load_weights, max_abs_diff, run
from tests.support.launch import mpirun

SKIPS = "tests/configs/residual_pipeline.yaml"


def summary(d) -> dict:
    return json.loads((d / "summary.json").read_text())


@pytest.mark.parametrize(("example", "backend"), [("digits_resnet", "tensorflow"), ("digits_transformer", "torch")])
def test_graph_examples_reach_accuracy_on_two_ranks(tmp_path, backend, example):
    """Each graph example in one framework here; the other pair trains (and moves across frameworks)
    in tests/backends/test_training_math.py."""
    run(mpirun(2, "train", f"examples/{example}.yaml", "--backend", backend, "--quiet", "--output-dir",
               str(tmp_path)), timeout=600)
    s = summary(tmp_path)
    assert s["world_size"] == 2 and s["replicas_agree"] and s["val_accuracy"] >= 0.95, s


@pytest.mark.parametrize(("backend", "schedule"), [("torch", "gpipe"), ("tensorflow", "1f1b")])
def test_skips_across_stage_boundaries_give_the_unpipelined_weights(tmp_path, backend, schedule):
    """3 stages; the cuts carry a skip connection, a residual sum and the model input itself. Each
    schedule once (gpipe and 1f1b give the same update: tests/backends/test_stage.py)."""
    b = ["--backend", backend, "--quiet", "--set", f"parallel.pipeline.schedule={schedule}"]
    run(hvtrain("train", SKIPS, *b, "--set", "parallel.pipeline.stages=1", "--output-dir", str(tmp_path / "flat")))
    run(mpirun(3, "train", SKIPS, *b, "--output-dir", str(tmp_path / "pipe")), timeout=300)
    s = summary(tmp_path / "pipe")
    assert s["pipeline"]["stages"] == 3 and s["world_size"] == 3
    gap = max_abs_diff(load_weights(tmp_path / "pipe/final.safetensors"), load_weights(tmp_path / "flat/final.safetensors"))
    assert gap <= 1e-5, f"{backend} {schedule}: {gap}"


def test_resnet_example_pipelined_on_two_stages(tmp_path):
    """`auto` placement cuts inside a residual block: the boundary carries the block input too."""
    run(mpirun(2, "train", "examples/digits_resnet.yaml", "--quiet", "--set", "parallel.pipeline.stages=2",
               "--output-dir", str(tmp_path)), timeout=600)
    s = summary(tmp_path)
    assert s["pipeline"]["stages"] == 2 and s["val_accuracy"] >= 0.95, s
