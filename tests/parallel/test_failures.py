"""Every rank speaks for itself, before and after Horovod starts, in every whole-job command
(issue 8: an error on a rank other than 0 was printed by rank 0 only, or not at all)."""

from __future__ import annotations

import time

from tests.conftest import hvtrain, run, tool

MLP = "examples/digits_mlp.yaml"


def mpmd(rank0: list[str], rank1: list[str]) -> list[str]:
    return [tool("mpirun"), "--oversubscribe", "--bind-to", "none", "-np", "1", *rank0, ":", "-np", "1", *rank1]


def ends_fast_naming_rank_1(argv: list[str], message: str) -> str:
    started = time.time()
    proc = run(argv, check=False, timeout=120)
    assert time.time() - started < 60, "the job must end within 60 s"
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    errors = [ln for ln in text.splitlines() if "hvtrain: error:" in ln]
    assert any(ln.startswith("hvtrain: error: rank 1 of 2: ") and message in ln for ln in errors), text[-3000:]
    assert not any("rank 0 of 2" in ln for ln in errors), errors  # rank 0 had nothing wrong
    assert "Traceback" not in text
    return text


def test_train_with_a_dataset_missing_on_one_node(tmp_path):
    base = hvtrain("train", MLP, "--quiet", "--output-dir", str(tmp_path))
    ends_fast_naming_rank_1(mpmd(base, [*base, "--set", f"data.dataset=csv:{tmp_path}/only-on-node-0.csv"]),
                            "data.dataset: dataset file not found")


def test_evaluate_with_weights_missing_on_one_node(tmp_path):
    run(hvtrain("train", MLP, "--quiet", "--set", "train.epochs=1", "--output-dir", str(tmp_path)))
    base = hvtrain("evaluate", MLP, "--output-dir", str(tmp_path))
    ends_fast_naming_rank_1(mpmd([*base, "--weights", str(tmp_path / "final.safetensors")],
                                 [*base, "--weights", str(tmp_path / "elsewhere.safetensors")]),
                            "weights file not found")


def test_pipeline_planning_that_fails_on_one_node(tmp_path):
    base = hvtrain("train", "examples/digits_pipeline.yaml", "--quiet", "--output-dir", str(tmp_path))
    ends_fast_naming_rank_1(mpmd(base, [*base, "--set", "parallel.pipeline.devices={1: 'cuda:1'}"]),
                            "device 'cuda:1' does not exist on this host")
