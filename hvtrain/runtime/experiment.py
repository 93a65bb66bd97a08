"""The experiment checked before any rank starts: config (with the command line's settings and
HVTRAIN_* variables), model spec, dataset, metrics and output directory, all before Horovod or a
framework is imported, so bad input fails fast with one located line.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hvtrain.config.load import load_config
from hvtrain.config.schema import Config
from hvtrain.data.dataset import Dataset, load_dataset
from hvtrain.errors import ConfigError
from hvtrain.launch.process import setting
from hvtrain.metrics.suite import check_metrics
from hvtrain.model.native import largest_token_id
from hvtrain.model.spec import ModelSpec, build_spec, check_against_data, check_token_ids


@dataclass
class Prepared:
    cfg: Config
    spec: ModelSpec | None
    data: Dataset
    initial: dict[str, np.ndarray] | None = None  # training's initial weights (None: the seeded ones)
    initial_note: str | None = None  # what model.init_from loaded, printed at the start


ConfigSource = str | Path | Mapping[str, Any] | Config


def prepare(config: ConfigSource, backend: str | None = None, output_dir: str | None = None,
            overrides: Sequence[str] = (), model: Any = None, data: Any = None,
            stop: Callable[[str], None] | None = None) -> Prepared:
    """Load and check a config (a YAML path, a mapping or a Config) and its data; `model` and `data`
    are the Python API's native-model callable and arrays/random-access object. `stop(before)` is
    called between the config and the data (training's StopSignals.check: a pre-emption notice
    ends the rank there). Raises HvtrainError subclasses on bad input."""
    cfg = load_experiment(config, backend, output_dir, overrides, model, data)
    if stop is not None:
        stop("the data")
    spec = build_spec(cfg) if cfg.model.entrypoint is None else None
    data = load_dataset(cfg, spec.input_shape if spec else _tuple(cfg.model.input_shape),
                        spec.integer_input if spec else False)
    if spec is not None:
        check_against_data(cfg, spec, data.feature_shape, data.num_outputs)
        if spec.integer_input:
            check_token_ids(cfg, spec, *largest_token_id(cfg, data))
    check_metrics(cfg, data.num_outputs)
    return Prepared(cfg, spec, data)


def load_experiment(config: ConfigSource, backend: str | None = None, output_dir: str | None = None,
                    overrides: Sequence[str] = (), model: Any = None, data: Any = None,
                    need_data: bool = True) -> Config:
    """The config with the command line's settings (--backend, --output-dir, --set) and their
    HVTRAIN_* variables applied; no data opened."""
    extra = list(overrides)
    backend = setting(backend, "HVTRAIN_BACKEND")
    output_dir = setting(output_dir, "HVTRAIN_OUTPUT_DIR")
    if backend is not None:
        extra.append(f"backend={backend}")
    cfg = load_config(config, extra, model=model, data=data, need_data=need_data)
    if output_dir is not None:  # a path, taken as written (not parsed as YAML)
        cfg.output_dir = output_dir
    return cfg


def check_output_dir(cfg: Config, output_dir: str | None = None) -> None:
    """The run's output directory, on rank 0 (which writes it; another host's file system may
    differ) before any framework starts: neither a file nor under one, and writable. Else
    train/evaluate failed in mkdir after Horovod started, with a traceback. `output_dir` is the
    --output-dir given (None: the config's or HVTRAIN_OUTPUT_DIR's, as load_experiment applied it).

    Raises:
        ConfigError: located at --output-dir, HVTRAIN_OUTPUT_DIR, the config's output_dir or, for the
            default runs/NAME, at name.
    """
    from hvtrain.io.reporter import file_in_the_way
    from hvtrain.launch.process import launcher_rank

    if launcher_rank() not in (None, 0):
        return
    out = cfg.out_dir
    blocked = file_in_the_way(out)
    if blocked is not None:
        problem = f"expected a directory for the run's outputs, got {blocked}"
    else:
        base = next((d for d in (out, *out.parents) if d.exists()), Path("."))
        if os.access(base, os.W_OK | os.X_OK):
            return
        problem = f"cannot write the run's outputs there ({base} is not a writable directory)"
    env = os.environ.get("HVTRAIN_OUTPUT_DIR") or None
    if output_dir is not None or env is not None:
        raise ConfigError(f"{'--output-dir ' if output_dir is not None else 'HVTRAIN_OUTPUT_DIR='}{out}: {problem}")
    if cfg.output_dir is not None:
        raise cfg.fail("output_dir", f"{out}: {problem}")
    raise cfg.fail("name", f"the default output directory {out}: {problem}; set output_dir or --output-dir")


def _tuple(shape: list[int] | None) -> tuple[int, ...] | None:
    return tuple(shape) if shape else None
