"""The trainer's val_scores.npz (issue 12, item 4: the ROC curve's scores) in a real run: the last
evaluation's probabilities of every validation sample, equal to `hvtrain predict`'s, whose ROC AUC
is the run's val_roc_auc; and `hvtrain report` on that run draws every picture."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import hvtrain
from hvtrain.runtime.experiment import prepare
from hvtrain.tools.report import auc, roc_curve, write_report
from tests.support.launch import BACKENDS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_val_scores_are_the_last_evaluations_and_give_its_auc(tmp_path, backend):
    cfg = {"name": "scores", "backend": backend, "seed": 3,
           "data": {"dataset": "sklearn:digits", "batch_size": 64, "normalize": "standard"},
           "model": {"input_shape": [64], "layers": [{"type": "dense", "units": 16, "activation": "relu"},
                                                     {"type": "dense", "units": 10}]},
           "optimizer": {"name": "adam", "lr": 0.01}, "loss": "cross_entropy",
           "metrics": ["accuracy", "roc_auc"], "train": {"epochs": 2, "threads": 1}}
    out = tmp_path / "run"
    summary = hvtrain.train(cfg, output_dir=str(out), quiet=True)
    z = np.load(out / "val_scores.npz")
    data = prepare(cfg).data
    assert int(z["epoch"]) == 2 and z["scores"].shape == (len(data.val), 10)
    assert z["labels"].tolist() == data.val.y.tolist()
    raw = data.val.source.features(data.val.rows)
    np.testing.assert_allclose(z["scores"], hvtrain.predict(cfg, str(out / "final.safetensors"), raw), atol=1e-5)
    aucs = [auc(*roc_curve(z["scores"][:, k], z["labels"] == k)) for k in range(10)]
    assert np.mean(aucs) == pytest.approx(summary["val_roc_auc"], abs=1e-12)
    result = write_report(out)
    assert set(result["figures"]) == {"loss", "metrics", "confusion_matrix", "roc"}
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["val_roc_auc"] == summary["val_roc_auc"]


def test_a_run_without_roc_auc_leaves_no_stale_scores(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    np.savez(out / "val_scores.npz", scores=np.zeros((2, 10)), labels=np.zeros(2), epoch=np.array(9))
    hvtrain.train(str(ROOT / "examples/digits_mlp.yaml"), output_dir=str(out), overrides=["train.epochs=1"], quiet=True)
    assert not (out / "val_scores.npz").exists()
