"""Datasets shipped by packages, synthetic, CSV or NPZ; split, normalisation and rank sharding.

Everything here is numpy and deterministic from the seed, so every rank computes the same
split and the same per-epoch permutation without communicating.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hvtrain.config import Config
from hvtrain.errors import DataError

SKLEARN_DATASETS = ("digits", "breast_cancer", "wine", "iris")


@dataclass
class Dataset:
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    num_outputs: int  # classes (cross_entropy), 1 (binary), target width (regression)

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def load_dataset(cfg: Config, input_shape: tuple[int, ...] | None = None, integer_input: bool = False) -> Dataset:
    """Load, split (seeded), normalise (training statistics only) and reshape to `input_shape`.

    Raises:
        ConfigError: unknown dataset kind or option that does not fit the data.
        DataError: a file that is missing or cannot be parsed.
    """
    x, y = _load_raw(cfg)
    classification = cfg.loss in ("cross_entropy", "binary_cross_entropy")
    if classification:
        classes, y = np.unique(y, return_inverse=True)
        y = y.astype(np.int64)
        if cfg.loss == "binary_cross_entropy":
            if len(classes) > 2:
                raise cfg.fail("loss", f"binary_cross_entropy needs 2 classes, dataset has {len(classes)}")
            num_outputs = 1
        else:
            num_outputs = len(classes)
    else:
        y = y.astype(np.float32).reshape(len(y), -1)
        num_outputs = y.shape[1]
    x = x.astype(np.int64 if integer_input else np.float32)

    perm = np.random.default_rng([cfg.seed, 0xDA7A]).permutation(len(x))
    n_val = int(round(len(x) * cfg.data.validation_split))
    val, train = perm[:n_val], perm[n_val:]
    if len(train) == 0:
        raise cfg.fail("data.validation_split", f"leaves no training samples out of {len(x)}")
    x_train, x_val = x[train], x[val]
    if cfg.data.normalize != "none":
        if integer_input:
            raise cfg.fail("data.normalize", "must be none when the first layer is an embedding (token ids)")
        x_train, x_val = _normalize(cfg.data.normalize, x_train, x_val)
    if input_shape is not None and math.prod(input_shape) == math.prod(x.shape[1:]):
        x_train = x_train.reshape((len(x_train),) + tuple(input_shape))
        x_val = x_val.reshape((len(x_val),) + tuple(input_shape))
    return Dataset(np.ascontiguousarray(x_train), y[train], np.ascontiguousarray(x_val), y[val], num_outputs)


def _load_raw(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    kind, _, arg = cfg.data.dataset.partition(":")
    if kind == "sklearn":
        if arg not in SKLEARN_DATASETS:
            raise cfg.fail("data.dataset", f"unknown sklearn dataset {arg!r}; expected one of "
                           f"{', '.join(SKLEARN_DATASETS)}")
        import sklearn.datasets  # lazy: scikit-learn takes ~0.5 s to import

        x, y = getattr(sklearn.datasets, f"load_{arg}")(return_X_y=True)
        return np.asarray(x), np.asarray(y)
    if kind == "synthetic":
        if arg not in ("classification", "regression"):
            raise cfg.fail("data.dataset", f"unknown synthetic dataset {arg!r}; expected classification or regression")
        return _synthetic(cfg, arg)
    if kind in ("csv", "npz"):
        if not arg:
            raise cfg.fail("data.dataset", f"expected {kind}:PATH, got {cfg.data.dataset!r}")
        path = _resolve(cfg, arg)
        return _read_csv(cfg, path) if kind == "csv" else _read_npz(cfg, path)
    raise cfg.fail("data.dataset", f"expected sklearn:NAME, synthetic:classification|regression, csv:PATH or "
                   f"npz:PATH, got {cfg.data.dataset!r}")


def _resolve(cfg: Config, arg: str) -> Path:
    """Relative paths: the working directory first, then the config file's directory."""
    path = Path(arg)
    candidates = [path] if path.is_absolute() else [path, Path(cfg.source).parent / path]
    for c in candidates:
        if c.is_file():
            return c
    tried = " or ".join(str(c) for c in candidates)
    raise cfg.fail("data.dataset", f"dataset file not found: {tried}")


def _synthetic(cfg: Config, task: str) -> tuple[np.ndarray, np.ndarray]:
    d = cfg.data
    rng = np.random.default_rng([cfg.seed, 0x5EED])
    x = rng.standard_normal((d.samples, d.features)).astype(np.float32)
    w = rng.standard_normal((d.features, d.classes if task == "classification" else 1))
    scores = x @ w
    if task == "classification":
        return x, scores.argmax(axis=1) if d.classes > 1 else (scores[:, 0] > 0).astype(np.int64)
    return x, scores[:, 0] + 0.1 * rng.standard_normal(d.samples)


def _read_csv(cfg: Config, path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with path.open(newline="") as fh:
            rows = list(csv.reader(fh))
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read CSV ({exc})") from None
    if len(rows) < 2:
        raise DataError(f"{path}: expected a header row and at least one data row")
    header = rows[0]
    target = cfg.data.target or header[-1]
    if target not in header:
        raise cfg.fail("data.target", f"column {target!r} not in {path} header {header}")
    t = header.index(target)
    xs, ys = [], []
    for lineno, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) != len(header):
            raise DataError(f"{path}:{lineno}: expected {len(header)} columns, got {len(row)}")
        try:
            xs.append([float(v) for j, v in enumerate(row) if j != t])
        except ValueError as exc:
            raise DataError(f"{path}:{lineno}: expected numbers ({exc})") from None
        ys.append(row[t])
    y = np.asarray(ys)
    try:
        y = y.astype(np.float64)
    except ValueError:
        pass  # string labels: mapped to class ids by np.unique in load_dataset
    return np.asarray(xs, np.float32), y


def _read_npz(cfg: Config, path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in ("x", "y") if k not in f.files]
            if missing:
                raise DataError(f"{path}: expected arrays 'x' and 'y', missing {missing} (has {f.files})")
            x, y = f["x"], f["y"]
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read NPZ ({exc})") from None
    if len(x) != len(y):
        raise DataError(f"{path}: x has {len(x)} samples but y has {len(y)}")
    return x, y


def _normalize(how: str, x_train: np.ndarray, x_val: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if how == "standard":
        shift, scale = x_train.mean(axis=0), x_train.std(axis=0)
    else:
        shift, scale = x_train.min(axis=0), x_train.max(axis=0) - x_train.min(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    return ((x_train - shift) / scale).astype(np.float32), ((x_val - shift) / scale).astype(np.float32)


# ----------------------------------------------------------------------------- sharding


@dataclass(frozen=True)
class Batch:
    """One rank's share of one global micro-batch.

    `weights` sum to 1 over the *whole optimizer step on all ranks*, so that summing
    weighted per-sample losses, then averaging gradients over ranks (times world size),
    gives exactly the gradient of the mean loss of the global batch. A rank whose share of
    a tail batch is empty gets one zero-weight sample, so it still joins every allreduce.
    """

    indices: np.ndarray
    weights: np.ndarray
    apply: bool  # last micro-batch of an optimizer step


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The one global sample order of an epoch; every rank computes the same one."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch, 0x5A3D]).permutation(n)


def shard_batches(order: np.ndarray, batch_size: int, rank: int, size: int,
                  accumulation: int = 1) -> Iterator[Batch]:
    """Rank `rank`'s batches: global micro-batch k is order[k*B:(k+1)*B] with B = size*batch_size,
    of which the rank takes every size-th sample starting at `rank`.

    So step k on N ranks with per-rank batch b sees exactly the samples of step k on one
    rank with batch N*b. Nothing is dropped: the last global batch may be short.
    """
    global_batch = batch_size * size
    micro = [order[i: i + global_batch] for i in range(0, len(order), global_batch)]
    for start in range(0, len(micro), accumulation):
        group = micro[start: start + accumulation]
        total = sum(len(g) for g in group)
        for j, g in enumerate(group):
            local = g[rank::size]
            weights = np.full(len(local), 1.0 / total, np.float32)
            if len(local) == 0:
                local, weights = g[:1], np.zeros(1, np.float32)
            yield Batch(local, weights, apply=j == len(group) - 1)


def steps_per_epoch(n: int, batch_size: int, size: int, accumulation: int = 1) -> int:
    return math.ceil(math.ceil(n / (batch_size * size)) / accumulation)


def shard_eval(n: int, rank: int, size: int) -> np.ndarray:
    """Validation indices of a rank: every sample exactly once across ranks."""
    return np.arange(rank, n, size)
