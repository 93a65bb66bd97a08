"""The neutral training loop: epochs, LR schedule, sharding, metrics, outputs.

It talks to the framework only through the Backend interface. Per step it slices numpy
arrays and calls `train_step`; loss stays on the device until the epoch ends (or a
progress-bar refresh every `train.log_every` steps on the main rank).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hvtrain import __version__, checkpoint
from hvtrain.backend import Backend
from hvtrain.config import Config
from hvtrain.data import Dataset, epoch_permutation, shard_batches, shard_eval, steps_per_epoch
from hvtrain.dist import ProcessInfo
from hvtrain.errors import HvtrainError
from hvtrain.output import Reporter
from hvtrain.spec import ModelSpec

EVAL_BATCH = 1024
WEIGHTS_FILE = "final.safetensors"


@dataclass
class EpochResult:
    epoch: int
    train_loss: float
    val: dict[str, float]
    samples_per_sec: float
    seconds: float


class LRSchedule:
    """Base lr, times world size if `scale_lr`, reached by linear warmup over `warmup_epochs`.

    With scale_lr the warmup starts at the single-rank lr (Goyal et al., 2017); without it,
    at zero.
    """

    def __init__(self, cfg: Config, size: int, steps_per_epoch: int):
        o = cfg.optimizer
        self.target = o.lr * (size if o.scale_lr else 1)
        self.start = o.lr if o.scale_lr else 0.0
        self.warmup_steps = int(round(o.warmup_epochs * steps_per_epoch))

    def __call__(self, step: int) -> float:
        if step >= self.warmup_steps:
            return self.target
        return self.start + (self.target - self.start) * (step + 1) / self.warmup_steps


def fit(cfg: Config, spec: ModelSpec | None, data: Dataset, backend: Backend, info: ProcessInfo,
        reporter: Reporter, resume: str | None = None, elastic: bool = False) -> dict[str, Any]:
    """Train for `cfg.train.epochs`; write metrics.jsonl, summary.json, final.safetensors and
    (if configured) checkpoints; continue from a checkpoint when `resume` is given. With
    `elastic`, run under Horovod elastic: state committed every `train.elastic_commit_every`
    steps, restored and re-sharded for the new world size when workers leave or join."""
    t0 = time.perf_counter()
    backend.build(cfg, spec, spec.init_weights(cfg.seed) if spec is not None else None, data.num_outputs)
    pos = _resume(cfg, backend, info, reporter, resume) if resume else Position()
    if elastic:
        state = backend.elastic_state(asdict(pos))

        def attempt(state: Any) -> tuple[EpochResult | None, ProcessInfo, Reporter]:
            now = backend.refresh()  # rank and size after a reset
            again = Reporter(now, reporter.out_dir, quiet=reporter.quiet, keep_metrics=True)
            start = Position(**{k: getattr(state, k) for k in asdict(Position())})
            again.truncate_metrics(start.epoch)

            def commit(here: Position) -> None:
                for k, v in asdict(here).items():
                    setattr(state, k, v)
                state.commit()

            return _epochs(cfg, spec, data, backend, now, again, start, commit), now, again

        outcome = backend.elastic_run(attempt)(state)
        if outcome is None:  # Horovod's elastic wrapper swallowed an error it did not recognise
            raise HvtrainError("elastic training ended without a result after a worker failure")
        result, info, reporter = outcome
    else:
        result = _epochs(cfg, spec, data, backend, info, reporter, pos, None)

    return finish(cfg, spec, info, reporter, result, t0, backend.get_weights(),
                  {"resumed_from": pos.source, "elastic": elastic})


def finish(cfg: Config, spec: ModelSpec | None, info: ProcessInfo, reporter: Reporter, result: EpochResult | None,
           t0: float, weights: dict[str, np.ndarray], extra: dict[str, Any]) -> dict[str, Any]:
    """final.safetensors and summary.json (the last epoch's figures plus run facts)."""
    reporter.write_weights(WEIGHTS_FILE, weights, weight_metadata(cfg, spec))
    summary = {
        "name": cfg.name, "backend": cfg.backend, "world_size": info.size, "controller": info.controller,
        "epochs": cfg.train.epochs, "train_loss": result.train_loss if result else None,
        **({f"val_{k}": v for k, v in result.val.items()} if result else {}),
        "samples_per_sec": result.samples_per_sec if result else None,
        "total_seconds": time.perf_counter() - t0, "weights": WEIGHTS_FILE,
        **extra, "hvtrain_version": __version__,
    }
    reporter.write_json("summary.json", summary)
    reporter.print(f"done in {summary['total_seconds']:.1f}s; outputs in {reporter.out_dir}")
    return summary


def record_epoch(cfg: Config, info: ProcessInfo, reporter: Reporter, result: EpochResult, lr: float | None) -> None:
    """One metrics.jsonl line and one printed line per epoch."""
    reporter.append_metrics({"epoch": result.epoch, "train_loss": result.train_loss,
                             **{f"val_{k}": v for k, v in result.val.items()},
                             "samples_per_sec": result.samples_per_sec, "lr": lr, "world_size": info.size})
    reporter.print(epoch_line(cfg, result))


def _epochs(cfg: Config, spec: ModelSpec | None, data: Dataset, backend: Backend, info: ProcessInfo,
            reporter: Reporter, pos: Position, commit: Callable[[Position], None] | None) -> EpochResult | None:
    """The epoch loop from `pos` to the end. `commit` (elastic) is called with the position
    every `train.elastic_commit_every` steps and after each epoch."""
    b, acc = cfg.data.batch_size, cfg.train.grad_accumulation
    global_batch = b * info.size
    n_steps = steps_per_epoch(len(data.x_train), b, info.size, acc)
    schedule = LRSchedule(cfg, info.size, n_steps)
    reporter.print(f"hvtrain {__version__}: {cfg.name} on {cfg.backend}, {info.size} rank(s) "
                   f"[{info.controller}], {len(data.x_train)} train / {len(data.x_val)} val samples, "
                   f"global batch {global_batch * acc}, {n_steps} steps/epoch"
                   + (f", {spec.param_count:,} parameters" if spec else ""))
    current_lr = None
    step = pos.step
    result = None
    every, by_step = cfg.train.checkpoint_every, cfg.train.checkpoint_unit == "step"
    for epoch in range(pos.epoch, cfg.train.epochs):
        started = time.perf_counter()
        offset = pos.offset if epoch == pos.epoch else 0
        carried = pos.loss_sum if epoch == pos.epoch and info.is_main else 0.0
        first_steps = epoch_steps = pos.epoch_steps if epoch == pos.epoch else 0  # steps done in this epoch
        order = epoch_permutation(len(data.x_train), cfg.seed, epoch, cfg.data.shuffle)[offset:]
        backend.loss_sum(reset=True)
        bar = reporter.progress(n_steps, f"epoch {epoch + 1}/{cfg.train.epochs}")
        micro = 0
        for batch in shard_batches(order, b, info.rank, info.size, acc):
            lr = schedule(step)
            if lr != current_lr:
                backend.set_lr(lr)
                current_lr = lr
            idx = batch.indices
            finite = backend.train_step(data.x_train[idx], data.y_train[idx], batch.weights, batch.apply)
            if not finite and cfg.train.on_nan == "stop":
                raise HvtrainError(f"non-finite loss at epoch {epoch + 1}, step {step + 1} on rank {info.rank} "
                                   "(train.on_nan: stop; set train.on_nan: skip to skip such updates)")
            micro += 1
            if not batch.apply:
                continue
            step += 1
            epoch_steps += 1
            bar.update()
            if reporter.enabled and step % cfg.train.log_every == 0:
                rate = (epoch_steps - first_steps) * global_batch * acc / (time.perf_counter() - started)
                loss = backend.loss_sum() * info.size / (epoch_steps - first_steps)
                bar.set_postfix_str(f"loss~{loss:.4f} {rate:,.0f} samples/s")
            consumed = offset + micro * global_batch
            save = by_step and every and step % every == 0
            sync = commit is not None and step % cfg.train.elastic_commit_every == 0
            if (save or sync) and consumed < len(data.x_train):  # else the epoch end handles it
                loss = float(backend.allreduce_sum(np.array([carried + backend.loss_sum()]))[0])
                position = Position(epoch, step, consumed, loss, epoch_steps)
                if save:
                    _checkpoint(cfg, backend, info, reporter, position)
                if sync:
                    commit(position)
        bar.close()
        train_seconds = time.perf_counter() - started
        val = evaluate(cfg, data, backend, info, extra=[backend.loss_sum() + carried])
        train_loss = val.pop("extra0") / max(1, epoch_steps)
        result = EpochResult(epoch + 1, train_loss, val, (len(data.x_train) - offset) / train_seconds,
                             time.perf_counter() - started)
        record_epoch(cfg, info, reporter, result, current_lr)
        if every and (by_step and step % every == 0 or not by_step and (epoch + 1) % every == 0):
            _checkpoint(cfg, backend, info, reporter, Position(epoch + 1, step))
        if commit is not None:
            commit(Position(epoch + 1, step))
    return result


@dataclass
class Position:
    """Where training stands: completed epochs, optimizer steps, samples of the current epoch
    already consumed, and the (global) train-loss sum of those samples."""

    epoch: int = 0
    step: int = 0
    offset: int = 0
    loss_sum: float = 0.0
    epoch_steps: int = 0
    source: str | None = None  # not part of the elastic state


def _checkpoint(cfg: Config, backend: Backend, info: ProcessInfo, reporter: Reporter, pos: Position) -> None:
    state, rng = checkpoint.split_rng(backend.get_state())
    rngs = backend.allgather_object(rng)  # every rank's random stream, so each resumes its own
    loss_sum = pos.loss_sum if pos.offset else 0.0  # already summed over ranks by the caller
    if not info.is_main:
        return
    for r, entries in enumerate(rngs):
        state.update({f"rng.rank{r}.{k[4:]}": v for k, v in entries.items()})
    meta = {"epoch": pos.epoch, "step": pos.step, "offset": pos.offset, "loss_sum": loss_sum,
            "epoch_steps": pos.epoch_steps,
            "world_size": info.size, "backend": cfg.backend, "config": cfg.to_dict(),
            "hvtrain_version": __version__}
    path = checkpoint.save(reporter.out_dir, state, meta, cfg.train.keep)
    reporter.print(f"checkpoint: {path} (epoch {pos.epoch}, step {pos.step})")


def _resume(cfg: Config, backend: Backend, info: ProcessInfo, reporter: Reporter, resume: str) -> Position:
    """Rank 0 finds and verifies the checkpoint, every rank gets it by broadcast."""
    found = None
    if info.is_main:
        try:
            found = checkpoint.find_resume(reporter.out_dir, resume, reporter.notice)
        except checkpoint.CheckpointError as exc:
            found = exc
    found = backend.broadcast_object(found)
    if isinstance(found, checkpoint.CheckpointError):
        raise found
    if found is None:
        reporter.notice(f"resume: no checkpoint in {reporter.out_dir}; starting from scratch")
        return Position()
    meta = found.meta
    if meta["backend"] != cfg.backend:
        raise HvtrainError(f"{found.path}: checkpoint was made by backend {meta['backend']!r}, this run uses "
                           f"{cfg.backend!r}; use `hvtrain evaluate` or final.safetensors to move between frameworks")
    same_world = meta["world_size"] == info.size
    rng = {f"rng.{k[len(f'rng.rank{info.rank}.'):]}": v for k, v in found.tensors.items()
           if k.startswith(f"rng.rank{info.rank}.")} if same_world else {}
    state = {k: v for k, v in found.tensors.items() if not k.startswith("rng.")}
    backend.set_state({**state, **rng}, rng=same_world)
    changed = "" if same_world else (
        f"; world size changed {meta['world_size']} -> {info.size}: global batch "
        f"{cfg.data.batch_size * meta['world_size']} -> {cfg.data.batch_size * info.size}, per-rank random "
        "streams reseeded" + (", lr re-scaled" if cfg.optimizer.scale_lr else ""))
    reporter.notice(f"resumed from {found.path} (epoch {meta['epoch']}, step {meta['step']}){changed}")
    reporter.truncate_metrics(meta["epoch"])
    return Position(meta["epoch"], meta["step"], meta["offset"], meta["loss_sum"], meta["epoch_steps"],
                    str(found.path))


def evaluate(cfg: Config, data: Dataset, backend: Backend, info: ProcessInfo,
             extra: list[float] | None = None) -> dict[str, float]:
    """Validation metrics over every validation sample exactly once across ranks.

    Sums (loss, correct, errors, count) are reduced, then divided: every rank gets the
    same global figures. `extra` values are summed in the same allreduce.
    """
    idx = shard_eval(len(data.x_val), info.rank, info.size)
    sums = np.zeros(4, np.float64)
    for start in range(0, len(idx), EVAL_BATCH):
        chunk = idx[start: start + EVAL_BATCH]
        sums += backend.eval_batch(data.x_val[chunk], data.y_val[chunk])
    extra = list(extra or [])
    total = backend.allreduce_sum(np.concatenate([sums, [len(idx)], extra]).astype(np.float64))
    out = metrics_from_sums(cfg, total[:5])
    for i, v in enumerate(total[5:]):
        out[f"extra{i}"] = float(v)
    return out


def metrics_from_sums(cfg: Config, total: np.ndarray) -> dict[str, float]:
    """Global [loss, correct, squared error, absolute error, count] sums -> validation metrics."""
    loss, correct, sq, ab, count = total
    out: dict[str, float] = {"loss": loss / count if count else float("nan")}
    for name in cfg.metrics:
        value = {"accuracy": correct, "mse": sq, "mae": ab}[name]
        out[name] = value / count if count else float("nan")
    out["samples"] = int(count)
    return out


def weight_metadata(cfg: Config, spec: ModelSpec | None) -> dict[str, str]:
    """safetensors header metadata: how to read the file without the config."""
    return {
        "format": "hvtrain-neutral-v1" if spec is not None else f"hvtrain-native-{cfg.backend}",
        "backend": cfg.backend,
        "layers": ",".join(layer.type for layer in spec.layers) if spec else "",
        "input_shape": ",".join(map(str, spec.input_shape)) if spec else "",
        "hvtrain_version": __version__,
    }


def epoch_line(cfg: Config, r: EpochResult) -> str:
    metrics = " ".join(f"val_{k}={v:.4f}" for k, v in r.val.items() if k != "samples")
    return (f"epoch {r.epoch}/{cfg.train.epochs} train_loss={r.train_loss:.4f} {metrics} "
            f"{r.samples_per_sec:,.0f} samples/s {r.seconds:.2f}s")
