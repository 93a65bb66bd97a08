"""images:DIR on one rank, in process, on every backend (issue 23): a folder of PNGs trains to the
weights of the same pixels given as arrays (data=), and what it trained on is what it evaluates."""

from __future__ import annotations

import numpy as np

import hvtrain
from tests.conftest import load_weights, max_abs_diff
from tests.support.data import digits_image_folder


def test_an_image_folder_trains_like_its_pixels_in_memory(tmp_path, backend_name):
    x, y = digits_image_folder(tmp_path / "digits", per_class=40)
    order = np.argsort(y, kind="stable")  # the folder's order: class, then file name

    def cfg(name: str, **data) -> dict:
        return {"name": name, "seed": 4, "backend": backend_name,
                "data": {"batch_size": 16, "image": {"size": [8, 8], "channels": 1}, **data},
                "model": {"input_shape": [8, 8, 1], "layers": [{"type": "flatten"}, {"type": "dense", "units": 32,
                          "activation": "relu"}, {"type": "dense", "units": 10}]},
                "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "train": {"epochs": 2, "threads": 1},
                "output_dir": str(tmp_path / name)}

    folder = hvtrain.train(cfg("folder", dataset=f"images:{tmp_path / 'digits'}"), quiet=True)
    memory = hvtrain.train(cfg("memory"), data=(x[order], y[order]), quiet=True)
    gap = max_abs_diff(load_weights(tmp_path / "memory/final.safetensors"),
                       load_weights(tmp_path / "folder/final.safetensors"))
    assert gap <= 1e-6, f"{backend_name}: images: differs from its pixels in memory by {gap}"
    assert folder["val_accuracy"] == memory["val_accuracy"] > 0.5 and folder["val_samples"] == 80
    again = hvtrain.evaluate(cfg("folder", dataset=f"images:{tmp_path / 'digits'}"),
                             str(tmp_path / "folder/final.safetensors"))
    assert again["val_accuracy"] == folder["val_accuracy"]
