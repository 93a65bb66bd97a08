"""Issue 21, the native-model output contract on 2 real ranks (mpirun): a Keras softmax-head model
and a torch model with a 1-D output train right, and predict gives the softmax head's own
probabilities (tests/backends/test_defects_models.py has the one-process checks)."""

from __future__ import annotations

import json

import numpy as np
import yaml

from tests.conftest import hvtrain, run
from tests.support.launch import mpirun

FIXTURE = "tests.fixtures.user_models"


def write(tmp_path, cfg: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_defect_02_keras_softmax_head_trains_on_two_ranks_and_predicts_its_probabilities(tmp_path):
    """Before: val_loss ~1.5 at 97% accuracy (softmax applied twice), predictions squashed toward
    uniform (mean top probability ~0.23)."""
    cfg = write(tmp_path, {"name": "softmax-head", "backend": "tensorflow", "seed": 3,
                           "data": {"dataset": "sklearn:digits", "batch_size": 32},
                           "model": {"entrypoint": f"{FIXTURE}:keras_softmax_head"},
                           "optimizer": {"name": "adam", "lr": 0.003}, "train": {"epochs": 6, "threads": 1}})
    out = tmp_path / "run"
    proc = run(mpirun(2, "train", cfg, "--output-dir", str(out)), timeout=120)
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2 and s["replicas_agree"], s
    assert s["val_loss"] < 0.3 and s["val_accuracy"] > 0.93, s
    assert proc.stdout.count("trained on the input of its final softmax") == 1  # rank 0 says it once
    from sklearn.datasets import load_digits

    np.save(tmp_path / "x.npy", load_digits().data[:200].astype(np.float32))
    run(hvtrain("predict", cfg, "--weights", str(out / "final.safetensors"), "--input", str(tmp_path / "x.npy"),
                "--output", str(tmp_path / "p.npy")), timeout=120)
    p = np.load(tmp_path / "p.npy")
    np.testing.assert_allclose(p.sum(axis=1), 1, atol=1e-5)
    assert p.max(axis=1).mean() > 0.85  # the model's own confident probabilities, not softmax(probabilities)
    assert np.mean(p.argmax(axis=1) == load_digits().target[:200]) > 0.93


def test_defect_03_torch_one_dimensional_output_trains_on_two_ranks(tmp_path):
    """Before: `out.squeeze(-1)` trained on a [batch]-[batch, 1] broadcast loss and learned the
    batch mean (val_r2 0.05)."""
    cfg = write(tmp_path, {"name": "squeezed", "backend": "torch", "seed": 9, "loss": "mse", "metrics": ["mse", "r2"],
                           "data": {"dataset": "synthetic:regression", "samples": 997, "features": 8,
                                    "validation_split": 0.2, "batch_size": 32},
                           "model": {"entrypoint": f"{FIXTURE}:torch_squeezed_regressor"},
                           "optimizer": {"name": "adam", "lr": 0.01}, "train": {"epochs": 5, "threads": 1}})
    out = tmp_path / "run"
    run(mpirun(2, "train", cfg, "--quiet", "--output-dir", str(out)), timeout=120)
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2 and s["replicas_agree"], s
    assert s["val_r2"] > 0.95, s
