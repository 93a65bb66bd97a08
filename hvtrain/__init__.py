"""hvtrain: one experiment config, one CLI, PyTorch or TensorFlow under Horovod.

This package is the framework-neutral core: it imports no deep-learning framework
and no Horovod at module level, so `hvtrain hosts check` and `hvtrain launch
--dry-run` work on a login node that has neither.

The Python API (hvtrain.api) is reached as `hvtrain.train`, `hvtrain.evaluate` and
`hvtrain.predict`; its errors are `hvtrain.HvtrainError` subclasses.
"""

from hvtrain.errors import ConfigError, DataError, HvtrainError
from hvtrain.version import __version__

__all__ = ["ConfigError", "DataError", "HvtrainError", "__version__", "evaluate", "predict", "train"]


def __getattr__(name: str):
    if name in ("train", "evaluate", "predict"):  # imported on first use: numpy and the config schema
        from hvtrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'hvtrain' has no attribute {name!r}")
