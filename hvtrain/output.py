"""Every rank-dependent side effect lives here: printing, progress bars and files.

Non-main ranks get the same object and calls, which do nothing; the trainer never
checks the rank itself.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hvtrain.dist import ProcessInfo


class Reporter:
    def __init__(self, info: ProcessInfo, out_dir: Path, quiet: bool = False, keep_metrics: bool = False):
        self.info = info
        self.out_dir = Path(out_dir)
        self.enabled = info.is_main
        self.quiet = quiet
        if self.enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if not keep_metrics:  # a new training run starts a new metrics file (a resumed one continues it)
                (self.out_dir / "metrics.jsonl").unlink(missing_ok=True)

    def rebind(self, info: ProcessInfo) -> None:
        """This process's rank changed (elastic reset): the new rank 0 writes from now on."""
        self.info, self.enabled = info, info.is_main
        if self.enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)

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
        if self.enabled:
            with (self.out_dir / "metrics.jsonl").open("a") as fh:
                fh.write(json.dumps(record) + "\n")

    def truncate_metrics(self, epochs: int) -> None:
        """Resuming: keep the records of the first `epochs` epochs, drop those after the checkpoint."""
        path = self.out_dir / "metrics.jsonl"
        if self.enabled and path.exists():
            keep = []
            for ln in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(ln)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill mid-append
                if isinstance(record, dict) and record.get("epoch", epochs + 1) <= epochs:
                    keep.append(ln)
            atomic_write(path, "".join(ln + "\n" for ln in keep).encode())

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        if self.enabled:
            atomic_write(self.out_dir / name, (json.dumps(data, indent=2) + "\n").encode())

    def write_weights(self, name: str, weights: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
        if self.enabled:
            from safetensors.numpy import save

            blob = save({k: np.ascontiguousarray(v) for k, v in weights.items()}, metadata=metadata)
            atomic_write(self.out_dir / name, blob)


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
