"""Checkpoints for every layout: one safetensors file per checkpoint, written atomically by rank 0.

File `ckpt-<run id>-s<step>.safetensors` in the output directory holds
  - `shard.<name>.*`: the training state of each shard, from the first rank holding it (data
    parallel: one shard `model`, replicated on every rank; pipelines: `stage<s>`, one per stage),
  - `rng.rank<r>.*`: every rank's RNG state (so each rank resumes its own random stream),
  - `weights.*`: the whole model's weights in the layout of final.safetensors (every stage's), so a
    checkpoint is predicted from or fine-tuned in either framework (hvtrain.weightfile); resuming
    never reads them,
  - header metadata: `meta` (JSON: run id, epoch, step, samples consumed in the epoch, world size,
    backend, pipeline layout, the config it was made with, the `inputs` record of
    hvtrain.weightfile, ...) and `sha256` over tensors and meta.
Every run has a run id; pruning (`train.keep`) removes only that run's files, so two runs in one
output directory never delete each other's checkpoints. A resumed run keeps the run id it resumes.

Saving gathers each rank's share (its RNG; its shard's state if it is the shard's first rank) on
rank 0; resuming sends each rank only its own share. Loading never executes code (safetensors +
JSON only). A file that does not parse or whose checksum does not match is reported and skipped by
`--resume auto`, never loaded; a checkpoint made with a different experiment (MATH_KEYS) is refused.
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

from hvtrain import __version__
from hvtrain.errors import ConfigError, HvtrainError
from hvtrain.output import Reporter, atomic_write

if TYPE_CHECKING:
    from hvtrain.config import Config
    from hvtrain.runtime import Runtime

_NAME = re.compile(r"^ckpt-([0-9a-f]{8})-s(\d{8})\.safetensors$")
_TEMP = re.compile(r"^\.ckpt-[0-9a-f]{8}-s\d{8}\.safetensors\..*\.tmp$")
FORMAT = "hvtrain-checkpoint-v2"
# Config keys whose change changes the math: a checkpoint resumes only a run that agrees on them.
# train.compression rounds every gradient to fp16 before the allreduce; parallel.pipeline.micro_batches
# splits each batch (batchnorm statistics per micro-batch). The stage placement is checked as the layout;
# the schedule (gpipe / 1f1b) computes the same update.
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


@dataclass
class Resumed:
    path: str
    meta: dict[str, Any]
    state: dict[str, np.ndarray]  # this rank's share: its shard's state, and its RNG when `rng`
    rng: bool  # same world size: every rank continues its own random stream


class CheckpointManager:
    """Checkpoints of one run, for every layout. Rank 0 reads and writes the files; the others
    exchange only their own share with it through the runtime.

    Args:
        layout: the pipeline's [first, last] layer per stage (None unpipelined); a checkpoint
            resumes only under the same layout.
        inputs: the run's inputs record (hvtrain.weightfile.describe_inputs), kept in every meta.
    """

    def __init__(self, cfg: Config, runtime: Runtime, reporter: Reporter, layout: list[list[int]] | None = None,
                 inputs: dict[str, Any] | None = None):
        self.cfg, self.runtime, self.reporter, self.layout, self.inputs = cfg, runtime, reporter, layout, inputs
        self.run_id = new_run_id()  # until start() agrees on one (elastic: the state sync does)
        if runtime.info.is_main:
            for orphan in remove_orphans(reporter.out_dir):
                reporter.notice(f"removed an unfinished checkpoint file: {orphan}")

    def start(self, resume: str | None, shard: str, replicas: int) -> Resumed | None:
        """Fix this run's id; with `resume`, find the checkpoint (rank 0) and hand each rank its share.

        Raises:
            CheckpointError, ConfigError, HvtrainError: no trustworthy checkpoint for this experiment.
        """
        info, rt = self.runtime.info, self.runtime
        header: Any = None
        found = None
        if info.is_main:
            try:
                found = self._find(resume) if resume else None
                header = {"run_id": new_run_id()} if found is None else {
                    "run_id": found.meta["run_id"], "path": str(found.path), "meta": found.meta}
            except HvtrainError as exc:
                header = exc
        header = rt.broadcast_object(header)
        if isinstance(header, HvtrainError):
            raise header
        self.run_id = header["run_id"]
        if "meta" not in header:  # (the loop says what --resume then does)
            return None
        meta = header["meta"]
        same_world = meta["world_size"] == info.size
        shards = rt.allgather_object(shard)
        blobs = [encode(self._share(found, shards[r], r, same_world)) for r in range(info.size)] \
            if info.is_main else None
        state = decode(rt.scatter_bytes(blobs))
        b, before, now = self.cfg.data.batch_size, meta["replicas"], replicas
        changed = "" if same_world else (
            f"; world size changed {meta['world_size']} -> {info.size}" + (
                f": global batch {b * before} -> {b * now}" if before != now else "")
            + ", per-rank random streams reseeded" + (", lr re-scaled" if self.cfg.optimizer.scale_lr else ""))
        self.reporter.notice(f"resumed from {header['path']} ({where(meta)}){changed}")
        return Resumed(header["path"], meta, state, same_world)

    def _find(self, resume: str) -> Checkpoint | None:
        found = find_resume(self.reporter.out_dir, resume, self.cfg.to_dict(), self.reporter.notice)
        if found is None:
            return None
        meta = found.meta
        if meta["backend"] != self.cfg.backend:
            raise HvtrainError(f"{found.path}: checkpoint was made by backend {meta['backend']!r}, this run uses "
                               f"{self.cfg.backend!r}; use `hvtrain evaluate` or final.safetensors to move between "
                               "frameworks")
        if meta.get("layout") != self.layout:
            raise HvtrainError(f"{found.path}: made with pipeline stages {meta.get('layout')}, this run has "
                               f"{self.layout}; resume with the same placement")
        return found

    @staticmethod
    def _share(found: Checkpoint, shard: str, rank: int, rng: bool) -> dict[str, np.ndarray]:
        prefix, mine = f"shard.{shard}.", f"rng.rank{rank}."
        out = {k[len(prefix):]: v for k, v in found.tensors.items() if k.startswith(prefix)}
        if rng:
            out.update({"rng." + k[len(mine):]: v for k, v in found.tensors.items() if k.startswith(mine)})
        return out

    def save(self, position: dict[str, Any], shard: str, owns_shard: bool, state: dict[str, np.ndarray],
             replicas: int, weights: dict[str, np.ndarray] | None = None) -> Path | None:
        """One checkpoint at `position` (epoch, step, offset, loss_sum, epoch_steps). Every rank calls
        it; rank 0 writes it and gets its path. `weights`: this rank's part of the model's weights
        (final.safetensors' layout), stored once per shard as `weights.*`."""
        info = self.runtime.info
        share = {f"rng.rank{info.rank}.{k[4:]}": v for k, v in state.items() if k.startswith("rng.")}
        if owns_shard:
            share.update({f"shard.{shard}.{k}": v for k, v in state.items() if not k.startswith("rng.")})
            share.update({f"weights.{k}": v for k, v in (weights or {}).items()})
        blobs = self.runtime.gather_bytes(encode(share))
        if not info.is_main:
            return None
        tensors: dict[str, np.ndarray] = {}
        for blob in blobs:
            tensors.update(decode(blob))
        meta = {**position, "run_id": self.run_id, "world_size": info.size, "replicas": replicas,
                "backend": self.cfg.backend,
                "layout": self.layout, "config": self.cfg.to_dict(), "hvtrain_version": __version__,
                **({"inputs": self.inputs} if self.inputs is not None else {})}
        path = save(self.reporter.out_dir, tensors, meta, self.cfg.train.keep)
        self.reporter.print(f"checkpoint: {path} ({where(position)})")
        return path
