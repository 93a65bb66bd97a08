"""Fine-tuning across frameworks (issue 12, item 6): trained on one task in one framework, fine-tuned
on another task in the other (model.init_from, init_skip for the new head, frozen layers), real runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hvtrain.io.checkpoints import list_checkpoints
from hvtrain.model.weights import read_weights
from tests.conftest import hvtrain, run

PRETRAIN = """name: pretrain
seed: 3
data: {{dataset: "npz:{data}/digits.npz", batch_size: 64}}
model:
  input_shape: [64]
  layers:
    - {{type: dense, units: 32, activation: relu, name: body}}
    - {{type: batchnorm, name: bn}}
    - {{type: dense, units: 16, activation: relu, name: mid}}
    - {{type: dense, units: 10, name: head}}
optimizer: {{name: adam, lr: 0.01}}
train: {{epochs: 2, checkpoint_every: 2}}
"""

# Another task on the same pixels: odd or even digit. The body and its batchnorm are frozen, the
# middle layer starts from the pretrained one and trains, the 2-class head starts from its seed.
FINETUNE = """name: finetune
seed: 8
data: {{dataset: "npz:{data}/parity.npz", batch_size: 64}}
model:
  input_shape: [64]
  init_from: {init_from}
  init_skip: [head]
  layers:
    - {{type: dense, units: 32, activation: relu, name: body, trainable: false}}
    - {{type: batchnorm, name: bn, trainable: false}}
    - {{type: dense, units: 16, activation: relu, name: mid}}
    - {{type: dense, units: 2, name: head}}
optimizer: {{name: adam, lr: 0.01}}
train: {{epochs: 3}}
"""


@pytest.mark.parametrize("pretrained,finetuned,source,ranks", [("torch", "tensorflow", "final", 2),
                                                                ("tensorflow", "torch", "checkpoint", 1)])
def test_fine_tuned_in_the_other_framework_frozen_layers_bitwise(tmp_path, pretrained, finetuned, source, ranks):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    np.savez(tmp_path / "digits.npz", x=x, y=y)
    np.savez(tmp_path / "parity.npz", x=x, y=np.where(y % 2 == 1, "odd", "even"))
    (tmp_path / "pre.yaml").write_text(PRETRAIN.format(data=tmp_path))
    run(hvtrain("train", str(tmp_path / "pre.yaml"), "--backend", pretrained, "--output-dir", str(tmp_path / "a"),
                "--quiet"))
    start = str(tmp_path / "a/final.safetensors") if source == "final" else str(list_checkpoints(tmp_path / "a")[0])
    (tmp_path / "ft.yaml").write_text(FINETUNE.format(data=tmp_path, init_from=start))
    argv = ["train", str(tmp_path / "ft.yaml"), "--backend", finetuned, "--output-dir", str(tmp_path / "b")]
    proc = run(hvtrain(*argv) if ranks == 1 else hvtrain("launch", "-np", str(ranks), "--", *argv))
    assert "layers body, bn, mid loaded; head seeded; frozen: body, bn" in proc.stdout

    a, b = read_weights(start).weights, read_weights(tmp_path / "b/final.safetensors").weights
    frozen = [k for k in a if k.startswith(("layers.0.", "layers.1."))]
    assert len(frozen) == 6  # body kernel, bias; bn gamma, beta, moving mean and variance
    for k in frozen:
        assert np.array_equal(a[k], b[k]), f"{k} changed although its layer is frozen"
    assert not np.array_equal(a["layers.2.kernel"], b["layers.2.kernel"])  # mid: loaded, then trained
    assert b["layers.3.kernel"].shape == (16, 2)
    summary = json.loads((tmp_path / "b/summary.json").read_text())
    assert summary["backend"] == finetuned and summary["world_size"] == ranks
    assert summary["val_accuracy"] >= 0.9, summary["val_accuracy"]
