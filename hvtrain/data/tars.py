"""`webdataset:GLOB`: tar shards in the WebDataset convention, read by index.

A sample is the tar members sharing a key (the member's path up to the first dot of its file
name): `000123.jpg` (or `.jpeg`, `.png`: an image decoded to data.image.size; or `.npy`: an
array) and `000123.cls` (the class index as text). Shards in sorted path order, samples in tar
order: global sample i is the same sample on every rank, so the seeded global order holds.

Each shard is scanned once for its members' offsets (the headers only; the data is skipped),
and the index is cached beside it (`.hvtrain-index-<shard>.json`, keyed by its size and
modification time; skipped where the folder is read-only). A batch reads just its samples'
members with positioned reads. Compressed shards (.tar.gz) cannot be read by index and are
refused with the way out.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hvtrain.data.sources import FILES, Source, file_stat, match_files
from hvtrain.errors import DataError

IMAGES = ("jpg", "jpeg", "png")
ARRAYS = ("npy",)
LABELS = ("cls", "cls.txt")
# webdataset's own split of a member name: key = path up to the first dot of the file name
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
INDEX_VERSION = 1


def _index(path: Path) -> dict[str, Any]:
    """The shard's samples: key, data member (ext, offset, size) and class label, in tar order."""
    st = path.stat()
    cache = path.with_name(f".hvtrain-index-{path.name}.json")
    stamp = [INDEX_VERSION, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]  # cp -p/rsync -t: new inode, ctime
    try:
        saved = json.loads(cache.read_text())
        if _well_formed(saved) and saved["stamp"] == stamp:
            return saved
    except (OSError, ValueError):
        pass
    with path.open("rb") as fh:
        magic = fh.read(3)
    if magic[:2] == b"\x1f\x8b" or magic == b"BZh" or magic[:3] == b"\xfd7z":
        raise DataError(f"{path}: a compressed tar cannot be read by sample index; decompress the shards "
                        "(gunzip; WebDataset's own shards are plain .tar)")
    samples: dict[str, dict[str, Any]] = {}
    last = None
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                found = _KEY.match(member.name)
                if found is None or Path(member.name).name.startswith("."):
                    continue  # no extension (or a hidden file): not part of a sample
                key, ext = found.group(1), found.group(2).lower()
                if key in samples and key != last:
                    raise DataError(f"{path}: sample {key!r} appears again after other samples ({member.name}); "
                                    "webdataset groups consecutive members, so this would be another sample with "
                                    "the same key: write each sample's members together, once")
                last = key
                sample = samples.setdefault(key, {"key": key})
                if ext in LABELS and "cls" in sample:
                    raise DataError(f"{path}: sample {key!r} has two labels ({member.name} and another cls "
                                    "member)")
                if ext in LABELS:
                    text = tar.extractfile(member).read().decode("utf-8", "replace").strip()
                    try:
                        sample["cls"] = int(text)
                    except ValueError:
                        raise DataError(f"{path}: sample {key!r}: {member.name} holds {text[:40]!r}, not a class "
                                        "index (an integer as text)") from None
                elif ext in IMAGES + ARRAYS:
                    if "ext" in sample:
                        raise DataError(f"{path}: sample {key!r} has two inputs, {sample['ext']} and {ext} (one "
                                        f"image or array per sample: {', '.join(IMAGES + ARRAYS)})")
                    sample.update(ext=ext, offset=member.offset_data, size=member.size)
    except tarfile.TarError as exc:
        raise DataError(f"{path}: not a readable tar file ({exc})") from None
    rows = list(samples.values())
    for s in rows:
        if "ext" not in s:
            raise DataError(f"{path}: sample {s['key']!r} has no input member ({', '.join(IMAGES + ARRAYS)})")
        if "cls" not in s:
            raise DataError(f"{path}: sample {s['key']!r} has no label member ({s['key']}.cls: the class index)")
    index = {"stamp": stamp, "keys": [s["key"] for s in rows], "ext": [s["ext"] for s in rows],
             "offset": [s["offset"] for s in rows], "size": [s["size"] for s in rows],
             "cls": [s["cls"] for s in rows]}
    tmp = None
    try:  # a fresh private name (mkstemp: O_EXCL, never a planted link), then one rename
        fd, tmp = tempfile.mkstemp(prefix=f".{cache.name}.", suffix=".tmp", dir=cache.parent)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(index))
        os.replace(tmp, cache)
    except OSError:  # a read-only folder: scanned again next run
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return index


def _well_formed(saved: Any) -> bool:
    """A cached index this version wrote: every list as long as the keys, of the right types."""
    if not isinstance(saved, dict) or set(saved) != {"stamp", "keys", "ext", "offset", "size", "cls"}:
        return False
    n = len(saved["keys"]) if isinstance(saved["keys"], list) else -1
    lists = [saved[k] for k in ("keys", "ext", "offset", "size", "cls")]
    return n > 0 and all(isinstance(v, list) and len(v) == n for v in lists) and \
        all(isinstance(e, str) and e in IMAGES + ARRAYS for e in saved["ext"]) and \
        all(type(v) is int and v >= 0 for k in ("offset", "size") for v in saved[k]) and \
        all(type(v) is int for v in saved["cls"])


class TarSource(Source):
    """The samples of many WebDataset shards behind one global index."""

    def __init__(self, paths: list[Path], name: str, image: tuple[tuple[int, int], int] | None) -> None:
        self.paths, self.name, self.image = paths, name, image
        self.indexes = [_index(p) for p in paths]
        for p, ix in zip(paths, self.indexes, strict=True):
            if not ix["keys"]:
                raise DataError(f"{p}: the shard holds no samples")
        self.starts = np.concatenate([[0], np.cumsum([len(ix["keys"]) for ix in self.indexes])]).astype(np.int64)
        kinds = {("image" if e in IMAGES else "array") for ix in self.indexes for e in set(ix["ext"])}
        if len(kinds) > 1:
            raise DataError(f"{name}: the shards mix images and .npy arrays (one kind of input per dataset)")
        self.arrays = kinds == {"array"}
        if not self.arrays and image is None:
            raise DataError(f"{name}: the samples are images: data.image.size is required")
        if self.arrays and image is not None:
            raise DataError(f"{name}: the samples are .npy arrays, used as they are: data.image.size is for encoded "
                            "images (jpg/png); remove it (model.input_shape reshapes the arrays)")
        first = self._decode(0, 0)
        self._shape, self._dtype = tuple(first.shape), first.dtype

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return self._shape

    def _decode(self, k: int, i: int) -> np.ndarray:
        from hvtrain.data.images import decode

        ix, path = self.indexes[k], self.paths[k]
        size = ix["size"][i]
        data = bytearray(size)
        try:
            done = FILES.pread_into(path, memoryview(data), ix["offset"][i]) if size else 0
        except OSError as exc:
            raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None
        where = f"{path}: sample {ix['keys'][i]!r} ({ix['keys'][i]}.{ix['ext'][i]})"
        if done != size:
            raise DataError(f"{where}: short read ({done} of {size} bytes): the shard changed or is truncated")
        if not self.arrays:
            return decode(bytes(data), *self.image, where=where)
        try:
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise DataError(f"{where}: not a readable .npy array ({exc})") from None
        if array.dtype.hasobject or not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
            raise DataError(f"{where}: expected a numeric array, got dtype {array.dtype}")
        return array

    def features(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"{self.name}: sample index out of range 0..{len(self) - 1}")
        out = np.empty((len(indices), *self._shape), self._dtype)
        which = np.searchsorted(self.starts, indices, side="right") - 1
        for n, (k, index) in enumerate(zip(which, indices, strict=True)):
            row = self._decode(int(k), int(index - self.starts[k]))
            if row.shape != self._shape:
                ix = self.indexes[k]
                i = int(index - self.starts[k])
                raise DataError(f"{self.paths[k]}: sample {ix['keys'][i]!r}: an array of shape {list(row.shape)}, "
                                f"the first sample's is {list(self._shape)}")
            out[n] = row
        return out

    def labels(self) -> np.ndarray:
        return np.concatenate([np.asarray(ix["cls"], np.int64) for ix in self.indexes])

    def identity(self) -> list[Any]:
        from hvtrain.data.images import decoder

        return [[file_stat(p) for p in self.paths], self.image, None if self.arrays else decoder(),
                hashlib.sha256(json.dumps([ix["keys"] for ix in self.indexes]).encode()).hexdigest()[:16]]

    def cache_dir(self) -> Path:
        return self.paths[0].parent


def open_tars(cfg: Any, pattern: str) -> TarSource:
    from hvtrain.data.images import image_size

    paths = [Path(p) for p in match_files(pattern, Path(cfg.source).parent, "tar shard")]
    image = image_size(cfg) if cfg.data.image.size is not None else None
    return TarSource(paths, cfg.data.dataset, image)
