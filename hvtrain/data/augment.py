"""Training-time augmentation of image rows, in numpy and Pillow, once for both backends.

Each sample's draws come from its own generator, keyed by (seed, epoch, the sample's index in its
source): the augmented batch is the same whatever the rank count, the batch split or the
framework, so `np=2 with batch b == np=1 with batch 2b` and torch == TF hold with augmentation on.
Validation, evaluate, predict and export never augment: they see the decoded (resized) images.

The operations, in this order (each only when configured), on (H, W, C) rows of 0..255 values:

    resized_crop: [lo, hi]   a crop of lo..hi of the area, aspect ratio 3/4..4/3 (torchvision's
                             RandomResizedCrop: 10 tries, else the centre crop), resized back to
                             H x W (Pillow bilinear)
    crop_padding: P          zero padding of P pixels on each side, then a random H x W crop
    flip: horizontal         mirrored left-right with probability 1/2
    brightness: B            pixel values times a factor drawn from [1 - B, 1 + B]
    contrast: C              (x - the image's mean) times a factor from [1 - C, 1 + C], plus the mean

Values are clipped to 0..255 after the colour changes; the rows come back float32 (a
brightness factor is not rounded to integers), and the run's normalisation follows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

AUGMENT_KEY = 0xA067


@dataclass(frozen=True)
class Augment:
    """The configured operations (hvtrain.config.schema.AugmentConfig's values) and the seed."""

    seed: int
    resized_crop: tuple[float, float] | None = None
    crop_padding: int = 0
    flip: bool = False
    brightness: float = 0.0
    contrast: float = 0.0

    @classmethod
    def from_config(cls, cfg: object) -> Augment | None:
        a = cfg.data.augment  # type: ignore[attr-defined]
        made = cls(cfg.seed, tuple(a.resized_crop) if a.resized_crop else None,  # type: ignore[attr-defined]
                   a.crop_padding, a.flip == "horizontal", a.brightness, a.contrast)
        return made if made.active else None

    @property
    def active(self) -> bool:
        return bool(self.resized_crop or self.crop_padding or self.flip or self.brightness or self.contrast)

    def describe(self) -> str:
        parts = []
        if self.resized_crop:
            parts.append(f"resized_crop {self.resized_crop[0]:g}-{self.resized_crop[1]:g}")
        if self.crop_padding:
            parts.append(f"crop_padding {self.crop_padding}")
        if self.flip:
            parts.append("flip horizontal")
        if self.brightness:
            parts.append(f"brightness {self.brightness:g}")
        if self.contrast:
            parts.append(f"contrast {self.contrast:g}")
        return ", ".join(parts)

    def __call__(self, rows: np.ndarray, samples: np.ndarray, epoch: int) -> np.ndarray:
        """Augmented copies of `rows` ((N, H, W, C)), row k drawn for source sample samples[k]."""
        out = np.empty(rows.shape, np.float32)
        for k, (row, sample) in enumerate(zip(rows, np.asarray(samples, np.int64), strict=True)):
            rng = np.random.default_rng([self.seed, epoch, int(sample), AUGMENT_KEY])
            out[k] = self.one(row, rng)
        return out

    def one(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        h, w, _ = image.shape
        x = image
        if self.resized_crop:
            top, left, ch, cw = _resized_crop_box(h, w, self.resized_crop, rng)
            x = _resize(x[top: top + ch, left: left + cw], h, w)
        if self.crop_padding:
            p = self.crop_padding
            padded = np.zeros((h + 2 * p, w + 2 * p, x.shape[2]), x.dtype)
            padded[p: p + h, p: p + w] = x
            i, j = rng.integers(0, 2 * p + 1, size=2)
            x = padded[i: i + h, j: j + w]
        if self.flip and rng.random() < 0.5:
            x = x[:, ::-1]
        x = x.astype(np.float32)
        if self.brightness:
            x = np.clip(x * np.float32(rng.uniform(1 - self.brightness, 1 + self.brightness)), 0, 255)
        if self.contrast:
            mean = np.float32(x.mean())
            x = np.clip((x - mean) * np.float32(rng.uniform(1 - self.contrast, 1 + self.contrast)) + mean, 0, 255)
        return x


def _resized_crop_box(h: int, w: int, scale: tuple[float, float], rng: np.random.Generator
                      ) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params with ratio 3/4..4/3: (top, left, height, width)."""
    area = h * w
    lo, hi = math.log(3 / 4), math.log(4 / 3)
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        ratio = math.exp(rng.uniform(lo, hi))
        cw, ch = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
    # the centre crop of the closest allowed ratio
    if w / h < 3 / 4:
        cw, ch = w, int(round(w / (3 / 4)))
    elif w / h > 4 / 3:
        ch, cw = h, int(round(h * (4 / 3)))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def _resize(x: np.ndarray, h: int, w: int) -> np.ndarray:
    """Pillow's bilinear resize of a uint8 (or 0..255 float) crop to h x w."""
    from PIL import Image

    if x.shape[:2] == (h, w):
        return x
    c = x.shape[2]
    img = Image.fromarray(np.ascontiguousarray(x.astype(np.uint8)[..., 0] if c == 1 else x.astype(np.uint8)))
    out = np.asarray(img.resize((w, h), Image.Resampling.BILINEAR))
    return out.reshape(h, w, c)
