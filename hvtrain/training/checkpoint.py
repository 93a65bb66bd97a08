"""CheckpointManager: the run's checkpoints across ranks (the files are hvtrain.io.checkpoints).

Saving gathers each rank's share (its RNG; its shard's state if it is the shard's first rank) on
rank 0, which writes the file; resuming has rank 0 find, verify and match the checkpoint and send
each rank only its own share.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hvtrain.config.validate import experiment_record, per_sample_randomness
from hvtrain.errors import HvtrainError
from hvtrain.io.checkpoints import Checkpoint, decode, encode, find_resume, new_run_id, remove_orphans, save, where
from hvtrain.io.reporter import Reporter
from hvtrain.version import __version__

if TYPE_CHECKING:
    from hvtrain.config.schema import Config
    from hvtrain.runtime.horovod import Runtime



def _randomness(record: dict[str, Any]) -> str:
    """per_sample | per_rank as a checkpoint's experiment record resolves train.randomness (a record
    from before the key: per_rank, the frameworks' streams)."""
    mode = record.get("train", {}).get("randomness", "per_rank")
    if mode == "auto":
        return "per_rank" if record.get("model", {}).get("entrypoint") else "per_sample"
    return mode


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
        inputs: the run's inputs record (hvtrain.model.weights.describe_inputs), kept in every meta.
    """

    def __init__(self, cfg: Config, runtime: Runtime, reporter: Reporter, layout: list[list[int]] | None = None,
                 inputs: dict[str, Any] | None = None, draws_random: bool = False):
        """`draws_random`: the model has dropout (the resume line says what happens to its masks)."""
        self.cfg, self.runtime, self.reporter, self.layout, self.inputs = cfg, runtime, reporter, layout, inputs
        self.draws_random = draws_random
        self.run_id = new_run_id()  # until start() agrees on one (elastic: the state sync does)
        self.experiment = experiment_record(cfg)  # what a checkpoint records of the run and a resume must match
        if runtime.info.is_main:
            for orphan in remove_orphans(reporter.out_dir):
                reporter.notice(f"removed an unfinished checkpoint file: {orphan}")

    def start(self, resume: str | None, shard: str, replicas: int, data_content: str | None = None
              ) -> Resumed | None:
        """Fix this run's id; with `resume`, find the checkpoint (rank 0) and hand each rank its share.
        `data_content`: the data's content hash where the config cannot name the data (the Python
        API's data=, a data entrypoint), recorded and matched as the key `data.content`: without it
        a resume continued, or kept a finished run's results, on other arrays.

        Raises:
            CheckpointError, ConfigError, HvtrainError: no trustworthy checkpoint for this experiment.
        """
        info, rt = self.runtime.info, self.runtime
        if data_content is not None:
            self.experiment["data"] = {**self.experiment["data"], "content": data_content}
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
        g = self.cfg.data.global_batch_size
        # per sample, a sample's dropout masks are what they were: only framework streams move
        per_sample = per_sample_randomness(self.cfg)
        masks = " and dropout masks (per sample)" if per_sample and self.draws_random else ""
        streams = "" if per_sample else "; per-rank random streams reseeded"
        if same_world:
            changed = ""
        elif g is not None:  # the same steps, samples and schedule: only who computes which part moved
            acc = self.cfg.train.grad_accumulation
            changed = (f"; world size changed {meta['world_size']} -> {info.size}: global batch {g} kept "
                       f"({g // (before * acc)} -> {b} per replica), the same data order, lr schedule{masks}"
                       + streams)
        else:
            changed = (f"; world size changed {meta['world_size']} -> {info.size}" + (
                f": global batch {b * before} -> {b * now}" if before != now else "")
                + (", dropout masks per sample unchanged" if masks else "" if per_sample
                   else ", per-rank random streams reseeded")
                + (", lr re-scaled" if self.cfg.optimizer.scale_lr else ""))
        was = _randomness(meta.get("config", {}))
        if self.draws_random and was != ("per_sample" if per_sample else "per_rank"):
            now = "per sample" if per_sample else "per rank"
            changed += f"; dropout masks drawn {now} from here (the checkpoint's run drew them " \
                       f"{was.replace('_', ' ')}: train.randomness)"
        self.reporter.notice(f"resumed from {header['path']} ({where(meta)}){changed}")
        return Resumed(header["path"], meta, state, same_world)

    def _find(self, resume: str) -> Checkpoint | None:
        found = find_resume(self.reporter.out_dir, resume, self.experiment, self.reporter.notice)
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
        then, now = (r.get("output") if isinstance(r, dict) else None for r in (meta.get("inputs"), self.inputs))
        if then is not None and now is not None and then != now:  # its loss was another one: no silent switch
            from hvtrain.model.native import OutputForm

            was, takes = (OutputForm.from_record(r).describe() for r in (then, now))
            raise self.cfg.fail("model.entrypoint", f"{found.path} was trained on {was} of "
                                f"{self.cfg.model.entrypoint}, this build takes {takes} (hvtrain.model.native): "
                                "is this the model it was trained with?")
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
                "layout": self.layout, "config": self.experiment, "hvtrain_version": __version__,
                **({"inputs": self.inputs} if self.inputs is not None else {})}
        path = save(self.reporter.out_dir, tensors, meta, self.cfg.train.keep)
        self.reporter.print(f"checkpoint: {path} ({where(position)})")
        return path
