"""`hvtrain predict` in real runs (issue 12, item 3): trained by `hvtrain train`, predicted at np=1
and np=2 (hvtrain launch and mpirun) in both frameworks, with the training data gone."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from hvtrain.io.checkpoints import list_checkpoints
from hvtrain.model.weights import read_weights
from hvtrain.runtime.experiment import prepare
from tests.conftest import hvtrain, run, tool

CFG = """name: predict
seed: 3
data: {{dataset: "npz:{data}", batch_size: 64, normalize: standard}}
model:
  input_shape: [8, 8, 1]
  layers:
    - {{type: flatten}}
    - {{type: dense, units: 16, activation: relu}}
    - {{type: dense, units: 10}}
optimizer: {{name: adam, lr: 0.01}}
train: {{epochs: 2, checkpoint_every: 2}}
"""

API = """
import sys
import numpy as np
import yaml
import hvtrain
cfg, weights, x, out, backend = sys.argv[1:]
logits = hvtrain.predict(cfg, weights, np.load(x, mmap_mode="r"), kind="logits", backend=backend, batch_size=100)
without_data = {k: v for k, v in yaml.safe_load(open(cfg)).items() if k != "data"}  # not needed to predict
labels = hvtrain.predict(without_data, weights, x, kind="labels", backend=backend)
np.save(out, logits)
np.save(out.replace(".npy", "-labels.npy"), labels)
"""


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z.astype(np.float64) - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("trained,other,launcher", [("torch", "tensorflow", "launch"),
                                                    ("tensorflow", "torch", "mpirun")])
def test_predict_equals_evaluate_and_the_api_in_order_on_1_and_2_ranks(tmp_path, trained, other, launcher):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    names = np.array([f"digit-{d}" for d in y])  # the dataset's own label values come back
    np.savez(tmp_path / "digits.npz", x=x, y=names)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CFG.format(data=tmp_path / "digits.npz"))
    out = tmp_path / "run"
    run(hvtrain("train", str(cfg), "--backend", trained, "--output-dir", str(out), "--quiet"))
    final = str(out / "final.safetensors")
    run(hvtrain("evaluate", str(cfg), "--weights", final, "--backend", trained, "--output-dir", str(tmp_path / "ev")))
    p = prepare(str(cfg))
    x_val, y_val = p.data.val.source.features(p.data.val.rows), p.data.classes[p.data.val.y]
    np.save(tmp_path / "xval.npy", x_val)
    header = ",".join(f"pixel{i}" for i in range(64))
    np.savetxt(tmp_path / "xval.csv", x_val, delimiter=",", header=header, comments="", fmt="%.1f")
    ckpt = str(list_checkpoints(out)[0])  # written at the last epoch: the final weights
    run(hvtrain("evaluate", str(cfg), "--weights", ckpt, "--backend", other, "--output-dir", str(tmp_path / "evc")))
    (tmp_path / "digits.npz").unlink()  # predict needs no training data
    ev = json.loads((tmp_path / "ev/eval.json").read_text())
    assert json.loads((tmp_path / "evc/eval.json").read_text())["val_accuracy"] == ev["val_accuracy"]

    def predict(*args: str, ranks: int = 1, weights: str = final, backend: str = trained) -> None:
        argv = ["predict", str(cfg), "--weights", weights, "--backend", backend, *args]
        if ranks == 1:
            run(hvtrain(*argv))
        elif launcher == "launch":
            run(hvtrain("launch", "-np", "2", "--", *argv))
        else:
            run([tool("mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none", *hvtrain(*argv)])

    predict("--input", str(tmp_path / "xval.npy"), "--output", str(tmp_path / "p1.npy"),
            "--labels", str(tmp_path / "l1.npy"))
    # 2 ranks, CSV with a header, 50 rows per rank per round: 4 rounds, the last one uneven
    predict("--input", str(tmp_path / "xval.csv"), "--output", str(tmp_path / "z2.npy"), "--logits",
            "--batch-size", "50", ranks=2)
    predict("--input", str(tmp_path / "xval.npy"), "--output", str(tmp_path / "zo.npy"), "--logits",
            weights=ckpt, backend=other)  # from a checkpoint, in the other framework
    script = tmp_path / "api.py"
    script.write_text(API)
    run([sys.executable, str(script), str(cfg), final, str(tmp_path / "xval.npy"), str(tmp_path / "za.npy"), trained])

    p1, labels, z2 = np.load(tmp_path / "p1.npy"), np.load(tmp_path / "l1.npy"), np.load(tmp_path / "z2.npy")
    za, zo = np.load(tmp_path / "za.npy"), np.load(tmp_path / "zo.npy")
    n = len(x_val)
    assert p1.shape == z2.shape == za.shape == zo.shape == (n, 10) and p1.dtype == np.float32
    assert np.allclose(p1.sum(axis=1), 1, atol=1e-6)
    # the numbers of `hvtrain evaluate` on the same rows
    assert labels.dtype.kind == "U" and labels[0].startswith("digit-")
    assert np.mean(labels == y_val) == ev["val_accuracy"]
    loss = -np.mean(np.log(softmax(z2)[np.arange(n), p.data.val.y]))
    assert loss == pytest.approx(ev["val_loss"], rel=1e-5)
    # row for row (order kept on 2 ranks), the CLI equals the Python API
    assert np.abs(z2 - za).max() <= 1e-5 and np.abs(softmax(za) - p1).max() <= 1e-6
    assert np.array_equal(np.load(tmp_path / "za-labels.npy"), labels)
    # weights are neutral: the other framework, from the checkpoint, predicts the same
    c, f = read_weights(ckpt).weights, read_weights(final).weights
    assert sorted(c) == sorted(f) and all(np.array_equal(c[k], f[k]) for k in f)
    assert np.abs(zo - za).max() <= 1e-5


def test_a_pipelined_checkpoint_holds_every_stages_weights(tmp_path):
    """Each stage's first rank adds its weights: the checkpoint holds the whole model, as final does."""
    run([tool("mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none",
         *hvtrain("train", "examples/digits_pipeline.yaml", "--output-dir", str(tmp_path), "--quiet",
                  "--set", "train.epochs=1", "--set", "train.checkpoint_every=1")])
    c, f = read_weights(list_checkpoints(tmp_path)[0]), read_weights(tmp_path / "final.safetensors")
    assert len(f.weights) == 8 and sorted(c.weights) == sorted(f.weights)
    assert all(np.array_equal(c.weights[k], f.weights[k]) for k in f.weights)
    assert c.inputs.features == f.inputs.features == (64,) and c.inputs.classes.tolist() == list(range(10))
