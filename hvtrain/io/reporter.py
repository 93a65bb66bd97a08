"""Every rank-dependent side effect lives here: printing, progress bars and files.

Non-main ranks get the same object and calls, which do nothing; the trainer never
checks the rank itself.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from hvtrain.launch.process import ProcessInfo

METRICS_FILE = "metrics.jsonl"
SCORES_FILE = "val_scores.npz"  # the last evaluation's validation scores (with roc_auc; hvtrain report)



def metrics_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """metrics.jsonl's records with their lines; a line cut short by a kill mid-append is skipped."""
    out = []
    for ln in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(ln)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append((ln, record))
    return out

class Reporter:
    def __init__(self, info: ProcessInfo, out_dir: Path, quiet: bool = False, keep_metrics: bool = False,
                 tensorboard: bool = False):
        """Rank 0 writes, the other ranks' calls do nothing.

        Args:
            keep_metrics: continue metrics.jsonl and the TensorBoard event files (a resumed run,
                `hvtrain evaluate`); otherwise a training run starts both anew.
            tensorboard: every metrics.jsonl record also goes to TensorBoard event files in
                out_dir/tensorboard/ (when the package is installed; else one notice).
        """
        self.info = info
        self.out_dir = Path(out_dir)
        self.enabled = info.is_main
        self.quiet = quiet
        self.tensorboard = tensorboard
        self._events: Any = None  # the open EventLog (rank 0, from the first record on)
        self._restart: int | None = None  # a resumed run's first epoch (TensorBoard drops later steps)
        if self.enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if not keep_metrics:  # a new training run starts anew (a resumed one continues the files)
                # the old run's records and scores: a report mid-run must not mix them with the new curves
                (self.out_dir / METRICS_FILE).unlink(missing_ok=True)
                (self.out_dir / SCORES_FILE).unlink(missing_ok=True)
                from hvtrain.io.tensorboard import TB_DIR, remove_events

                remove_events(self.out_dir / TB_DIR)

    def rebind(self, info: ProcessInfo) -> None:
        """This process's rank changed (elastic reset): the new rank 0 writes from now on."""
        self.info, self.enabled = info, info.is_main
        if self.enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.close()

    def print(self, message: str) -> None:
        if self.enabled and not self.quiet:
            print(message, flush=True)

    def notice(self, message: str) -> None:
        """Something the user must see even with --quiet (resume decisions, skipped files)."""
        if self.enabled:
            print(message, flush=True)

    def progress(self, total: int, desc: str):
        """A tqdm bar on the main rank (stderr), a no-op object elsewhere."""
        if not self.enabled or self.quiet:
            return _NullBar()
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="step", leave=False, file=sys.stderr,
                    disable=None if sys.stderr.isatty() else True, dynamic_ncols=True)

    def append_metrics(self, record: dict[str, Any]) -> None:
        """One metrics.jsonl line; with `tensorboard`, its numbers as scalars at step `epoch`."""
        if self.enabled:
            with (self.out_dir / METRICS_FILE).open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            if self.tensorboard:
                self._scalars(record)

    def _scalars(self, record: dict[str, Any]) -> None:
        from hvtrain.io import tensorboard as tbevents

        if self._events is None:
            if not tbevents.available():
                self.tensorboard = False
                self.print("no TensorBoard event files: the tensorboard package is not installed "
                           "(pip install 'hvtrain[tensorboard]')")
                return
            self._events = tbevents.EventLog(self.out_dir / tbevents.TB_DIR, self._restart)
        self._events.scalars(int(record["epoch"]), tbevents.scalars(record))

    def close(self) -> None:
        """Close the event file (the run's end, or this process is no longer rank 0)."""
        if self._events is not None:
            self._events.close()
            self._events = None

    def truncate_metrics(self, epochs: int) -> None:
        """Resuming: keep the records of the first `epochs` epochs, drop those after the checkpoint
        (TensorBoard too: the next event file starts with a restart at step `epochs + 1`). An
        elastic reset calls this on a process that stays rank 0 with its event file open: that file
        is closed, so the next record opens one that starts with the restart."""
        path = self.out_dir / METRICS_FILE
        self._restart = epochs + 1
        self.close()
        if self.enabled and path.exists():
            keep = [ln for ln, record in metrics_lines(path) if record.get("epoch", epochs + 1) <= epochs]
            atomic_write(path, "".join(ln + "\n" for ln in keep).encode())

    def read_json(self, name: str) -> dict[str, Any] | None:
        """Rank 0: a JSON object this run directory holds (None if missing or unreadable); the
        other ranks get None (the caller broadcasts what rank 0 read)."""
        if not self.enabled:
            return None
        try:
            data = json.loads((self.out_dir / name).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def modified(self, name: str) -> float | None:
        """Rank 0: when this run directory's file `name` was last written (None: no such file); the
        other ranks: None."""
        if not self.enabled:
            return None
        try:
            return (self.out_dir / name).stat().st_mtime
        except OSError:
            return None

    def last_metrics(self) -> dict[str, Any] | None:
        """Rank 0: metrics.jsonl's last record (None if there is none); the other ranks: None."""
        path = self.out_dir / METRICS_FILE
        if not self.enabled or not path.is_file():
            return None
        lines = metrics_lines(path)
        return lines[-1][1] if lines else None

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        if self.enabled:
            atomic_write(self.out_dir / name, (json.dumps(data, indent=2) + "\n").encode())

    def write_arrays(self, name: str, arrays: dict[str, np.ndarray] | None) -> None:
        """An .npz of `arrays` (atomic); None removes a file of that name left by an earlier run."""
        if not self.enabled:
            return
        if arrays is None:
            (self.out_dir / name).unlink(missing_ok=True)
            return
        import io

        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write(self.out_dir / name, buf.getvalue())

    def write_weights(self, name: str, weights: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
        if self.enabled:
            from safetensors.numpy import save

            blob = save({k: np.ascontiguousarray(v) for k, v in weights.items()}, metadata=metadata)
            atomic_write(self.out_dir / name, blob)

    @contextmanager
    def npy_files(self, files: dict[str, tuple[Path, int, tuple[int, ...], np.dtype]]
                  ) -> Iterator[dict[str, NpyWriter] | None]:
        """Rank 0: a NpyWriter per entry (`key: (path, rows, row shape, dtype)`), each renamed over
        its path when the block ends normally and removed when it ends by an exception (no
        `.NAME.PID.tmp` left behind). Other ranks: None."""
        if not self.enabled:
            yield None
            return
        writers: dict[str, NpyWriter] = {}
        try:
            for key, (path, rows, row, dtype) in files.items():
                writers[key] = NpyWriter(path, rows, row, dtype)
            yield writers
            for writer in writers.values():
                writer.commit()
        finally:
            for writer in writers.values():
                writer.discard()


class NpyWriter:
    """A .npy file written row block by row block (rank 0, through Reporter.npy_files): header
    first, then each block as it comes, into a temporary file renamed over `path` when complete.
    Temporary files of this path left by a killed writer on this host are removed first."""

    def __init__(self, path: Path, rows: int, row: tuple[int, ...], dtype: np.dtype) -> None:
        from numpy.lib import format as npformat

        self.path, self.expected, self.done, self.row = path, rows, 0, tuple(row)
        self.dtype = np.dtype(dtype)
        remove_dead_temps(path)
        self.tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self.fh = self.tmp.open("wb")
        npformat.write_array_header_1_0(self.fh, {"descr": npformat.dtype_to_descr(self.dtype),
                                                  "fortran_order": False, "shape": (rows,) + tuple(row)})

    def write(self, block: np.ndarray) -> None:
        if block.shape[1:] != self.row:  # the header promised rows of this shape
            from hvtrain.errors import HvtrainError

            raise HvtrainError(f"{self.path}: a block of rows shaped {list(block.shape[1:])}, the file holds rows "
                               f"of {list(self.row)}")
        self.fh.write(np.ascontiguousarray(block, self.dtype).tobytes())
        self.done += len(block)

    def commit(self) -> None:
        from hvtrain.errors import HvtrainError

        if self.done != self.expected:
            raise HvtrainError(f"{self.path}: wrote {self.done} rows, expected {self.expected}")
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        """Close and remove the temporary file (nothing, once committed)."""
        if not self.fh.closed:
            self.fh.close()
            self.tmp.unlink(missing_ok=True)


def file_in_the_way(directory: Path) -> str | None:
    """What keeps `directory` from being made, checked before any work starts (mkdir fails late
    otherwise, with a traceback): 'an existing file' (it is one) or 'a path under the file F'; None
    when nothing does."""
    blocked = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
    if blocked is None:
        return None
    return "an existing file" if blocked == directory else f"a path under the file {blocked}"


def remove_dead_temps(path: Path, suffix: str = ".tmp") -> None:
    """`.NAME.PID<suffix>` files or directories next to `path` (predict's `.tmp` files, export's
    `.partial` artefacts, a SavedModel a directory) whose process no longer runs on this host: a
    writer killed before it could clean up. Left behind, they stayed for good."""
    import shutil

    prefix = f".{path.name}."
    if not path.parent.is_dir():
        return
    for tmp in path.parent.iterdir():  # not glob: a name may hold [ ] * ?
        if not (tmp.name.startswith(prefix) and tmp.name.endswith(suffix)):
            continue
        pid = tmp.name[len(prefix):-len(suffix)]
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def report_failure(info: ProcessInfo, exc: BaseException) -> None:
    """The one side effect every rank may have: saying why it is ending the job."""
    from hvtrain.errors import HvtrainError

    what = str(exc) if isinstance(exc, HvtrainError) else f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, HvtrainError):
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    print(f"hvtrain: error: rank {info.rank} of {info.size}: {what}", file=sys.stderr, flush=True)


def report_warning(info: ProcessInfo, message: str) -> None:
    """A rank's warning, prefixed like its failures (`rank r of N:`); the job goes on."""
    print(f"hvtrain: warning: rank {info.rank} of {info.size}: {message}", file=sys.stderr, flush=True)


def atomic_write(path: Path, data: bytes) -> None:
    """Temp file, fsync, rename: a reader or a crash never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)  # the rename itself survives a crash only once the directory is synced
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _NullBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass
