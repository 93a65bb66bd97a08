"""A 1-D series as a forecasting dataset: the series datasets statsmodels ships, sliding windows,
a split in time order and the persistence baseline.

`data.window: W` and `data.horizon: H` turn a series s of N values into windows: window i has
the inputs s[i : i+W] and the targets s[i+W : i+W+H]. The split is in time order, never shuffled:
the last round(N * validation_split) values are the validation part, and a window belongs to a
split only when all its W+H values lie inside that part, so no window straddles the boundary
(the W+H-1 windows that would are dropped) and every training target comes before the first
validation input. The normalisation statistics (one mean and std, or min and range, for the
whole series) come from the training part alone; they shift and scale the inputs (the
Transform, so they travel with the weights) and the targets alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hvtrain.config.schema import Config
from hvtrain.errors import DataError

STATSMODELS_SERIES = ("co2", "sunspots")


@dataclass(frozen=True)
class Windows:
    """All windows of a series and which of them each split holds (indices into x and y)."""

    x: np.ndarray  # [N-W-H+1, W] inputs, in the series' units
    y: np.ndarray  # [N-W-H+1, H] targets
    train: np.ndarray  # windows entirely inside s[:boundary]
    val: np.ndarray  # windows entirely inside s[boundary:]
    boundary: int  # the first validation value's index in the series


def load_series(cfg: Config) -> np.ndarray:
    """The series named by `data.dataset` as float64, in time order.

    Raises:
        ConfigError: an unknown series, or a dataset that is not 1-D.
        DataError: statsmodels is not installed, or an unreadable file.
    """
    kind, _, arg = cfg.data.dataset.partition(":")
    if kind == "statsmodels":
        if arg not in STATSMODELS_SERIES:
            raise cfg.fail("data.dataset", f"unknown statsmodels series {arg!r}; expected one of "
                           f"{', '.join(STATSMODELS_SERIES)}")
        return _statsmodels(arg)
    from hvtrain.data.readers import resolve_path

    path = resolve_path(cfg, arg)
    try:
        with np.load(path, allow_pickle=False) as f:
            if "x" not in f.files:
                raise DataError(f"{path}: expected an array 'x' (the series), got {f.files}")
            x = f["x"]
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read NPZ ({exc})") from None
    if x.ndim != 1:
        raise cfg.fail("data.window", f"expected a 1-D series, got {cfg.data.dataset} whose x has shape "
                       f"{list(x.shape)}")
    return x.astype(np.float64)


def _statsmodels(name: str) -> np.ndarray:
    """co2: Mauna Loa weekly CO2 (ppm, 1958-2001; its 59 missing weeks take the last observed
    value, which uses no future); sunspots: yearly sunspot activity 1700-2008. Both ship inside
    statsmodels (no download)."""
    try:
        import statsmodels.datasets as sm  # lazy: ~1 s; the optional extra hvtrain[examples]
    except ImportError:
        raise DataError(f"statsmodels:{name} needs statsmodels: pip install 'hvtrain[examples]'") from None
    if name == "co2":
        return sm.co2.load_pandas().data["co2"].ffill().bfill().to_numpy(np.float64)
    return sm.sunspots.load_pandas().data["SUNACTIVITY"].to_numpy(np.float64)


def make_windows(series: np.ndarray, window: int, horizon: int, validation_split: float) -> Windows:
    """Windows of `series` split in time order (module docstring).

    Raises:
        ValueError: the series is too short for one training (or, with a validation part, one
            validation) window; the message says how long each part is.
    """
    n = len(series)
    n_val = int(round(n * validation_split))
    boundary = n - n_val
    span = window + horizon
    if span > boundary or (n_val and span > n_val):
        part = "training" if span > boundary else "validation"
        raise ValueError(f"window + horizon = {span} values is longer than the {part} part of the series "
                         f"({boundary if part == 'training' else n_val} of its {n} values)")
    starts = np.arange(n - span + 1)
    x = np.lib.stride_tricks.sliding_window_view(series, window)[: len(starts)]
    y = np.lib.stride_tricks.sliding_window_view(series[window:], horizon)[: len(starts)]
    train = starts[starts + span <= boundary]
    val = starts[starts >= boundary] if n_val else starts[:0]
    return Windows(np.ascontiguousarray(x), np.ascontiguousarray(y), train, val, boundary)


def series_statistics(how: str, train_part: np.ndarray) -> tuple[float, float]:
    """(shift, scale) of the training part: mean and std (standard), min and range (minmax)."""
    if how == "none":
        return 0.0, 1.0
    shift, scale = (train_part.mean(), train_part.std()) if how == "standard" else (
        train_part.min(), np.ptp(train_part))
    return float(shift), float(scale) if scale > 0 else 1.0


def persistence(w: Windows) -> dict[str, float]:
    """The naive forecast on the validation windows: every target is the window's last value.
    MAE and RMSE in the series' units, the bar a forecaster has to clear."""
    if len(w.val) == 0:
        return {}
    err = w.y[w.val] - w.x[w.val, -1:]
    return {"persistence_val_mae": float(np.abs(err).mean()),
            "persistence_val_rmse": float(np.sqrt((err ** 2).mean()))}


def in_series_units(facts: dict, val: dict) -> dict[str, float]:
    """The model's validation MAE / RMSE in the series' units (the metrics are computed on the
    normalised targets; both scale by the normalisation's `scale`)."""
    scale, out = facts["scale"], {}
    if isinstance(val.get("mae"), float):
        out["val_mae"] = val["mae"] * scale
    mse = val.get("mse", val.get("loss") if facts["loss"] == "mse" else None)
    if isinstance(mse, float):
        out["val_rmse"] = float(np.sqrt(mse)) * scale
    return out
