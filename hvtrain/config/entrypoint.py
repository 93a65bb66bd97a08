"""User code: the one configured `package.module:function` hvtrain imports and calls
(model.entrypoint, data.entrypoint): nothing else of the user's is ever imported."""

from __future__ import annotations

import importlib
from typing import Any

from hvtrain.config.schema import Config


def call_entrypoint(cfg: Config, key: str) -> Any:
    """Import and call `cfg.<key>.entrypoint` (`package.module:function`, the only user code hvtrain
    imports) with `cfg.<key>.kwargs`. `key` is "model" or "data".

    Raises:
        ConfigError: the import fails or the function raises; located at `<key>.entrypoint`.
    """
    section = getattr(cfg, key)
    spec = section.entrypoint
    module_name, _, func_name = spec.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as exc:
        raise cfg.fail(f"{key}.entrypoint", f"cannot import {spec!r}: {exc}") from None
    try:
        return func(**section.kwargs)
    except Exception as exc:  # noqa: BLE001 - user code: any failure is reported, located
        raise cfg.fail(f"{key}.entrypoint", f"{spec} raised {type(exc).__name__}: {exc}") from None
