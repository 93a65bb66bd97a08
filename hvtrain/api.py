"""The Python API: the CLI's train / evaluate in a script, a notebook or a sweep, plus predict.

    import hvtrain
    summary = hvtrain.train("experiments/digits.yaml", overrides=["train.epochs=3"])

The same script runs alone or under `horovodrun -np N python script.py` / `mpirun`, and gives the
results of `hvtrain train` for the same config. Errors raise hvtrain.HvtrainError subclasses
(ConfigError, DataError, ...) instead of exiting; on several ranks, a failure once training has
started is reported by the rank that failed and ends the whole job (the others would wait forever).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hvtrain import session
from hvtrain.session import ConfigSource


def train(config: ConfigSource, *, backend: str | None = None, model: Callable[[], Any] | None = None,
          data: Any = None, output_dir: str | None = None, overrides: Sequence[str] = (),
          resume: str | None = None, quiet: bool = False) -> dict[str, Any]:
    """Train an experiment; returns what summary.json holds.

    Args:
        config: a YAML path, a mapping with the YAML's keys, or a hvtrain.config.Config.
        backend: "torch" or "tensorflow" (overrides the config's).
        model: a callable returning a native torch.nn.Module / keras.Model, in place of
            model.layers or model.entrypoint (weights are saved under its native names).
        data: `(x, y)` arrays, or an object with `__len__` and `get(indices) -> (x, y)`, in place of
            data.dataset (hvtrain splits, normalises, shards and batches it as any dataset).
        output_dir: where outputs go (default: the config's output_dir, else runs/<name>).
        overrides: `key.path=value` strings, as the CLI's --set.
        resume: "auto" or a checkpoint path, as the CLI's --resume.
    """
    return session.train(config, backend, output_dir, overrides, quiet=quiet, resume=resume, model=model, data=data)


def evaluate(config: ConfigSource, weights: str, *, backend: str | None = None,
             model: Callable[[], Any] | None = None, data: Any = None, output_dir: str | None = None,
             overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Validation metrics of saved weights (a final.safetensors of either backend); writes eval.json."""
    return session.evaluate(config, weights, backend, output_dir, overrides, model=model, data=data)


def predict(config: ConfigSource, weights: str, x: np.ndarray, *, backend: str | None = None,
            model: Callable[[], Any] | None = None, data: Any = None, overrides: Sequence[str] = ()) -> np.ndarray:
    """Model outputs for raw features `x` (as the dataset stores them), in order: normalised with the
    training split's statistics (the config's data is opened to fit them; its features are read once
    or taken from the statistics cache). Logits for classification losses."""
    return session.predict(config, weights, x, backend, overrides, model=model, data=data)
