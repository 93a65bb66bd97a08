"""Checkpoint files: one safetensors file per checkpoint, written atomically, verified on read.

File `ckpt-<run id>-s<step>.safetensors` in the output directory holds
  - `shard.<name>.*`: the training state of each shard, from the first rank holding it (data
    parallel: one shard `model`, replicated on every rank; pipelines: `stage<s>`, one per stage),
  - `rng.rank<r>.*`: every rank's RNG state (so each rank resumes its own random stream),
  - `weights.*`: the whole model's weights in the layout of final.safetensors (every stage's), so a
    checkpoint is predicted from or fine-tuned in either framework (hvtrain.model.weights);
    resuming never reads them,
  - header metadata: `meta` (JSON: run id, epoch, step, samples consumed in the epoch, world size,
    backend, pipeline layout, the config it was made with, the `inputs` record of
    hvtrain.model.weights, ...) and `sha256` over tensors and meta.
Every run has a run id; pruning (`train.keep`) removes only that run's files, so two runs in one
output directory never delete each other's checkpoints. A resumed run keeps the run id it resumes.

Loading never executes code (safetensors + JSON only). A file that does not parse or whose
checksum does not match is reported and skipped by `--resume auto`, never loaded; a checkpoint
made with a different experiment (MATH_KEYS) is refused. Who writes what, across ranks, is
hvtrain.training.checkpoint.CheckpointManager.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hvtrain.errors import ConfigError, HvtrainError
from hvtrain.io.reporter import atomic_write

if TYPE_CHECKING:
    pass



_NAME = re.compile(r"^ckpt-([0-9a-f]{8})-s(\d{8})\.safetensors$")


_TEMP = re.compile(r"^\.ckpt-[0-9a-f]{8}-s\d{8}\.safetensors\..*\.tmp$")


FORMAT = "hvtrain-checkpoint-v2"


# Config keys whose change changes the math: a checkpoint resumes only a run that agrees on them.
# train.compression rounds every gradient to fp16 before the allreduce; parallel.pipeline.micro_batches
# splits each batch (batchnorm statistics per micro-batch). The stage placement is checked as the layout;
# the schedule (gpipe / 1f1b) computes the same update. train.randomness draws other dropout masks from
# the resume on, as a world-size change does under per_rank: said, not refused (a checkpoint from before
# the key, per-rank masks, resumes).
MATH_KEYS = ("model", "optimizer", "loss", "data", "seed", "train.grad_accumulation", "train.precision",
             "train.compression", "parallel.pipeline.micro_batches")


NOT_MATH = ("data.prefetch",)  # under MATH_KEYS, but no effect on the numbers


class CheckpointError(HvtrainError):
    """A checkpoint that cannot be trusted (truncated, corrupted, not a checkpoint)."""


@dataclass
class Checkpoint:
    path: Path
    tensors: dict[str, np.ndarray]
    meta: dict[str, Any]


def new_run_id() -> str:
    return uuid.uuid4().hex[:8]


def file_name(run_id: str, step: int) -> str:
    return f"ckpt-{run_id}-s{step:08d}.safetensors"


def step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(2))


def where(position: dict[str, Any]) -> str:
    """A position (a checkpoint's meta, or the loop's) in the one numbering every line uses: the
    epoch its step belongs to, counted from 1 as the progress bar and the epoch lines count it,
    and the step. `epoch` holds the epochs done: at an epoch's end its step is that epoch's last;
    with samples of the next epoch consumed (`offset`), the step lies in the next one."""
    epoch = position["epoch"] + 1 if position.get("offset") else position["epoch"]
    return f"epoch {max(epoch, 1)}, step {position['step']}"


def _digest(tensors: dict[str, np.ndarray], meta_json: str) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        arr = np.require(tensors[key], requirements="C")
        h.update(f"{key}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(arr.tobytes())
    h.update(meta_json.encode())
    return h.hexdigest()


def save(out_dir: Path, tensors: dict[str, np.ndarray], meta: dict[str, Any], keep: int) -> Path:
    """Write atomically (temp, fsync, rename, directory fsync), then prune this run (meta['run_id'])
    to its newest `keep` checkpoints. Main rank only."""
    from safetensors.numpy import save as st_save

    for key, value in tensors.items():
        if np.issubdtype(value.dtype, np.floating) and not np.all(np.isfinite(value)):
            raise HvtrainError(f"refusing to checkpoint non-finite values in {key!r} at step {meta['step']}")
    meta = {**meta, "created": time.time()}
    meta_json = json.dumps(meta, sort_keys=True)
    blob = st_save({k: np.require(v, requirements="C") for k, v in tensors.items()},
                   metadata={"format": FORMAT, "meta": meta_json, "sha256": _digest(tensors, meta_json)})
    path = Path(out_dir) / file_name(meta["run_id"], meta["step"])
    atomic_write(path, blob)
    for old in list_checkpoints(out_dir, meta["run_id"])[keep:]:
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
        raise CheckpointError(f"{path}: not an hvtrain checkpoint of this version (format "
                              f"{metadata.get('format')!r}, expected {FORMAT!r})")
    if _digest(tensors, metadata.get("meta", "")) != metadata.get("sha256"):
        raise CheckpointError(f"{path}: checksum mismatch (the file is corrupted)")
    return Checkpoint(path, tensors, json.loads(metadata["meta"]))


def list_checkpoints(out_dir: str | Path, run_id: str | None = None) -> list[Path]:
    """Checkpoint files (of one run, or of all), newest written first. Write order, not step: a
    run resumed from an older checkpoint writes lower steps after higher ones, and its new files
    are what `keep` must keep."""
    d = Path(out_dir)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if (m := _NAME.match(p.name)) and (run_id is None or m.group(1) == run_id)]
    return sorted(found, key=lambda p: (_written(p), step_of(p)), reverse=True)


def _written(path: Path) -> float:
    """When the checkpoint was written: `created` in its header (file times are too coarse to order
    saves a few milliseconds apart); the file's mtime if the header cannot be read."""
    try:
        with path.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if 0 < n < 1 << 24:
                header = json.loads(fh.read(n))
                return float(json.loads(header["__metadata__"]["meta"])["created"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def remove_orphans(out_dir: str | Path) -> list[Path]:
    """Temporary checkpoint files left by a process killed while writing."""
    d = Path(out_dir)
    gone = [p for p in d.iterdir() if _TEMP.match(p.name)] if d.is_dir() else []
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key: checkpoint X, this run Y` for every MATH_KEYS leaf that differs."""
    def leaves(d: Any, prefix: str) -> dict[str, Any]:
        if isinstance(d, dict):
            out: dict[str, Any] = {}
            for k, v in d.items():
                out.update(leaves(v, f"{prefix}.{k}" if prefix else str(k)))
            return out
        return {prefix: d}

    def pick(cfg: dict[str, Any]) -> dict[str, Any]:
        flat = leaves(cfg, "")
        return {k: v for k, v in flat.items() if k not in NOT_MATH and any(
            k == m or k.startswith(m + ".") or k.startswith(m + "[") for m in MATH_KEYS)}

    def same(x: Any, y: Any) -> bool:  # a key newer than the checkpoint, unset (None) in this run
        return x == y or (x is None or x == "<unset>") and (y is None or y == "<unset>")

    a, b = pick(saved), pick(current)
    return [f"{k}: checkpoint {a.get(k, '<unset>')!r}, this run {b.get(k, '<unset>')!r}"
            for k in sorted(set(a) | set(b)) if not same(a.get(k, "<unset>"), b.get(k, "<unset>"))]


def find_resume(out_dir: str | Path, resume: str, config: dict[str, Any], report) -> Checkpoint | None:
    """`auto`: the newest checkpoint that verifies and was made with this experiment (others are
    reported and skipped), or None when there is none at all. A path: that checkpoint.

    Raises:
        CheckpointError: the given path cannot be trusted.
        ConfigError: the checkpoint(s) were made with a different experiment; names the keys.
    """
    if resume != "auto":
        found = load(resume)
        differ = config_differences(found.meta["config"], config)
        if differ:
            raise ConfigError(f"{found.path}: made with a different experiment; differing keys: "
                              f"{'; '.join(differ)}")
        return found
    mismatched: list[tuple[Path, list[str]]] = []
    for legacy in sorted(Path(out_dir).glob("ckpt-s[0-9]*.safetensors")) if Path(out_dir).is_dir() else []:
        report(f"skipping checkpoint {legacy.name}: written by an older hvtrain ({FORMAT} is needed)")
    for path in list_checkpoints(out_dir):
        try:
            found = load(path)
        except CheckpointError as exc:
            report(f"skipping checkpoint: {exc}")
            continue
        differ = config_differences(found.meta["config"], config)
        if not differ:
            return found
        mismatched.append((path, differ))
        report(f"skipping checkpoint {path.name}: made with a different experiment ({'; '.join(differ)})")
    if mismatched:
        path, differ = mismatched[0]
        raise ConfigError(f"--resume auto: no checkpoint in {out_dir} was made with this experiment; the newest, "
                          f"{path.name}, differs in {'; '.join(differ)} (start a new output_dir, or resume that "
                          "run with its own config)")
    return None


def encode(tensors: dict[str, np.ndarray]) -> bytes:
    from safetensors.numpy import save as st_save

    return st_save({k: np.require(v, requirements="C") for k, v in tensors.items()})


def decode(blob: bytes) -> dict[str, np.ndarray]:
    from safetensors.numpy import load as st_load

    return dict(st_load(blob)) if blob else {}
