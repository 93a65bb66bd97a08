"""`parquet:GLOB`: Parquet files (what pandas, Spark and HF `datasets` write) as one dataset, read
by row groups with pyarrow.

    data.features: [a, b, c]     numeric columns, one feature each (default: every numeric column
                                 but the label, else the one numeric list column), or [emb]: one
                                 list column of a fixed length
    data.image.column: image     or encoded images (a binary column, or HF datasets' Image
                                 struct {bytes, path}) decoded to data.image.size
    data.label: label            the label (or regression target) column (default: `label`)

Files in sorted path order, rows in file order: global sample i is the same row on every rank.
The label column is read whole when the dataset opens (the split and the classes need it); a
batch reads only the row groups its samples live in, and decoded row groups are kept up to
CACHE_BYTES (least recently used dropped), so a rank's memory is flat in the files' size. A
shuffled epoch over files much larger than that reads a row group per sample: files written with
row groups of a few thousand rows or fewer read fastest.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from hvtrain.data.sources import Source, file_stat, match_files
from hvtrain.errors import DataError

CACHE_BYTES = 64 << 20  # decoded row groups kept per source


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("parquet: datasets need pyarrow: pip install 'hvtrain[data]' (or pyarrow)") from None
    return pq


class ParquetSource(Source):
    """Rows of Parquet files behind one global index: numeric feature columns (float64 or their
    own dtype), one fixed-length list column, or an encoded-image column decoded by Pillow."""

    def __init__(self, files: list[Path], columns: list[str], label: str, name: str,
                 image: tuple[tuple[int, int], int] | None = None) -> None:
        pq = _pyarrow()
        self.files, self.columns, self.label, self.name, self.image = files, columns, label, name, image
        self._meta, counts = [], []
        for k, path in enumerate(files):
            try:
                meta = pq.ParquetFile(path).metadata
            except (OSError, ValueError) as exc:  # pyarrow.ArrowInvalid is a ValueError
                raise DataError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
            self._meta.append(meta)
            counts += [(k, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
        # row group j: file counts[j][0], group counts[j][1], global rows starts[j] .. starts[j+1]-1
        self._groups = [(k, g) for k, g, _ in counts]
        self.starts = np.concatenate([[0], np.cumsum([n for _, _, n in counts])]).astype(np.int64)
        if self.starts[-1] == 0:
            raise DataError(f"{name}: the files hold no rows")
        self._check_schemas()
        self._cache: OrderedDict[int, Any] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()
        first = self._group(0)
        self._shape = tuple(first.shape[1:]) if image is None else (*image[0], image[1])
        self._dtype = first.dtype if image is None else np.dtype(np.uint8)

    def __getstate__(self) -> dict[str, Any]:  # to data.workers processes: no lock, an empty cache
        state = dict(self.__dict__)
        state.update(_lock=None, _cache=OrderedDict(), _cache_bytes=0)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def _check_schemas(self) -> None:
        """Every file has the columns, of one type each (a file written by other code is named)."""
        first = None
        for path, meta in zip(self.files, self._meta, strict=True):
            schema = meta.schema.to_arrow_schema()
            missing = [c for c in (*self.columns, self.label) if schema.get_field_index(c) < 0]
            if missing:
                raise DataError(f"{path}: no column {', '.join(repr(c) for c in missing)} (it has "
                                f"{', '.join(schema.names)})")
            types = [str(schema.field(c).type) for c in (*self.columns, self.label)]
            if first is None:
                first = (path, types)
            elif types != first[1]:
                diff = [f"{c}: {a} here, {b} in {first[0].name}" for c, a, b in
                        zip((*self.columns, self.label), types, first[1], strict=True) if a != b]
                raise DataError(f"{path}: column types differ from the first file's ({'; '.join(diff)})")

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return self._shape

    def _read(self, j: int) -> Any:
        pq = _pyarrow()
        k, g = self._groups[j]
        try:
            return pq.ParquetFile(self.files[k], metadata=self._meta[k]).read_row_group(g, columns=self.columns)
        except (OSError, ValueError) as exc:
            raise DataError(f"{self.files[k]}: row group {g}: cannot read ({type(exc).__name__}: {exc})") from None

    def _group(self, j: int) -> Any:
        """Row group j decoded: an (n, ...) array of features, or the group's encoded images."""
        with self._lock:
            if j in self._cache:
                self._cache.move_to_end(j)
                return self._cache[j]
        table = self._read(j)
        k, g = self._groups[j]
        where = f"{self.files[k]} (row group {g})"
        value = _images(table.column(0), where) if self.image is not None else _numbers(table, self.columns, where)
        size = value.nbytes if isinstance(value, np.ndarray) else sum(len(b) for b in value)
        with self._lock:
            self._cache[j] = value
            self._cache_bytes += size
            while self._cache_bytes > CACHE_BYTES and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.nbytes if isinstance(old, np.ndarray) else sum(len(b) for b in old)
        return value

    def features(self, indices: np.ndarray) -> np.ndarray:
        from hvtrain.data.images import decode

        indices = np.asarray(indices, np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"{self.name}: row index out of range 0..{len(self) - 1}")
        which = np.searchsorted(self.starts, indices, side="right") - 1
        out = np.empty((len(indices), *self._shape), self._dtype)
        for j in np.unique(which):
            sel = np.flatnonzero(which == j)
            local = indices[sel] - self.starts[j]
            group = self._group(int(j))
            if self.image is None:
                out[sel] = group[local]
                continue
            k, g = self._groups[j]
            for s, r in zip(sel, local, strict=True):
                out[s] = decode(group[r], *self.image, where=f"{self.files[k]}: row group {g}, row {int(r)} "
                                f"(column {self.columns[0]!r})")
        return out

    def labels(self) -> np.ndarray:
        pq = _pyarrow()
        parts = []
        for path, meta in zip(self.files, self._meta, strict=True):
            try:
                column = pq.ParquetFile(path, metadata=meta).read(columns=[self.label]).column(0)
            except (OSError, ValueError) as exc:
                raise DataError(f"{path}: cannot read column {self.label!r} ({type(exc).__name__}: {exc})") from None
            if column.null_count:
                row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
                raise DataError(f"{path}: row {row}: the label column {self.label!r} is empty (null)")
            if _is_list(column.type):
                parts.append(_fixed_list(column.combine_chunks(), f"{path}: column {self.label!r}"))
            else:
                parts.append(column.to_numpy(zero_copy_only=False))
        return np.concatenate(parts)

    def identity(self) -> list[Any]:
        from hvtrain.data.images import decoder

        return [[file_stat(p) for p in self.files], self.columns, self.label, self.image,
                decoder() if self.image is not None else None]

    def cache_dir(self) -> Path:
        return self.files[0].parent


def _is_list(tp: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_list(tp) or pa.types.is_large_list(tp) or pa.types.is_fixed_size_list(tp)


def _fixed_list(array: Any, where: str) -> np.ndarray:
    """A list column of one length as an (n, length) array; rows of other lengths are named."""
    lengths = array.value_lengths().to_numpy(zero_copy_only=False) if len(array) else np.zeros(0, np.int64)
    if array.null_count:
        raise DataError(f"{where}: row {int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])} "
                        "is empty (null)")
    if len(lengths) and (lengths != lengths[0]).any():
        row = int(np.flatnonzero(lengths != lengths[0])[0])
        raise DataError(f"{where}: row {row} has {int(lengths[row])} values, row 0 has {int(lengths[0])} (a list "
                        "column of features needs one length)")
    values = array.flatten().to_numpy(zero_copy_only=False)
    return values.reshape(len(array), int(lengths[0]) if len(lengths) else 0)


def _numbers(table: Any, columns: list[str], where: str) -> np.ndarray:
    """The feature columns of one row group as an (n, features) array (a null: NaN, named by the
    start-up check of every row)."""
    if len(columns) == 1 and _is_list(table.schema.field(0).type):
        array = table.column(0).combine_chunks()
        if array.flatten().null_count:
            row = next(i for i, v in enumerate(array.to_pylist()) if v is not None and None in v)
            raise DataError(f"{where}: row {row} of column {columns[0]!r} holds an empty (null) value")
        return _fixed_list(array, f"{where}: column {columns[0]!r}")
    for c in columns:  # an int/bool column's null would become a number (or False): refused, never guessed
        column = table.column(c)
        if column.null_count:
            row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(f"{where}: row {row} of column {c!r} is empty (null)")
    arrays = [table.column(c).to_numpy(zero_copy_only=False) for c in columns]
    return np.column_stack(arrays) if arrays else np.zeros((table.num_rows, 0))


def _images(column: Any, where: str) -> list[bytes]:
    """A column of encoded images: binary, or HF datasets' Image struct {bytes, path}."""
    import pyarrow as pa

    array = column.combine_chunks()
    if pa.types.is_struct(array.type):
        array = array.field("bytes")
    values = array.to_pylist()
    for row, v in enumerate(values):
        if v is None:
            raise DataError(f"{where}: row {row}: no image bytes (an empty cell, or an image stored only by its "
                            "path: embed the bytes, as datasets' embed_external_files does)")
    return values


def open_parquet(cfg: Any, pattern: str) -> ParquetSource:
    """The files matching `pattern` and the columns the config names, checked before training."""
    pq = _pyarrow()
    d = cfg.data
    paths = [Path(p) for p in match_files(pattern, Path(cfg.source).parent, "Parquet")]
    try:
        schema = pq.ParquetFile(paths[0]).schema_arrow
    except (OSError, ValueError) as exc:
        raise DataError(f"{paths[0]}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    label = d.label or "label"
    if schema.get_field_index(label) < 0:
        raise cfg.fail("data.label", f"{paths[0]} has no column {label!r} (it has {', '.join(schema.names)}): "
                                     "name the label column in data.label")
    image = None
    if d.image.column is not None:
        from hvtrain.data.images import image_size

        if isinstance(d.features, list):
            raise cfg.fail("data.features", "give either data.features (numeric columns) or data.image.column")
        if schema.get_field_index(d.image.column) < 0:
            raise cfg.fail("data.image.column", f"{paths[0]} has no column {d.image.column!r}")
        tp = schema.field(d.image.column).type
        import pyarrow as pa

        if not (pa.types.is_binary(tp) or pa.types.is_large_binary(tp) or
                pa.types.is_struct(tp) and tp.get_field_index("bytes") >= 0):
            raise cfg.fail("data.image.column", f"column {d.image.column!r} is {tp}: expected encoded image bytes "
                                                "(binary, or a struct with a bytes field)")
        columns, image = [d.image.column], image_size(cfg)
    elif isinstance(d.features, list):
        columns = d.features
        missing = [c for c in columns if schema.get_field_index(c) < 0]
        if missing:
            raise cfg.fail("data.features", f"{paths[0]} has no column {', '.join(repr(c) for c in missing)} (it "
                                            f"has {', '.join(schema.names)})")
        if label in columns:
            raise cfg.fail("data.features", f"lists the label column {label!r}")
        if len(columns) > 1 and any(_is_list(schema.field(c).type) for c in columns):
            raise cfg.fail("data.features", "a list column is the only feature column, or give numeric columns")
        bad = [c for c in columns if not _numeric(schema.field(c).type)]
        if bad:
            raise cfg.fail("data.features", f"column {bad[0]!r} is {schema.field(bad[0]).type}, not numbers")
    else:
        if "data.features" in cfg.lines:
            raise cfg.fail("data.features", f"for {d.dataset}: a list of column names, got {d.features!r}")
        index = _pandas_index(schema)
        numeric = [n for n in schema.names if n != label and n not in index and _numeric(schema.field(n).type)]
        columns = [n for n in numeric if not _is_list(schema.field(n).type)]
        lists = [n for n in numeric if _is_list(schema.field(n).type)]
        if columns and lists:
            raise cfg.fail("data.features", f"{paths[0]} has numeric columns ({', '.join(columns[:4])}"
                                            f"{', ...' if len(columns) > 4 else ''}) and list columns "
                                            f"({', '.join(lists)}): name the feature columns")
        if not columns and len(lists) == 1:
            columns = lists  # one list column of numbers: the features (an embedding, pixels)
        elif not columns and lists:
            raise cfg.fail("data.features", f"{paths[0]} has list columns {', '.join(lists)}: name the one that "
                                            "holds the features")
        if not columns:
            raise cfg.fail("data.features", f"{paths[0]} has no numeric column besides {label!r}: name the feature "
                                            "columns (or data.image.column)")
    return ParquetSource(paths, columns, label, d.dataset, image)


def _pandas_index(schema: Any) -> set[str]:
    """The columns pandas wrote for a DataFrame's index (`__index_level_0__` after a sample or a
    filter): never features by default."""
    meta = (schema.metadata or {}).get(b"pandas")
    try:
        named = {c for c in json.loads(meta).get("index_columns", []) if isinstance(c, str)} if meta else set()
    except ValueError:
        named = set()
    return named | {n for n in schema.names if n.startswith("__index_level_")}


def _numeric(tp: Any) -> bool:
    import pyarrow as pa

    if _is_list(tp):
        return _numeric(tp.value_type)
    return pa.types.is_integer(tp) or pa.types.is_floating(tp) or pa.types.is_boolean(tp)
