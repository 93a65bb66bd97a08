"""Decode + augment throughput (issue 23): one JPEG folder read for one epoch of batches of 64 by
hvtrain's loader (images:DIR, data.augment, data.workers 1 and 2, the prefetch thread), by a
torch DataLoader (num_workers the same, PIL decode, the same transforms written with torch
tensor ops as torchvision's v2 transforms are) and by tf.data (num_parallel_calls AUTOTUNE,
tf.io.decode_jpeg, the same transforms in tf.image ops), alternated, in one process each.

Transforms, the same on every side: decode to RGB, bilinear resize to 48x48, zero padding of 4 and
a random 48x48 crop, horizontal flip with probability 1/2, brightness and contrast factors from
[0.8, 1.2], float32 out; shuffled order. No model runs: images/s of the input pipeline alone.

Usage: python bench/run.py --only image_decode   (make bench runs it)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import PY, logger, repeats
from common import run as run_command

IMAGES, QUICK_IMAGES = 3000, 256
SIZE, PAD, BATCH = 48, 4, 64

SIDE = r'''
import json, sys, time
import numpy as np


def main():
    side, root, workers, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    SIZE, PAD, BATCH = 48, 4, 64
    from pathlib import Path
    files = sorted(str(p) for p in Path(root).rglob("*.jpg"))
    labels = [int(Path(f).parent.name) for f in files]

    def timed(batches):
        """(images after the first batch, seconds after it, seconds to the first batch): the
        steady rate, without the start of the workers (kept for a whole run in training)."""
        t0, n, first = time.perf_counter(), 0, None
        for x in batches:
            if first is None:
                first = time.perf_counter()
                continue
            n += len(x)
        return n, time.perf_counter() - first, first - t0

    if side == "hvtrain":
        from hvtrain.config.load import load_config
        from hvtrain.data.batches import epoch_permutation, shard_batches
        from hvtrain.data.dataset import load_dataset
        from hvtrain.data.loader import Prefetcher, Workers
        cfg_path = Path(out).with_suffix(".yaml")
        cfg_path.write_text(
            f"name: b\ndata: {{dataset: 'images:{root}', image: {{size: [{SIZE}, {SIZE}], channels: 3}}, "
            f"normalize: none, validation_split: 0, batch_size: {BATCH}, workers: {workers}, "
            f"augment: {{crop_padding: {PAD}, flip: horizontal, brightness: 0.2, contrast: 0.2}}}}\n"
            f"model: {{input_shape: [{SIZE}, {SIZE}, 3], layers: [{{type: flatten}}, {{type: dense, units: 10}}]}}\n")
        cfg = load_config(cfg_path)
        data = load_dataset(cfg)
        pool = Workers(data.train, workers) if workers else None
        def batches():
            order = epoch_permutation(len(data.train), 0, 0, True)
            with Prefetcher(data.train, shard_batches(order, BATCH, 0, 1), 2, epoch=0, workers=pool) as p:
                for _, x, _ in p:
                    yield x
        n, took, first = timed(batches())
        if pool:
            pool.close()
    elif side == "torch":
        import torch
        from PIL import Image
        torch.set_num_threads(1)

        class Folder(torch.utils.data.Dataset):
            def __len__(self):
                return len(files)

            def __getitem__(self, i):
                with Image.open(files[i]) as im:
                    im = im.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
                    x = torch.from_numpy(np.asarray(im, np.float32).copy())
                x = torch.nn.functional.pad(x.permute(2, 0, 1), (PAD, PAD, PAD, PAD))
                top, left = torch.randint(0, 2 * PAD + 1, (2,)).tolist()
                x = x[:, top:top + SIZE, left:left + SIZE]
                if torch.rand(()) < 0.5:
                    x = x.flip(-1)
                x = (x * (0.8 + 0.4 * torch.rand(()))).clamp(0, 255)
                m = x.mean()
                x = ((x - m) * (0.8 + 0.4 * torch.rand(())) + m).clamp(0, 255)
                return x.permute(1, 2, 0), labels[i]

        loader = torch.utils.data.DataLoader(Folder(), batch_size=BATCH, shuffle=True, num_workers=workers,
                                             prefetch_factor=2 if workers else None, persistent_workers=False)
        n, took, first = timed(x for x, _ in loader)
    else:
        import tensorflow as tf
        def load(path):
            x = tf.image.resize(tf.io.decode_jpeg(tf.io.read_file(path), channels=3), (SIZE, SIZE), "bilinear")
            x = tf.image.pad_to_bounding_box(x, PAD, PAD, SIZE + 2 * PAD, SIZE + 2 * PAD)
            x = tf.image.random_crop(x, (SIZE, SIZE, 3))
            x = tf.image.random_flip_left_right(x)
            x = tf.clip_by_value(x * tf.random.uniform((), 0.8, 1.2), 0, 255)
            m = tf.reduce_mean(x)
            return tf.clip_by_value((x - m) * tf.random.uniform((), 0.8, 1.2) + m, 0, 255)
        ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files), seed=0)
        ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE).batch(BATCH).prefetch(tf.data.AUTOTUNE)
        n, took, first = timed(x.numpy() for x in ds)
    Path(out).write_text(json.dumps({"images": n, "seconds": took, "first_batch_s": first}))


if __name__ == "__main__":  # hvtrain's workers are spawned: they import this file
    main()
'''


def folder(root: Path, count: int) -> Path:
    """`count` 64x64 RGB JPEGs (quality 90) in 10 class folders: scikit-learn's digits upscaled
    and tinted per image, so no two files are the same bytes."""
    from PIL import Image
    from sklearn.datasets import load_digits

    done = root / "complete"
    if done.is_file() and done.read_text() == str(count):
        return root
    digits = load_digits()
    rng = np.random.default_rng(0)
    for i in range(count):
        k = i % len(digits.target)
        gray = Image.fromarray((digits.images[k] * 255 / 16).astype(np.uint8))
        gray = gray.resize((64, 64), Image.Resampling.BICUBIC)
        tint = rng.uniform(0.5, 1.0, 3)
        rgb = (np.asarray(gray, np.float32)[..., None] * tint + rng.normal(0, 8, (64, 64, 3))).clip(0, 255)
        d = root / str(digits.target[k])
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rgb.astype(np.uint8)).save(d / f"{i:05d}.jpg", quality=90)
    done.write_text(str(count))
    return root


def measure_one(side: str, root: Path, workers: int, out: Path) -> float:
    script = out.parent / "side.py"
    script.write_text(SIDE)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    run_command([PY, str(script), side, str(root), str(workers), str(out)], 900, env=env)
    r = json.loads(out.read_text())
    return r["images"] / r["seconds"]  # after the first batch: workers started, pipeline full


def run(quick: bool) -> dict:
    log = logger("image_decode")
    with tempfile.TemporaryDirectory(prefix="bench-images-") as tmp:
        base = Path(tmp) if quick else Path(os.environ.get("BENCH_DATA", "/tmp/hvtrain-bench-data"))
        count = QUICK_IMAGES if quick else IMAGES
        root = folder(base / f"jpeg-{count}", count)
        sides = [("hvtrain", 1), ("torch", 1), ("tf.data", 1), ("hvtrain", 2), ("torch", 2)]
        rates: dict[str, list[float]] = {f"{s} {w}": [] for s, w in sides}
        if not quick:  # warm-up: the page cache, hvtrain's statistics cache
            measure_one("hvtrain", root, 0, Path(tmp) / "warm.json")
        for i in range(repeats(quick)):
            for side, workers in sides:
                rate = measure_one(side, root, workers, Path(tmp) / f"{side}-{workers}-{i}.json")
                rates[f"{side} {workers}"].append(rate)
                log(f"{side} workers={workers} rep {i + 1}: {rate:,.0f} images/s")
    med = {k: statistics.median(v) for k, v in rates.items()}
    rows = [[k.split()[0], k.split()[1] if not k.startswith("tf.data") else "AUTOTUNE", f"{med[k]:,.0f}",
             f"{min(v):,.0f}-{max(v):,.0f}"] for k, v in rates.items()]
    checks = []

    def spread(a: list[float], b: list[float]) -> list[float]:
        ratios = [x / y for x, y in zip(a, b, strict=True)]  # per repetition: the sides ran back to back
        return [round(min(ratios), 3), round(max(ratios), 3)]

    for w in (1, 2):
        ratio = med[f"hvtrain {w}"] / med[f"torch {w}"]
        checks.append({"goal": f"hvtrain ÷ torch DataLoader, {w} worker(s) >= 1.0", "measured": round(ratio, 3),
                       "spread": spread(rates[f"hvtrain {w}"], rates[f"torch {w}"]),
                       "met": None if quick else ratio >= 1.0})
    best = max(med["hvtrain 1"], med["hvtrain 2"])
    top = "hvtrain 2" if med["hvtrain 2"] >= med["hvtrain 1"] else "hvtrain 1"
    checks.append({"goal": "hvtrain (best of 1, 2 workers) ÷ tf.data AUTOTUNE >= 1.0",
                   "measured": round(best / med["tf.data 1"], 3), "spread": spread(rates[top], rates["tf.data 1"]),
                   "met": None if quick else best >= med["tf.data 1"]})
    return {
        "title": "Decode + augment (a JPEG folder, one epoch)",
        "goal": "images/s of hvtrain's loader >= torch DataLoader (same workers) and >= tf.data AUTOTUNE",
        "columns": ["loader", "workers", "images/s", "spread"], "rows": rows, "checks": checks,
        "met": None if quick else all(c["met"] for c in checks),
        "notes": [f"{count} JPEGs 64x64 RGB; decode, resize to {SIZE}x{SIZE}, pad {PAD} + random crop, flip, "
                  f"brightness/contrast 0.2, batches of {BATCH}, shuffled; one process per side (no model), the "
                  "sides alternated; hvtrain decodes these JPEGs with simplejpeg (Pillow's pixels) and its "
                  "workers return batches through shared memory; torch decodes with PIL as its docs do; "
                  "tf.data's parallelism is threads (AUTOTUNE), not a worker count. "
                  f"Machine: {os.cpu_count()} cores."],
        "raw": {"images": count, "rates": rates},
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(json.dumps(run(os.environ.get("BENCH_QUICK") == "1"), indent=2))
