"""Write the file datasets of examples/digits_images.yaml and examples/cancer_parquet.yaml from
data scikit-learn ships (no download): `make setup` runs it; it is idempotent and quick.

    python examples/make_data.py [OUT]      # OUT defaults to examples/data

- OUT/digits-jpeg/{train,val}/<class>/NNNN.jpg: the 1797 8x8 digits upscaled to 32x32 RGB JPEGs
  (bicubic, quality 95), the torchvision ImageFolder layout with an explicit split (every 5th
  image of a class is validation);
- OUT/cancer-parquet/part-{0,1}.parquet: the breast-cancer table (30 float columns named as
  scikit-learn names them, spaces as underscores, and an int `diagnosis` column; 0 malignant,
  1 benign), row groups of 100 rows, as Spark or pandas.to_parquet write tables.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def digits_jpeg(root: Path) -> int:
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    counts: dict[int, int] = {}
    for image, label in zip(digits.images, digits.target, strict=True):
        k = counts.get(int(label), 0)
        counts[int(label)] = k + 1
        folder = root / ("val" if k % 5 == 4 else "train") / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = Image.fromarray((image * 255 / 16).astype(np.uint8)).resize((32, 32), Image.Resampling.BICUBIC)
        pixels.convert("RGB").save(folder / f"{k:04d}.jpg", quality=95)
    return len(digits.target)


def cancer_parquet(root: Path) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    root.mkdir(parents=True, exist_ok=True)
    names = [n.replace(" ", "_") for n in data.feature_names]
    for k, rows in enumerate(np.array_split(np.arange(len(data.target)), 2)):
        table = pa.table({**{n: data.data[rows, j] for j, n in enumerate(names)},
                          "diagnosis": pa.array(data.target[rows], pa.int64())})
        pq.write_table(table, root / f"part-{k}.parquet", row_group_size=100)
    return len(data.target)


def main(out: Path) -> None:
    for name, write in (("digits-jpeg", digits_jpeg), ("cancer-parquet", cancer_parquet)):
        target = out / name
        if (target / ".complete").exists():
            print(f"{target}: already there")
            continue
        n = write(target)
        (target / ".complete").write_text(f"{n}\n")
        print(f"{target}: {n} samples")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "data")
