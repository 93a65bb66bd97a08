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

from hvtrain.runtime.experiment import ConfigSource
from hvtrain.training import entry


def train(config: ConfigSource, *, backend: str | None = None, model: Callable[[], Any] | None = None,
          data: Any = None, output_dir: str | None = None, overrides: Sequence[str] = (),
          resume: str | None = None, quiet: bool = False) -> dict[str, Any]:
    """Train an experiment; returns what summary.json holds.

    Args:
        config: a YAML path, a mapping with the YAML's keys, or a hvtrain.config.schema.Config.
        backend: "torch" or "tensorflow" (overrides the config's).
        model: a callable returning a native torch.nn.Module / keras.Model, in place of
            model.layers or model.entrypoint (weights are saved under its native names).
        data: `(x, y)` arrays, or an object with `__len__` and `get(indices) -> (x, y)`, in place of
            data.dataset (hvtrain splits, normalises, shards and batches it as any dataset).
        output_dir: where outputs go (default: the config's output_dir, else runs/<name>).
        overrides: `key.path=value` strings, as the CLI's --set.
        resume: "auto" or a checkpoint path, as the CLI's --resume.
    """
    return entry.train(config, backend, output_dir, overrides, quiet=quiet, resume=resume, model=model, data=data)


def evaluate(config: ConfigSource, weights: str, *, backend: str | None = None,
             model: Callable[[], Any] | None = None, data: Any = None, output_dir: str | None = None,
             overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Validation metrics of saved weights (a final.safetensors of either backend); writes eval.json."""
    return entry.evaluate(config, weights, backend, output_dir, overrides, model=model, data=data)


def predict(config: ConfigSource, weights: str, x: Any, *, backend: str | None = None,
            model: Callable[[], Any] | None = None, data: Any = None, overrides: Sequence[str] = (),
            kind: str = "probabilities", batch_size: int = 1024) -> np.ndarray:
    """Predictions for raw feature rows `x`, in order, as `hvtrain predict` makes them.

    The normalisation fitted on the training split, the raw row shape and the classes come from
    the weights file (final.safetensors or a checkpoint), so the training data is not opened.

    Args:
        x: rows as the dataset stores them: an array (memory-mapped ones are read block by block)
            or a .npy / .csv path.
        kind: "probabilities" (softmax; binary: sigmoid [N, 1]), "logits", or "labels" (the
            dataset's label values); regression models return their outputs for the first two.
        data: not needed (accepted so a train call's arguments can be reused).
        batch_size: rows per rank per step.

    Returns:
        every row's prediction, on every rank (on several ranks each predicts a share).
    """
    from hvtrain.tools.predict import predict_array

    return predict_array(config, weights, x, backend, overrides, model=model, data=data, kind=kind,
                         batch_size=batch_size)
