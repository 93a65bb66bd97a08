"""Weights move between frameworks: train in one, evaluate in the other (CLI, real runs)."""

import json

import numpy as np
import pytest

from hvtrain.model.weights import load_weights as load_neutral
from tests.conftest import hvtrain, run


@pytest.mark.parametrize("example,trained,evaluated", [
    ("digits_cnn", "torch", "tensorflow"), ("digits_cnn", "tensorflow", "torch"),
    ("digits_resnet", "torch", "tensorflow"), ("digits_transformer", "tensorflow", "torch"),
])
def test_trained_in_one_evaluated_in_the_other(tmp_path, example, trained, evaluated):
    train_dir, eval_dir = tmp_path / "train", tmp_path / "eval"
    config = f"examples/{example}.yaml"
    run(hvtrain("train", config, "--backend", trained, "--output-dir", str(train_dir),
                "--quiet", "--set", "train.epochs=4"))
    summary = json.loads((train_dir / "summary.json").read_text())
    # evaluated on 2 ranks: metrics reduced across ranks must still equal the 1-rank training figures
    run(hvtrain("launch", "-np", "2", "--", "evaluate", config, "--weights",
                str(train_dir / "final.safetensors"), "--backend", evaluated, "--output-dir", str(eval_dir)))
    result = json.loads((eval_dir / "eval.json").read_text())
    assert result["backend"] == evaluated and result["world_size"] == 2
    assert result["val_samples"] == summary["val_samples"] == 359
    assert result["val_accuracy"] == pytest.approx(summary["val_accuracy"], abs=1e-12)
    assert result["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-4)


def test_predictions_agree_across_frameworks(tmp_path):
    """Same neutral weights loaded into both frameworks: >= 99.9% identical predictions."""
    run(hvtrain("train", "examples/digits_mlp.yaml", "--output-dir", str(tmp_path), "--quiet",
                "--set", "train.epochs=3"))
    weights = load_neutral(str(tmp_path / "final.safetensors"))
    code = f"""
import numpy as np, sys
from mpi4py import MPI
from hvtrain.runtime.experiment import prepare
from hvtrain.runtime.session import Session
from safetensors.numpy import load_file
w = load_file({str(tmp_path / 'final.safetensors')!r})
preds = []
for name in ("torch", "tensorflow"):
    p = prepare("examples/digits_mlp.yaml", backend=name)
    with Session(p.cfg, p.spec) as s:
        s.backend.build(p.cfg, p.spec, w, p.data.num_outputs, s.runtime)
        preds.append(s.backend.predict(np.concatenate([p.data.x_train, p.data.x_val])))
np.save({str(tmp_path / 'preds.npy')!r}, np.stack(preds))
"""
    run(["python", "-c", code])
    preds = np.load(tmp_path / "preds.npy")
    agree = np.mean(preds[0].argmax(1) == preds[1].argmax(1))
    assert agree >= 0.999, agree
    assert np.abs(preds[0] - preds[1]).max() <= 1e-4
    assert len(weights) == 4
