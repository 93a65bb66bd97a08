"""webdataset: and parquet: runs, in process, on every backend (issue 23): each trains to the weights
of the same decoded arrays handed over in memory; augmentation feeds both frameworks the same
rows; data.workers processes give the batches the training thread would have read."""

from __future__ import annotations

import json

import numpy as np
import pytest

import hvtrain
from tests.conftest import load_weights, max_abs_diff
from tests.support.data import digits_parquet, digits_webdataset

MODEL = {"input_shape": [8, 8, 1], "layers": [{"type": "flatten"}, {"type": "dense", "units": 32,
         "activation": "relu"}, {"type": "dense", "units": 10}]}
AUGMENT = {"crop_padding": 1, "flip": "horizontal", "brightness": 0.2, "contrast": 0.2, "resized_crop": [0.6, 1.0]}


def cfg(tmp_path, name: str, backend: str, lr: float = 0.05, epochs: int = 2, **data) -> dict:
    return {"name": name, "seed": 4, "backend": backend,
            "data": {"batch_size": 16, "image": {"size": [8, 8], "channels": 1}, **data},
            "model": MODEL, "optimizer": {"name": "sgd", "lr": lr, "momentum": 0.9},
            "train": {"epochs": epochs, "threads": 1}, "output_dir": str(tmp_path / name)}


def weights(tmp_path, name: str) -> dict:
    return load_weights(tmp_path / name / "final.safetensors")


def test_webdataset_and_parquet_train_like_their_arrays_in_memory(tmp_path, backend_name):
    x, y = digits_webdataset(tmp_path / "wds", 400, shards=3)
    px, py = digits_parquet(tmp_path / "pq", 400, files=2, row_group=64, layout="image")
    np.testing.assert_array_equal(px, x)
    runs = {"wds": hvtrain.train(cfg(tmp_path, "wds", backend_name, dataset=f"webdataset:{tmp_path}/wds/*.tar"),
                                 quiet=True),
            "pq": hvtrain.train(cfg(tmp_path, "pq", backend_name, dataset=f"parquet:{tmp_path}/pq/*.parquet",
                                    image={"size": [8, 8], "channels": 1, "column": "image"}), quiet=True),
            "memory": hvtrain.train(cfg(tmp_path, "memory", backend_name), data=(x, y), quiet=True)}
    for name in ("wds", "pq"):
        gap = max_abs_diff(weights(tmp_path, "memory"), weights(tmp_path, name))
        assert gap <= 1e-6, f"{backend_name}: {name} differs from its arrays in memory by {gap}"
        assert runs[name]["val_accuracy"] == runs["memory"]["val_accuracy"] > 0.5


def test_augmented_epoch_is_the_same_in_torch_and_tensorflow(tmp_path):
    """lr ~0: the weights stay at the (identical) initial ones, so the epoch's training loss is the
    forward pass over the augmented rows: equal across frameworks, and unlike the unaugmented one."""
    digits_webdataset(tmp_path / "wds", 320, shards=2)
    data = {"dataset": f"webdataset:{tmp_path}/wds/*.tar", "normalize": "channel"}
    loss = {}
    for name, backend, augment in (("pt", "torch", AUGMENT), ("tf", "tensorflow", AUGMENT), ("plain", "torch", {})):
        hvtrain.train(cfg(tmp_path, name, backend, lr=1e-9, epochs=1, augment=augment, **data), quiet=True)
        loss[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])["train_loss"]
    assert abs(loss["pt"] - loss["tf"]) <= 1e-5 * abs(loss["pt"]), loss
    assert abs(loss["pt"] - loss["plain"]) > 1e-3, f"augmentation changed nothing: {loss}"
    assert max_abs_diff(weights(tmp_path, "pt"), weights(tmp_path, "tf")) <= 1e-6


def test_data_workers_give_the_same_batches_as_the_training_process(tmp_path):
    digits_webdataset(tmp_path / "wds", 300, shards=2)
    data = {"dataset": f"webdataset:{tmp_path}/wds/*.tar", "augment": AUGMENT, "normalize": "channel"}
    for name, extra in (("w0", {}), ("w2", {"workers": 2}), ("w2p0", {"workers": 2, "prefetch": 0})):
        hvtrain.train(cfg(tmp_path, name, "torch", **data, **extra), quiet=True)
    assert max_abs_diff(weights(tmp_path, "w0"), weights(tmp_path, "w2")) == 0
    assert max_abs_diff(weights(tmp_path, "w0"), weights(tmp_path, "w2p0")) == 0


def test_a_dataset_the_workers_cannot_receive_is_a_data_error(tmp_path):
    """An entrypoint's random-access object that cannot be pickled (a lambda inside) cannot go to
    worker processes: one clear error, not a traceback from multiprocessing."""
    class Lambdas:
        def __init__(self):
            self.pixels = lambda i: np.zeros((len(i), 8, 8, 1), np.float32) + (np.asarray(i) % 7)[:, None, None, None]

        def __len__(self):
            return 64

        def get(self, indices):
            return self.pixels(indices), np.asarray(indices) % 10

    with pytest.raises(hvtrain.HvtrainError, match="data.workers: .*cannot be sent to worker processes"):
        hvtrain.train(cfg(tmp_path, "lam", "torch", workers=1, epochs=1, normalize="none"), data=Lambdas(),
                      quiet=True)
