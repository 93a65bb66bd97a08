"""Issue 21, "re-running any command on its own output", in one Python process: what the Python
API's user does (train, then predict and evaluate the weights just written)."""

from __future__ import annotations

import numpy as np

import hvtrain


def test_keras_entrypoint_model_trained_then_predicted_and_evaluated_in_one_process(tmp_path):
    """Keras names an unnamed model and its layers by a per-process counter: the model that
    hvtrain.predict built after hvtrain.train in the same process was `sequential_1/dense_2/...`,
    and the weights just saved (`sequential/dense/...`) were refused as not matching it."""
    cfg = {"name": "api-rerun", "seed": 3, "backend": "tensorflow",
           "data": {"dataset": "sklearn:digits", "batch_size": 32}, "loss": "cross_entropy",
           "model": {"entrypoint": "tests.fixtures.native_models:keras_mlp"},
           "optimizer": {"name": "adam", "lr": 0.003}, "train": {"epochs": 1, "threads": 1},
           "output_dir": str(tmp_path / "run")}
    summary = hvtrain.train(cfg, quiet=True)
    weights = str(tmp_path / "run" / "final.safetensors")
    result = hvtrain.evaluate(cfg, weights)
    assert result["val_accuracy"] == summary["val_accuracy"]
    assert abs(result["val_loss"] - summary["val_loss"]) < 1e-6
    from sklearn.datasets import load_digits

    x = load_digits().data[:7]
    p = np.asarray(hvtrain.predict(cfg, weights, x))
    assert p.shape == (7, 10)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-5)
    # a third build in the process: still the same weights
    np.testing.assert_array_equal(np.asarray(hvtrain.predict(cfg, weights, x)), p)
