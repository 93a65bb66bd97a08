"""Configs and files several test modules build on: a tiny predict config and its weights file
(as `hvtrain train` writes them, no training), the config tests' base experiment, the CLI's
no-framework probe, and entrypoint-model configs of tests.fixtures.user_models."""

from __future__ import annotations

from pathlib import Path

from hvtrain.model.weights import INPUTS_KEY
from hvtrain.runtime.experiment import prepare
from hvtrain.training.finish import weight_metadata

CFG = """name: tiny
seed: 3
data: {{dataset: "{dataset}", batch_size: 64, normalize: {normalize}}}
loss: {loss}
model:
  input_shape: {shape}
  layers:
    - {{type: flatten}}
    - {{type: dense, units: 8, activation: relu}}
    - {{type: dense, units: {units}}}
"""


def write_config(tmp_path: Path, name: str = "cfg.yaml", dataset: str = "sklearn:digits", normalize: str = "standard",
                 loss: str = "cross_entropy", shape: str = "[64]", units: int = 10) -> Path:
    p = tmp_path / name
    p.write_text(CFG.format(dataset=dataset, normalize=normalize, loss=loss, shape=shape, units=units))
    return p


def write_weights(tmp_path: Path, cfg_path: Path, name: str = "final.safetensors", inputs: bool = True) -> Path:
    """A final.safetensors as `hvtrain train` writes it (initial weights: no training needed)."""
    from safetensors.numpy import save_file

    p = prepare(str(cfg_path))
    meta = weight_metadata(p.cfg, p.spec, p.data)
    if not inputs:
        meta.pop(INPUTS_KEY)
    save_file(p.spec.init_weights(p.cfg.seed), str(tmp_path / name), metadata=meta)
    return tmp_path / name


# A framework import on this path fails loudly: each error below must come before any framework.
NO_FRAMEWORK = "raise ImportError('predict imported a framework before checking its input')\n"


BASE = """\
name: t
data:
  dataset: sklearn:digits
model:
  input_shape: [64]
  layers:
    - {type: dense, units: 10}
"""


LIGHT = """
import sys
from hvtrain.cli import main
sys.argv = ["hvtrain"] + sys.argv[1:]
try:
    main()
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in ("torch", "tensorflow", "horovod", "keras", "mpi4py", "tensorboard"))
assert not heavy, heavy
"""


DIGITS = {"dataset": "sklearn:digits", "batch_size": 32}  # 64 features, 10 classes


CANCER = {"dataset": "sklearn:breast_cancer", "batch_size": 32}  # 30 features, 2 classes


FIXTURE = "tests.fixtures.user_models"


def backend_of(model: str) -> str:
    return "tensorflow" if model.startswith("keras_") else "torch"


def native_config(model: str, data: dict = DIGITS, loss: str = "cross_entropy", lr: float = 0.003, **kwargs) -> dict:
    cfg = {"name": "contract", "seed": 3, "data": dict(data), "loss": loss,
           "model": {"entrypoint": f"{FIXTURE}:{model}", "kwargs": kwargs},
           "optimizer": {"name": "adam", "lr": lr}, "train": {"epochs": 1, "threads": 1}}
    if loss in ("mse", "mae"):
        cfg["metrics"] = ["mse"]
    return cfg
