"""What the backends compute when they train, in one process through the Python API (the real loop,
the real framework; the multi-process proofs of the same runs are in tests/parallel): every loss
learns, accumulated micro-batches equal one larger batch, and weights move between frameworks."""

from __future__ import annotations

import numpy as np
import pytest

import hvtrain
from hvtrain.config.load import load_config
from hvtrain.data.dataset import load_dataset
from tests.conftest import load_weights, max_abs_diff
from tests.support.launch import BACKENDS

EQUIV = "tests/configs/equiv_mlp.yaml"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss,dataset,features,metric,target", [
    ("binary_cross_entropy", "sklearn:breast_cancer", 30, "val_accuracy", 0.9),
    ("mse", "synthetic:regression", 10, "val_mse", 0.01),
    ("mae", "synthetic:regression", 10, "val_mae", 0.1),
])
def test_every_loss_trains_end_to_end(tmp_path, backend, loss, dataset, features, metric, target):
    """binary_cross_entropy, mse and mae (a regression dataset), both frameworks."""
    cfg = {"name": loss, "seed": 3, "backend": backend, "loss": loss,
           "data": {"dataset": dataset, "samples": 2000, "features": features, "batch_size": 32},
           "model": {"input_shape": [features], "layers": [{"type": "dense", "units": 32, "activation": "relu"},
                                                           {"type": "dense", "units": 1}]},
           "optimizer": {"name": "adam", "lr": 1e-2}, "train": {"epochs": 15, "threads": 1}}
    s = hvtrain.train(cfg, output_dir=str(tmp_path), quiet=True)
    if metric == "val_accuracy":
        assert s[metric] >= target, s
    else:  # regression: the error is a small fraction of the target's spread (variance for mse, std for mae)
        y = load_dataset(load_config(cfg)).y_val
        spread = float(np.var(y)) if metric == "val_mse" else float(np.std(y))
        assert s[metric] <= target * spread, (s, spread)
        assert "val_accuracy" not in s and {"val_mse", "val_mae"} <= set(s)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_accumulation_equals_a_larger_batch(tmp_path, backend):
    """Batch 32 with 2 accumulated micro-batches per step is batch 64 (SGD with momentum, one epoch)."""
    hvtrain.train(EQUIV, backend=backend, output_dir=str(tmp_path / "b64"), overrides=["data.batch_size=64"],
                  quiet=True)
    hvtrain.train(EQUIV, backend=backend, output_dir=str(tmp_path / "acc"), overrides=["train.grad_accumulation=2"],
                  quiet=True)
    diff = max_abs_diff(load_weights(tmp_path / "acc/final.safetensors"), load_weights(tmp_path / "b64/final.safetensors"))
    assert diff <= 1e-5, f"{backend}: batch 32 x 2 accumulation vs batch 64 differ by {diff}"


@pytest.mark.parametrize("example,trained,evaluated", [
    ("digits_cnn", "torch", "tensorflow"), ("digits_cnn", "tensorflow", "torch"),
    ("digits_resnet", "torch", "tensorflow"), ("digits_transformer", "tensorflow", "torch"),
])
def test_trained_in_one_framework_evaluated_in_the_other(tmp_path, example, trained, evaluated):
    """Weights move between frameworks (the neutral layout): the other framework's evaluation of
    the final weights gives the trained run's own validation figures. Through the CLI (a checkpoint
    evaluated by the other framework, predictions on 2 ranks): tests/parallel/test_predict.py."""
    config = f"examples/{example}.yaml"
    s = hvtrain.train(config, backend=trained, output_dir=str(tmp_path / "train"), overrides=["train.epochs=4"],
                      quiet=True)
    e = hvtrain.evaluate(config, str(tmp_path / "train/final.safetensors"), backend=evaluated,
                         output_dir=str(tmp_path / "eval"))
    assert e["backend"] == evaluated and e["val_samples"] == s["val_samples"] == 359
    assert e["val_accuracy"] == pytest.approx(s["val_accuracy"], abs=1e-12)
    assert e["val_loss"] == pytest.approx(s["val_loss"], rel=1e-4)


def test_predictions_agree_across_frameworks(tmp_path):
    """The same neutral weights loaded into both frameworks: >= 99.9% identical predictions, logits
    within 1e-4."""
    from sklearn.datasets import load_digits

    hvtrain.train("examples/digits_mlp.yaml", output_dir=str(tmp_path), overrides=["train.epochs=3"], quiet=True)
    x = load_digits().data
    preds = [np.asarray(hvtrain.predict("examples/digits_mlp.yaml", str(tmp_path / "final.safetensors"), x,
                                        backend=name, kind="logits")) for name in BACKENDS]
    assert np.mean(preds[0].argmax(1) == preds[1].argmax(1)) >= 0.999
    assert np.abs(preds[0] - preds[1]).max() <= 1e-4
    assert len(load_weights(tmp_path / "final.safetensors")) == 4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_on_nan_skip_skips_an_inf_loss_whose_gradients_are_finite(tmp_path, backend, accumulation):
    """Defect: on_nan: skip decided on the gradients alone. A target of 1e30 (finite: the data
    checks pass it) has an inf squared error but a finite gradient (-6e28), so its update was
    applied: the weights jumped by ~1e26 and every later step's loss was inf too (skipped: the
    epoch's train_loss read 0.0, val_loss inf). Its update is skipped now; the rest learns. R2's
    centre is the training targets' median (their mean, 1e30 / n, cancelled SS_tot: val_r2 0.0)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((600, 8)).astype(np.float32)
    y = (x @ rng.standard_normal(8).astype(np.float32) / 3).astype(np.float32)
    y[5] = 1e30  # a training row (seed 3's split)
    cfg = {"name": "outlier", "seed": 3, "backend": backend, "loss": "mse", "metrics": ["r2"],
           "data": {"validation_split": 0.2, "batch_size": 32},
           "model": {"input_shape": [8], "layers": [{"type": "dense", "units": 16, "activation": "relu"},
                                                   {"type": "dense", "units": 1}]},
           "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9},
           "train": {"epochs": 4, "on_nan": "skip", "grad_accumulation": accumulation, "threads": 1}}
    s = hvtrain.train(cfg, data=(x, y), output_dir=str(tmp_path), quiet=True)
    assert np.isfinite(s["val_loss"]) and s["val_r2"] > 0.9 and s["train_loss"] > 0, s
    assert all(np.isfinite(v).all() for v in load_weights(tmp_path / "final.safetensors").values())
