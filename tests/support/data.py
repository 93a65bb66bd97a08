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
