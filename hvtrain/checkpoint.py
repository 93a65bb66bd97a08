"""Checkpoints: one safetensors file per checkpoint, written atomically by rank 0, verified on load.

File `ckpt-s<step>.safetensors` in the output directory holds
  - rank 0's backend state (model, optimizer, framework RNG) as named arrays,
  - `rng.rank<r>.*`: every rank's RNG state (so each rank resumes its own random stream),
  - header metadata: `meta` (JSON: epoch, step, samples consumed in the epoch, world size,
    backend, the config it was made with, ...) and `sha256` over all tensors and `meta`.
Loading never executes code (safetensors + JSON only). A file that does not parse or whose
checksum does not match is reported and skipped by `--resume auto`, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hvtrain.errors import HvtrainError
from hvtrain.output import atomic_write

_NAME = re.compile(r"^ckpt-s(\d{8})\.safetensors$")
FORMAT = "hvtrain-checkpoint-v1"


class CheckpointError(HvtrainError):
    """A checkpoint that cannot be trusted (truncated, corrupted, not a checkpoint)."""


@dataclass
class Checkpoint:
    path: Path
    tensors: dict[str, np.ndarray]
    meta: dict[str, Any]


def file_name(step: int) -> str:
    return f"ckpt-s{step:08d}.safetensors"


def _digest(tensors: dict[str, np.ndarray], meta_json: str) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        arr = np.require(tensors[key], requirements="C")
        h.update(f"{key}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(arr.tobytes())
    h.update(meta_json.encode())
    return h.hexdigest()


def save(out_dir: Path, tensors: dict[str, np.ndarray], meta: dict[str, Any], keep: int) -> Path:
    """Write atomically (temp, fsync, rename), then prune to the newest `keep`. Main rank only."""
    from safetensors.numpy import save as st_save

    for key, value in tensors.items():
        if np.issubdtype(value.dtype, np.floating) and not np.all(np.isfinite(value)):
            raise HvtrainError(f"refusing to checkpoint non-finite values in {key!r} at step {meta['step']}")
    meta_json = json.dumps(meta, sort_keys=True)
    blob = st_save({k: np.require(v, requirements="C") for k, v in tensors.items()},
                   metadata={"format": FORMAT, "meta": meta_json, "sha256": _digest(tensors, meta_json)})
    path = Path(out_dir) / file_name(meta["step"])
    atomic_write(path, blob)
    for old in list_checkpoints(out_dir)[keep:]:
        old.unlink(missing_ok=True)
    return path


def load(path: str | Path) -> Checkpoint:
    """Parse and verify a checkpoint file.

    Raises:
        CheckpointError: missing, truncated, corrupted, or not an hvtrain checkpoint.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load as st_load

    path = Path(path)
    try:
        blob = path.read_bytes()
        tensors = st_load(blob)
        header_len = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8: 8 + header_len])
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint not found") from None
    except (SafetensorError, OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable checkpoint ({str(exc).splitlines()[0]})") from None
    metadata = header.get("__metadata__") or {}
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an hvtrain checkpoint (format {metadata.get('format')!r})")
    if _digest(tensors, metadata.get("meta", "")) != metadata.get("sha256"):
        raise CheckpointError(f"{path}: checksum mismatch (the file is corrupted)")
    return Checkpoint(path, tensors, json.loads(metadata["meta"]))


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Checkpoint files, newest (highest step) first."""
    d = Path(out_dir)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if _NAME.match(p.name)), key=lambda p: p.name, reverse=True)


def find_resume(out_dir: str | Path, resume: str, report) -> Checkpoint | None:
    """`auto`: the newest checkpoint that verifies (others are reported and skipped), or None.
    A path: that checkpoint, or CheckpointError."""
    if resume != "auto":
        return load(resume)
    for path in list_checkpoints(out_dir):
        try:
            return load(path)
        except CheckpointError as exc:
            report(f"skipping checkpoint: {exc}")
    return None


def split_rng(state: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(replicated state, this rank's RNG state): RNG entries are the keys starting with 'rng.'."""
    rng = {k: v for k, v in state.items() if k.startswith("rng.")}
    return {k: v for k, v in state.items() if k not in rng}, rng
