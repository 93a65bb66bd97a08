"""A native model from the configured entrypoint (or the Python API's callable), checked to be the
backend's model type, and the check that saved weights name exactly its variables.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hvtrain.config.entrypoint import call_entrypoint
from hvtrain.config.schema import Config
from hvtrain.errors import DataError, HvtrainError


def load_entrypoint(cfg: Config, expected: type, what: str) -> Any:
    """The native model: from hvtrain.train(model=...) or the configured model.entrypoint; checks
    that it is an `expected` model (`what` names it in the error)."""
    factory = cfg.model.factory
    if factory is not None:
        try:
            model = factory()
        except Exception as exc:  # noqa: BLE001 - user code: any failure is reported, located
            raise HvtrainError(f"model= ({cfg.model.entrypoint}) raised {type(exc).__name__}: {exc}") from None
    else:
        model = call_entrypoint(cfg, "model")
    if not isinstance(model, expected):
        raise cfg.fail("model.entrypoint", f"expected the function to return a {what} for backend "
                       f"{cfg.backend}, got {type(model).__name__}")
    return model


def check_native_names(current: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                       weights: dict[str, np.ndarray], source: str = "weights") -> None:
    """Weights for an entrypoint model must name exactly its variables, with their shapes.

    Raises:
        DataError: naming the missing, unexpected or mis-shaped keys (the same message in every backend).
    """
    missing = sorted(set(current) - set(weights))
    unexpected = sorted(set(weights) - set(current))
    if missing or unexpected:
        parts = ([f"missing {len(missing)} ({', '.join(missing[:5])})"] if missing else []) + \
                ([f"unexpected {len(unexpected)} ({', '.join(unexpected[:5])})"] if unexpected else [])
        raise DataError(f"{source}: weights do not match the entrypoint model: {'; '.join(parts)}")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != tuple(shape):
            raise DataError(f"{source}: weight {name!r} has shape {list(weights[name].shape)}, "
                            f"the entrypoint model needs {list(shape)}")
