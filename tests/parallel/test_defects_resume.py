"""Issue 21, re-running on a finished run, on two real ranks: the requeue script's `--resume auto`."""

from __future__ import annotations

import json

from tests.conftest import run
from tests.support.launch import mpirun

MLP = "examples/digits_mlp.yaml"
SET = ["--quiet", "--set", "train.epochs=1", "--set", "train.checkpoint_every=1", "--set", "metrics=[accuracy,roc_auc]"]
KEPT = ("summary.json", "final.safetensors", "val_scores.npz", "metrics.jsonl")


def test_defect_06_resume_auto_on_a_finished_two_rank_run_keeps_its_results(tmp_path):
    """Defect: the re-run loaded the final checkpoint, trained nothing, rewrote summary.json with
    train_loss null and no val metrics and deleted val_scores.npz (exit 0). Now it says the run is
    finished, exits 0, and every result file is byte for byte the first run's."""
    run(mpirun(2, "train", MLP, *SET, "--output-dir", str(tmp_path)))
    before = {name: (tmp_path / name).read_bytes() for name in KEPT}
    summary = json.loads(before["summary.json"])
    assert summary["world_size"] == 2 and summary["train_loss"] > 0 and summary["val_accuracy"] > 0.8
    proc = run(mpirun(2, "train", MLP, *SET, "--output-dir", str(tmp_path), "--resume", "auto"))
    after = {name: (tmp_path / name).read_bytes() if (tmp_path / name).exists() else None for name in KEPT}
    assert after == before, json.loads(after["summary.json"])
    assert "the run is finished and its results in" in proc.stdout, proc.stdout
    assert proc.stdout.count("the run is finished") == 1  # rank 0 says it
