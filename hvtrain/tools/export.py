"""`hvtrain export`: a config's model with saved weights as ONNX, a SavedModel or TorchScript,
verified on the spot.

An artefact takes what `hvtrain predict` takes, raw rows `[N, *features]` as the dataset stores
them (float32; int64 for token models; float64 where features far from zero relative to their
spread need it: hvtrain.model.weights.export_dtypes), because the weights' `inputs` record (the training
split's normalisation and the reshape, hvtrain.model.weights) is built into the graph, and gives
what predict gives: class probabilities (softmax; binary: sigmoid, [N, 1]) or regression outputs.
Input `x`, output `probabilities` (or `outputs`).

Weights are neutral, so any backend exports any run's weights: the format picks the backend when
the config's does not write it (savedmodel: tensorflow, torchscript: torch). ONNX comes from
torch.onnx (the dynamo exporter) or tf2onnx (TensorFlow).

Verification: the framework predicts the rows through predict's own path (hvtrain.tools.predict.run)
and the written artefact, reloaded (onnxruntime for ONNX, tf.saved_model.load, torch.jit.load),
predicts the same raw rows; the largest difference must be <= TOLERANCE, absolute, or relative
to the framework's value where that exceeds 1 in magnitude (a forecast in ppm is float32 to ~3e-5
at 400: float32's resolution, not a mismatch). The rows are the
config's validation split, or `--input` rows when given (the data need not be present then). The
artefact is written under a temporary name beside PATH and renamed to PATH only once verified; on
any failure it is removed, so PATH never holds an unverified export. The validation split is
verified on its first VERIFY_ROWS rows (memory stays bounded; the output says how many).

PATH may replace only an artefact of the same format (an ONNX protobuf, a TorchScript archive, a
SavedModel directory), never the weights, the config or the --input file, nor any other file.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hvtrain.backends.registry import EXPORT_FORMATS
from hvtrain.errors import DataError, HvtrainError
from hvtrain.io.reporter import remove_dead_temps
from hvtrain.model.weights import export_dtypes
from hvtrain.runtime.experiment import ConfigSource, load_experiment
from hvtrain.runtime.session import loaded_model
from hvtrain.tools.predict import (
    PREDICT_BATCH,
    ArrayRows,
    Collected,
    Model,
    Rows,
    load_model,
    open_input,
    probe_rows,
    row_shape,
    run,
)

TOLERANCE = 1e-4
VERIFY_ROWS = 10_000  # the validation split's first rows that verify an export (--input: all its rows)
FORMATS = ("onnx", "savedmodel", "torchscript")
# Python modules a format needs beyond the framework (the [export] extra), per backend.
NEEDS = {("torch", "onnx"): ("onnx", "onnxscript", "onnxruntime"), ("tensorflow", "onnx"): ("tf2onnx", "onnxruntime")}


class ExportMismatch(HvtrainError):
    """The exported artefact does not predict what the framework predicts."""


@dataclass(frozen=True)
class Verification:
    rows: int
    max_difference: float


def choose_backend(fmt: str, requested: str | None, configured: str) -> str:
    """--backend if given (it must write `fmt`), else the config's backend if it writes `fmt`, else
    the backend that does.

    Raises:
        DataError: an unknown format, or a --backend that does not write it.
    """
    if fmt not in FORMATS:
        raise DataError(f"export: expected --format {', '.join(FORMATS)}, got {fmt!r}")
    writers = [b for b, formats in EXPORT_FORMATS.items() if fmt in formats]
    if requested is not None:
        if requested not in writers:
            raise DataError(f"export: --format {fmt} is written by {' or '.join(writers)}, got --backend {requested}")
        return requested
    return configured if configured in writers else writers[0]


def export_model(config: ConfigSource, weights: str, fmt: str, output: str, backend: str | None = None,
                 input_path: str | None = None, overrides: Sequence[str] = (),
                 tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Write the verified `fmt` artefact of CONFIG's model with `weights` to `output`. Returns what
    was written and measured.

    Raises:
        ExportMismatch: the artefact's predictions differ by more than `tolerance` (nothing at `output`).
        HvtrainError: bad config, weights or input rows, missing export packages, a non-artefact in the way.
    """
    configured = load_experiment(config, backend, None, overrides, need_data=False).backend
    name = choose_backend(fmt, backend, configured)
    for module in NEEDS.get((name, fmt), ()):
        if importlib.util.find_spec(module) is None:
            raise HvtrainError(f"export: --format {fmt} from {name} needs the Python package {module!r}: "
                               "pip install 'hvtrain[export]'")
    out = Path(output)
    _check_target(out, fmt, {"--weights": weights, "--input": input_path,
                             "the config": config if isinstance(config, (str, os.PathLike)) else None})
    m = load_model(config, weights, name if name != configured else backend, overrides)
    rows, described = (open_input(input_path, m.inputs), f"{input_path}") if input_path else validation_rows(m)
    row_shape(rows, m.inputs, weights)
    try:
        with loaded_model(m.cfg, m.spec, m.weights, m.inputs.outputs, probe_rows(m, rows), m.inputs.output) as s:
            if s.info.size > 1:
                raise HvtrainError(f"export: runs as one process, got {s.info.size} ranks (run it without a launcher)")
            sink = Collected()
            run(m, rows, {"probabilities": sink}, PREDICT_BATCH, s)  # hvtrain predict's path and outputs
            reference = sink.result()
            out.parent.mkdir(parents=True, exist_ok=True)  # only now: a failed check leaves no directory
            remove_dead_temps(out, ".partial")  # a killed export's, as predict's .tmp files
            staging = out.with_name(f".{out.name}.{os.getpid()}.partial")
            try:
                s.backend.export(fmt, str(staging), m.inputs)
                runner = onnx_runner(str(staging)) if fmt == "onnx" else s.backend.load_export(fmt, str(staging))
                checked = verify(runner, rows, m.inputs, reference, tolerance, f"{fmt} export from {name}")
            except BaseException:
                _remove(staging)
                raise
            _commit(staging, out)
    finally:
        rows.close()
    return {"path": str(out), "format": fmt, "backend": name, "rows": checked.rows, "verified_on": described,
            "max_difference": checked.max_difference, "tolerance": tolerance,
            "input": {"name": "x", "shape": [None, *m.inputs.features],
                      "dtype": export_dtypes(m.inputs)[0].name},
            "output": "probabilities" if m.cfg.loss in ("cross_entropy", "binary_cross_entropy") else "outputs"}


def validation_rows(m: Model) -> tuple[Rows, str]:
    """The raw rows of the config's validation split (as predict would be given them).

    Raises:
        DataError: the data cannot be loaded here (then --input is the way), or the split is empty.
    """
    from hvtrain.data.dataset import load_dataset

    spec = m.spec
    try:
        data = load_dataset(m.cfg, spec.input_shape if spec else tuple(m.cfg.model.input_shape or ()) or None,
                            spec.integer_input if spec else False)
    except HvtrainError as exc:
        raise DataError(f"export: cannot verify on the config's validation split ({exc}); give --input X.npy|X.csv "
                        "with raw rows to verify on") from None
    if len(data.val) == 0:
        raise DataError("export: the config's validation split is empty; give --input X.npy|X.csv with raw rows "
                        "to verify on")
    raw = data.val.source.features(data.val.rows[:VERIFY_ROWS])
    n = len(data.val)
    described = f"{n} rows of the validation split" if n <= VERIFY_ROWS else \
        f"the first {len(raw)} of {n} rows of the validation split"
    return ArrayRows(raw, "the validation split"), described


def onnx_runner(path: str) -> Callable[[np.ndarray], np.ndarray]:
    """An ONNX file run by onnxruntime (CPU), as a function of raw rows."""
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: session.run(None, {name: x})[0]


def verify(runner: Callable[[np.ndarray], np.ndarray], rows: Rows, inputs: Any, reference: np.ndarray,
           tolerance: float = TOLERANCE, what: str = "the export") -> Verification:
    """The artefact's outputs for every row of `rows` against `reference` (the framework's, in
    row order): equal shapes, and max |difference| / max(1, |reference|) <= tolerance (a NaN counts
    as infinitely far). The rows are fed as the artefact's input dtype (export_dtypes).

    Raises:
        ExportMismatch: naming the worst row, both values and the tolerance.
    """
    worst, at = 0.0, (0, 0)
    takes = export_dtypes(inputs)[0]
    for lo in range(0, len(rows), PREDICT_BATCH):
        hi = min(len(rows), lo + PREDICT_BATCH)
        raw = rows.read(lo, hi).reshape((hi - lo,) + tuple(inputs.features)).astype(takes)
        got = np.asarray(runner(np.ascontiguousarray(raw)), np.float64)
        want = np.asarray(reference[lo:hi], np.float64)
        if got.shape != want.shape:
            raise ExportMismatch(f"{what}: outputs of shape {list(got.shape)} for rows {lo}..{hi - 1}, the framework "
                                 f"gives {list(want.shape)}")
        diff = np.nan_to_num(np.abs(got - want) / np.maximum(1.0, np.abs(want)), nan=math.inf)
        i = np.unravel_index(int(np.argmax(diff)), diff.shape) if diff.size else (0, 0)
        if diff.size and diff[i] > worst:
            worst, at = float(diff[i]), (lo + int(i[0]), int(i[1]) if len(i) > 1 else 0)
            if worst > tolerance:
                g, w = got[i], want[i]
                raise ExportMismatch(f"{what} does not match the framework's predictions: row {at[0]} output "
                                     f"{at[1]}: {g:.6g} vs {w:.6g} (difference {worst:.3g} > tolerance "
                                     f"{tolerance:g}); the artefact was removed")
    return Verification(len(rows), worst)


def _check_target(out: Path, fmt: str, protected: dict[str, Any]) -> None:
    """PATH may be new, or replace an artefact of this format: an ONNX file, a TorchScript archive
    or a SavedModel directory. The weights, the config, the --input rows and anything else in the
    way are refused (nothing is written; no directory is created here)."""
    for what, path in protected.items():
        if path is not None and out.exists() and Path(path).exists() and os.path.samefile(out, path):
            raise DataError(f"{out}: is {what} ({path}); the export would overwrite it: give another -o path")
    # the artefact is staged beside PATH: its nearest existing directory must take new files (checked
    # now, before the model is loaded, not when the framework fails to write)
    base = next((p for p in (out.parent, *out.parent.parents) if p.exists()), Path("/"))
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise DataError(f"{out}: cannot write there ({base} is not a writable directory); give another -o path")
    if not out.exists():
        return
    kinds = {"onnx": "an ONNX file", "torchscript": "a TorchScript archive", "savedmodel": "a SavedModel directory"}
    if out.is_dir():
        if fmt == "savedmodel" and (out / "saved_model.pb").is_file():
            return
        got = "a directory that is not a SavedModel export" if fmt == "savedmodel" else "a directory"
    elif fmt == "savedmodel":
        got = "a file"
    elif (fmt == "onnx" and _is_onnx(out)) or (fmt == "torchscript" and _is_torchscript(out)):
        return
    else:
        got = f"an existing file that is not {kinds[fmt]}"
    raise DataError(f"{out}: expected a new path or {kinds[fmt]} to replace for --format {fmt}, got {got} "
                    "(nothing was written)")


def _is_onnx(path: Path) -> bool:
    """An ONNX ModelProto (protobuf: field 1, ir_version, first; a graph), not merely any file."""
    try:
        with open(path, "rb") as fh:
            if fh.read(1) != b"\x08":
                return False
        import onnx

        model = onnx.load_model(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - unparsable (or onnx missing): not an artefact we may replace
        return False
    return model.ir_version > 0 and model.HasField("graph")


def _is_torchscript(path: Path) -> bool:
    """A TorchScript archive: a zip holding `<name>/constants.pkl` and `<name>/code/` (torch.jit.save)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (OSError, zipfile.BadZipFile):
        return False
    return any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names)


def _commit(staging: Path, out: Path) -> None:
    if out.is_dir():
        shutil.rmtree(out)
    os.replace(staging, out)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
