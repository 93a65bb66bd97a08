"""Data files the way users have them, written from data the machine ships (no downloads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def digits_image_folder(root: Path, per_class: int, start: int = 0, classes: int = 10
                        ) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits as an image folder, `root/<class>/NNNN.png` (grayscale, pixels
    0..16 scaled to 0..240): the first `per_class` samples of each of the first `classes` classes
    from sample `start` on. Returns (x (N, 8, 8, 1) uint8, y) in digits' own order (classes
    interleaved; a file's name is its rank within its class, so the folder's order is a stable
    sort by class)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits, labels = load_digits(return_X_y=True)
    pixels = (digits * 15).astype(np.uint8).reshape(-1, 8, 8)
    counts: dict[int, int] = {}
    xs, ys = [], []
    for i in range(start, len(labels)):
        c = int(labels[i])
        if c >= classes or counts.get(c, 0) >= per_class:
            continue
        folder = root / str(c)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels[i]).save(folder / f"{counts.get(c, 0):04d}.png")
        counts[c] = counts.get(c, 0) + 1
        xs.append(pixels[i])
        ys.append(c)
        if len(ys) == per_class * classes:
            break
    return np.stack(xs)[..., None], np.array(ys)


def digits_arrays(n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: (x (N, 64) float64 pixels 0..16, y int64)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x[:n], y[:n]) if n else (x, y)


def digits_parquet(root: Path, n: int, files: int = 2, row_group: int = 50, layout: str = "columns"
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The first `n` digits as Parquet files `root/part-K.parquet` (pyarrow, `row_group` rows per
    row group): `columns` one float column per pixel p0..p63, `list` one list<double> column
    `pixels`, `image` HF datasets' Image struct {bytes: PNG, path} in column `image` (8x8 L).
    A `label` column beside. Returns (x, y) in file order (x: (N, 64) float64, or (N, 8, 8, 1)
    uint8 for `image`)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    x, y = digits_arrays(n)
    root.mkdir(parents=True, exist_ok=True)
    pixels = (x * 15).astype(np.uint8).reshape(-1, 8, 8)
    for k, part in enumerate(np.array_split(np.arange(len(y)), files)):
        if layout == "columns":
            cols = {f"p{j}": x[part, j] for j in range(64)}
        elif layout == "list":
            cols = {"pixels": pa.array(list(x[part]), pa.list_(pa.float64()))}
        else:
            def png(i: int) -> bytes:
                from PIL import Image

                buf = io.BytesIO()
                Image.fromarray(pixels[i]).save(buf, format="PNG")
                return buf.getvalue()
            cols = {"image": pa.array([{"bytes": png(i), "path": f"{i}.png"} for i in part],
                                      pa.struct([("bytes", pa.binary()), ("path", pa.string())]))}
        pq.write_table(pa.table({**cols, "label": pa.array(y[part], pa.int64())}), root / f"part-{k}.parquet",
                       row_group_size=row_group)
    return (pixels[..., None], y) if layout == "image" else (x, y)


def digits_webdataset(root: Path, n: int, shards: int = 2, kind: str = "png") -> tuple[np.ndarray, np.ndarray]:
    """The first `n` digits as WebDataset shards `root/shard-K.tar`, written by webdataset's own
    TarWriter: `<key>.png` (8x8 L, pixels scaled to 0..240) or `<key>.npy` (64 float32 pixels) and
    `<key>.cls`. Returns (x, y) in shard order ((N, 8, 8, 1) uint8 for png, (N, 64) float32 for npy)."""
    import webdataset as wds

    x, y = digits_arrays(n)
    root.mkdir(parents=True, exist_ok=True)
    pixels = (x * 15).astype(np.uint8).reshape(-1, 8, 8)
    for k, part in enumerate(np.array_split(np.arange(len(y)), shards)):
        with wds.TarWriter(str(root / f"shard-{k:03d}.tar")) as sink:
            for i in part:
                value = {"png": pixels[i]} if kind == "png" else {"npy": x[i].astype(np.float32)}
                sink.write({"__key__": f"s{i:06d}", **value, "cls": int(y[i])})
    return (pixels[..., None], y) if kind == "png" else (x.astype(np.float32), y)
