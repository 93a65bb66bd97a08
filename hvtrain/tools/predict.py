"""Batch inference: raw feature rows -> model outputs, data parallel over ranks, in input order.

The one predict path behind `hvtrain predict` and `hvtrain.predict`. Everything a prediction
needs besides the config's model comes from the weights file (hvtrain.model.weights: the training
split's normalisation, the raw row shape, the classes), so the training data is never opened.

Rows are processed in rounds of `size * batch`: in each round rank r predicts the contiguous
block `[start + r*batch, start + (r+1)*batch)` and rank 0 gathers the round's blocks in rank
order, so it receives the rows in input order and streams them to the output file. No rank holds
more than one round: `.npy` inputs are read by positioned reads of just the block's rows
(hvtrain.data.sources.NpyArray), CSV inputs are streamed (validated in a first pass before any
framework starts, so a bad row is a `file:line` error, exit 2).
"""

from __future__ import annotations

import csv
import hashlib
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hvtrain.config.schema import Config
from hvtrain.data.sources import NpyArray
from hvtrain.errors import DataError, HvtrainError
from hvtrain.launch.process import launcher_rank
from hvtrain.model.native import PROBE_ROWS
from hvtrain.model.spec import ModelSpec, build_spec, check_weights
from hvtrain.model.weights import Inputs, read_weights, require_inputs
from hvtrain.runtime.experiment import ConfigSource, load_experiment
from hvtrain.runtime.session import loaded_model

PREDICT_BATCH = 1024  # rows per rank per round
KINDS = ("probabilities", "logits", "labels")
CLASSIFICATION = ("cross_entropy", "binary_cross_entropy")


# ----------------------------------------------------------------------------- inputs


class Rows(ABC):
    """Raw feature rows as the dataset stores them, read by contiguous ranges in increasing order."""

    name: str
    shape: tuple[int, ...]  # one row

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def read(self, lo: int, hi: int) -> np.ndarray:
        """Rows lo..hi-1 as a new array."""

    def close(self) -> None:  # noqa: B027 - most kinds hold nothing open
        """Release what reading holds open (a CSV file)."""


class ArrayRows(Rows):
    """An array in memory or memory-mapped (the Python API)."""

    def __init__(self, x: Any, name: str = "x") -> None:
        self.x, self.name = (x if isinstance(x, np.ndarray) else np.asarray(x)), name
        if self.x.ndim == 0:
            raise DataError(f"{name}: expected one row of features per sample, got a scalar")
        self.shape = tuple(self.x.shape[1:])

    def __len__(self) -> int:
        return len(self.x)

    def read(self, lo: int, hi: int) -> np.ndarray:
        return np.array(self.x[lo:hi])


class NpyRows(Rows):
    """A .npy file: each block is one positioned read of its rows (nothing stays mapped)."""

    def __init__(self, path: Path) -> None:
        self.array, self.name = NpyArray(path), str(path)
        self.shape = tuple(self.array.shape[1:])
        if self.array.dtype.kind not in "biuf":
            raise DataError(f"{path}: expected numbers, got an array of dtype {self.array.dtype}")

    def __len__(self) -> int:
        return len(self.array)

    def read(self, lo: int, hi: int) -> np.ndarray:
        return self.array.rows(np.arange(lo, hi))


class CsvRows(Rows):
    """A numeric CSV file: a header line, then one sample per line, blank lines skipped. Checked
    whole when opened; streamed afterwards.

    The first line is always the header, as training's `csv:` datasets read it (data._read_csv):
    one rule for both, and no guess. Guessing by content read pandas' `to_csv(index=False)` header
    of integer column names (`0,1,2`) as a data row, shifting every output by one row. A first
    line of other numbers is refused: it is a file without a header (np.savetxt's default), whose
    first sample would otherwise be dropped and every prediction moved a row.
    """

    def __init__(self, path: Path, width: int) -> None:
        self.path, self.name, self.width = path, str(path), width
        self.shape = (width,)
        self.n = sum(1 for _ in self._numbers())
        if self.n == 0:
            raise DataError(f"{path}: expected a header line and at least one row of numbers, got no rows")
        self._iter: Iterator[np.ndarray] | None = None
        self._pos = 0

    def _numbers(self) -> Iterator[np.ndarray]:
        try:
            with self.path.open(newline="") as fh:
                reader = csv.reader(fh)
                header = None
                for row in reader:
                    if not row:
                        continue
                    if header is None:
                        header = row
                        if len(row) != self.width:
                            raise DataError(f"{self.path}:{reader.line_num}: expected a header line of {self.width} "
                                            f"column names (the model's features; the first line is always the "
                                            f"header, as in training's CSV), got {len(row)} fields")
                        if all(_is_number(v) for v in row) and [v.strip() for v in row] != \
                                [str(i) for i in range(self.width)]:
                            raise DataError(f"{self.path}:{reader.line_num}: the first line is the header (column "
                                            f"names), but it holds numbers ({', '.join(row[:3])}, ...): a file "
                                            "without a header line would lose its first row to it; add a line of "
                                            "column names (np.savetxt(..., header=','.join(names), comments=''); "
                                            "pandas' integer names 0,1,2,... are taken as names)")
                        continue
                    yield self._parse(row, reader.line_num)
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            raise DataError(f"{self.path}: cannot read CSV ({exc})") from None

    def _parse(self, row: list[str], line: int) -> np.ndarray:
        if len(row) != self.width:
            raise DataError(f"{self.path}:{line}: expected {self.width} values (the model's features), got "
                            f"{len(row)}")
        try:
            return np.array([float(v) for v in row])
        except ValueError:
            j, bad = next((j, v) for j, v in enumerate(row) if not _is_number(v))
            raise DataError(f"{self.path}:{line}: column {j + 1}: expected a number, got {bad!r}") from None

    def __len__(self) -> int:
        return self.n

    def read(self, lo: int, hi: int) -> np.ndarray:
        if self._iter is None or lo < self._pos:
            self.close()
            self._iter, self._pos = self._numbers(), 0
        out = np.empty((hi - lo, self.width))
        try:
            for _ in range(lo - self._pos):
                next(self._iter)
            for i in range(hi - lo):
                out[i] = next(self._iter)
        except StopIteration:
            raise DataError(f"{self.path}: the file changed while it was read (fewer than {hi} rows)") from None
        self._pos = hi
        return out

    def close(self) -> None:
        if self._iter is not None:
            self._iter.close()
            self._iter = None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def open_input(path: str | Path, inputs: Inputs) -> Rows:
    """A .npy or .csv file of raw feature rows; for a model trained on a text corpus also a .txt
    file of texts, one per line, encoded by the vocabulary saved with its weights.

    Raises:
        DataError: missing, unreadable, another suffix, a bad CSV row (`file:line`); .txt for a
            model without a vocabulary.
    """
    p = Path(path)
    suffixes = (".npy", ".csv", ".txt") if inputs.text is not None else (".npy", ".csv")
    if p.suffix not in suffixes:
        texts = " (texts are taken by a model trained on a text corpus, with its vocabulary)" \
            if p.suffix == ".txt" else ""
        raise DataError(f"{p}: expected a {' or '.join(suffixes)} file of feature rows, got "
                        f"{p.suffix or 'no suffix'}{texts}")
    if not p.is_file():
        raise DataError(f"{p}: input file not found")
    if p.suffix == ".txt":
        from hvtrain.data import text

        return ArrayRows(text.encode_texts(text.read_texts(p), inputs.text), str(p))
    return NpyRows(p) if p.suffix == ".npy" else CsvRows(p, inputs.width)


def row_shape(rows: Rows, inputs: Inputs, weights: str) -> tuple[int, ...]:
    """The raw row shape the model was trained on, if `rows` holds rows of it (or of as many values).

    Raises:
        DataError: wrong feature count or shape, or no rows.
    """
    shape = rows.shape if rows.shape else (1,)
    if len(rows) == 0:
        raise DataError(f"{rows.name}: expected at least one row of features, got none")
    if shape != inputs.features and shape != (inputs.width,):
        raise DataError(f"{rows.name}: rows of shape {list(shape)} ({math.prod(shape)} values), but the model in "
                        f"{weights} was trained on rows of shape {list(inputs.features)} ({inputs.width} values)")
    return inputs.features


# ----------------------------------------------------------------------------- outputs


def convert(kind: str, loss: str, logits: np.ndarray, classes: np.ndarray | None,
            target: tuple[float, float] | None = None) -> np.ndarray:
    """Model outputs as `kind`: probabilities (softmax for cross_entropy; sigmoid, the second class's,
    for binary_cross_entropy), logits, or labels (the dataset's own label values). Regression
    outputs are the predicted targets whatever the kind but labels: in the targets' own units (a
    model trained on normalised targets, `target` = (shift, scale), has them scaled back)."""
    if loss not in CLASSIFICATION:
        if target is None:
            return logits.astype(np.float32)
        return (logits.astype(np.float64) * target[1] + target[0]).astype(np.float32)
    if kind == "logits":
        return logits.astype(np.float32)
    z = logits.astype(np.float64)
    if kind == "probabilities":
        if loss == "cross_entropy":
            e = np.exp(z - z.max(axis=1, keepdims=True))
            return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
        return (0.5 * (1.0 + np.tanh(0.5 * z))).astype(np.float32)  # sigmoid, no overflow
    ids = z.argmax(axis=1) if loss == "cross_entropy" else (z[:, 0] > 0).astype(np.int64)
    return classes[ids] if classes is not None else ids


def label_dtype(inputs: Inputs) -> np.dtype:
    return inputs.classes.dtype if inputs.classes is not None else np.dtype(np.int64)


class Collected:
    """Blocks kept in memory (the Python API)."""

    def __init__(self) -> None:
        self.blocks: list[np.ndarray] = []

    def write(self, block: np.ndarray) -> None:
        self.blocks.append(block)

    def result(self) -> np.ndarray:
        return np.concatenate(self.blocks)


# ----------------------------------------------------------------------------- the path


@dataclass
class Model:
    """A config's model with weights that fit it, and what its inputs and outputs are."""

    cfg: Config
    spec: ModelSpec | None
    weights: dict[str, np.ndarray]
    inputs: Inputs
    path: str


def load_model(config: ConfigSource, weights_path: str, backend: str | None = None,
               overrides: Sequence[str] = (), model: Any = None, data: Any = None) -> Model:
    """Config + weights (final.safetensors or a checkpoint) + their inputs record, all checked before
    any framework is imported.

    Raises:
        ConfigError, DataError, CheckpointError: bad config, unreadable or foreign weights, no inputs record.
    """
    cfg = load_experiment(config, backend, None, overrides, model, data, need_data=False)
    spec = build_spec(cfg) if cfg.model.entrypoint is None else None
    wf = read_weights(weights_path)
    inputs = require_inputs(wf)
    if inputs.loss != cfg.loss:
        raise DataError(f"{weights_path}: trained with loss {inputs.loss!r}, the config says {cfg.loss!r}: is it the "
                        "config the weights were trained with?")
    if spec is not None:
        check_weights(spec, wf.weights, weights_path)
        if math.prod(spec.input_shape) != inputs.width:
            raise DataError(f"{weights_path}: trained on rows of {inputs.width} values {list(inputs.features)}, "
                            f"the config's model takes {list(spec.input_shape)}")
        if spec.output_shape != (inputs.outputs,):
            raise DataError(f"{weights_path}: trained for {inputs.outputs} outputs, the config's model has "
                            f"{list(spec.output_shape)}")
        # the model's own input shape is authoritative (same values, reshaped as the model takes them)
        inputs = replace(inputs, transform=replace(inputs.transform, shape=tuple(spec.input_shape)))
    return Model(cfg, spec, wf.weights, inputs, weights_path)


def rounds(n: int, size: int, batch: int) -> Iterator[list[tuple[int, int]]]:
    """Per round, each rank's contiguous block [lo, hi) of rows (empty past the end): concatenated in
    rank order, the rounds' blocks are 0..n-1 in order."""
    for start in range(0, n, size * batch):
        yield [(min(n, start + r * batch), min(n, start + (r + 1) * batch)) for r in range(size)]


def run(m: Model, rows: Rows, sinks: dict[str, Any] | None, batch: int, session: Any) -> None:
    """Predict every row of `rows` on this rank's blocks; rank 0 writes each round to `sinks`
    (kind -> object with write(block)), which other ranks do not have (None)."""
    rt = session.runtime
    info = rt.info
    shape = row_shape(rows, m.inputs, m.path)
    agree = rt.allgather_object((len(rows), shape, _fingerprint(m)))
    if len(set(agree)) > 1:
        detail = "; ".join(f"rank {r}: {n} rows of {list(s)}" for r, (n, s, _) in enumerate(agree))
        raise HvtrainError(f"ranks disagree on the input or the weights ({detail}): every rank must read the same "
                           "files")
    if info.rank == 0 and m.inputs.target is None and m.cfg.loss not in CLASSIFICATION and \
            m.cfg.data is not None and m.cfg.data.window is not None and m.cfg.data.normalize != "none":
        from hvtrain.io.reporter import report_warning

        report_warning(info, f"{m.path} was written before a forecaster's target normalisation travelled with its "
                             "weights: its outputs are normalised; multiply by series.scale and add series.shift "
                             "(the run's summary.json), or retrain")
    width: tuple[int, ...] | None = None
    for blocks in rounds(len(rows), info.size, batch):
        lo, hi = blocks[info.rank]
        out = b""
        if hi > lo:
            raw = rows.read(lo, hi).reshape((hi - lo,) + shape)
            logits = np.ascontiguousarray(session.backend.predict(m.inputs.transform(raw)), np.float32)
            if logits.shape[1:] != (m.inputs.outputs,):  # an entrypoint model has no spec to check before
                raise DataError(f"{m.path}: the model outputs {list(logits.shape[1:])} values per row, its weights "
                                f"were trained for {m.inputs.outputs}")
            width = width or tuple(logits.shape[1:])
            out = logits.tobytes()
        parts = rt.gather_bytes(out)
        if parts is None:
            continue
        logits = np.frombuffer(b"".join(parts), np.float32).reshape((-1,) + width)  # rank 0 always has rows
        for kind, sink in sinks.items():
            sink.write(convert(kind, m.cfg.loss, logits, m.inputs.classes, m.inputs.target))


def probe_rows(m: Model, rows: Rows) -> np.ndarray | None:
    """The batch an entrypoint model is probed on when it is loaded (hvtrain.model.native): the input's
    first rows as the model takes them; None for a config's model (its spec was checked)."""
    if m.spec is not None:
        return None
    n = min(PROBE_ROWS, len(rows))
    return m.inputs.transform(rows.read(0, n).reshape((n,) + row_shape(rows, m.inputs, m.path)))


def _fingerprint(m: Model) -> str:
    h = hashlib.sha256()
    for k in sorted(m.weights):
        h.update(k.encode() + np.ascontiguousarray(m.weights[k]).tobytes())
    return h.hexdigest()[:16]


def _check_kind(kind: str, m: Model) -> None:
    if kind not in KINDS:
        raise DataError(f"predict: expected kind {', '.join(KINDS)}, got {kind!r}")
    if kind == "labels" and m.cfg.loss not in CLASSIFICATION:
        raise DataError(f"predict: labels need a classification loss, the model was trained with {m.cfg.loss!r}")


def predict_array(config: ConfigSource, weights_path: str, x: Any, backend: str | None = None,
                  overrides: Sequence[str] = (), model: Any = None, data: Any = None, kind: str = "probabilities",
                  batch_size: int = PREDICT_BATCH) -> np.ndarray:
    """`kind` outputs for the raw rows `x` (an array, memory-mapped or not, or a .npy/.csv path), in
    order; every rank returns all of them."""
    m = load_model(config, weights_path, backend, overrides, model, data)
    _check_kind(kind, m)
    rows = open_input(x, m.inputs) if isinstance(x, (str, Path)) else ArrayRows(x)
    row_shape(rows, m.inputs, weights_path)
    try:
        with loaded_model(m.cfg, m.spec, m.weights, m.inputs.outputs, probe_rows(m, rows), m.inputs.output) as s:
            sink = Collected() if s.info.is_main else None
            run(m, rows, {kind: sink} if sink else None, batch_size, s)
            return s.runtime.broadcast_object(sink.result() if sink else None)
    finally:
        rows.close()


def predict_files(config: ConfigSource, weights_path: str, input_path: str, output: str,
                  labels: str | None = None, logits: bool = False, batch_size: int = PREDICT_BATCH,
                  backend: str | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """`hvtrain predict`: scores (probabilities, or `logits`) of every row of `input_path` to the
    .npy `output`, and with `labels` the predicted labels to that .npy; written by rank 0.
    Returns what was written."""
    m = load_model(config, weights_path, backend, overrides)
    kind = "logits" if logits else "probabilities"
    targets = {kind: Path(output), **({"labels": Path(labels)} if labels else {})}
    for k, p in targets.items():
        _check_kind(k, m)
        if p.suffix != ".npy":
            raise DataError(f"{p}: expected a .npy output path, got {p.suffix or 'no suffix'}")
        if p.resolve() == Path(input_path).resolve():
            raise DataError(f"{p}: the output would overwrite the input")
    if labels and Path(labels).resolve() == Path(output).resolve():
        raise DataError(f"{labels}: --labels and --output name the same file")
    if launcher_rank() in (None, 0):  # rank 0 writes: its file system is the one that counts
        for p in targets.values():
            check_output(p)
    rows = open_input(input_path, m.inputs)
    row_shape(rows, m.inputs, weights_path)
    files = {k: (p, len(rows), (m.inputs.outputs,) if k != "labels" else (),
                 np.dtype(np.float32) if k != "labels" else label_dtype(m.inputs)) for k, p in targets.items()}
    try:
        with loaded_model(m.cfg, m.spec, m.weights, m.inputs.outputs, probe_rows(m, rows), m.inputs.output) as s:
            from hvtrain.io.reporter import Reporter

            reporter = Reporter(s.info, Path(output).parent, keep_metrics=True)
            with reporter.npy_files(files) as sinks:  # rank 0; renamed into place only when complete
                run(m, rows, sinks, batch_size, s)
            result = {"rows": len(rows), "world_size": s.info.size, "backend": m.cfg.backend,
                      **{k: str(p) for k, p in targets.items()}}
            reporter.print(f"predicted {len(rows)} rows on {s.info.size} rank(s) with {m.cfg.backend}: {kind} "
                           f"[{len(rows)}, {m.inputs.outputs}] -> {output}"
                           + (f", labels -> {labels}" if labels else ""))
            return result
    finally:
        rows.close()


def check_output(path: Path) -> None:
    """An output path rank 0 can write: its directory exists and is writable, it is not a directory.

    Raises:
        DataError: naming the path and what is wrong with it.
    """
    parent = path.parent
    if path.is_dir():
        raise DataError(f"{path}: expected a .npy file path, got a directory")
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise DataError(f"{path}: the output directory {parent} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DataError(f"{path}: the output directory {parent} is not writable")
