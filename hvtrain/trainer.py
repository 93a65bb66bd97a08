"""The one training loop, for every parallel layout: epochs, LR schedule, sharding, checkpoints,
resume, elastic commits, non-finite losses, metrics and outputs.

It drives a StepRunner (hvtrain.steps): the data-parallel backend step or a pipeline stage. It
talks to other ranks only through the Runtime and to files only through the Reporter and the
CheckpointManager. Loss stays on the device until the epoch ends (or a progress-bar refresh
every `train.log_every` steps on the main rank).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hvtrain import __version__
from hvtrain.checkpoint import CheckpointManager, decode, encode, where
from hvtrain.config import Config
from hvtrain.data import Dataset, epoch_permutation, shard_batches, steps_per_epoch
from hvtrain.errors import HvtrainError
from hvtrain.loader import Prefetcher
from hvtrain.manifest import training_hash
from hvtrain.metrics import MetricSet
from hvtrain.output import SCORES_FILE, Reporter
from hvtrain.preempt import Preempted, StopSignals
from hvtrain.runtime import Runtime
from hvtrain.spec import ModelSpec
from hvtrain.steps import StepRunner, digest
from hvtrain.timeseries import in_series_units
from hvtrain.watchdog import Watchdog
from hvtrain.weightfile import INPUTS_KEY, describe_inputs, layer_metadata

WEIGHTS_FILE = "final.safetensors"


@dataclass
class EpochResult:
    epoch: int
    train_loss: float
    val: dict[str, Any]  # scalars, per-class lists, the confusion matrix (hvtrain.metrics)
    samples_per_sec: float
    seconds: float
    data_wait: float = 0.0  # seconds a rank's training thread waited for batches this epoch (mean over ranks)


@dataclass
class Position:
    """Where training stands: completed epochs, optimizer steps, samples of the current epoch
    already consumed, and the (global) train-loss sum of those samples."""

    epoch: int = 0
    step: int = 0
    offset: int = 0
    loss_sum: float = 0.0
    epoch_steps: int = 0


class LRSchedule:
    """Base lr, times the data-parallel width if `scale_lr`, reached by linear warmup over
    `warmup_epochs`. With scale_lr the warmup starts at the single-rank lr (Goyal et al., 2017);
    without it, at zero. Called with the step in this world's units (`schedule_step`)."""

    def __init__(self, cfg: Config, replicas: int, steps_per_epoch: int):
        o = cfg.optimizer
        self.target = o.lr * (replicas if o.scale_lr else 1)
        self.start = o.lr if o.scale_lr else 0.0
        self.warmup_steps = int(round(o.warmup_epochs * steps_per_epoch))

    def __call__(self, step: int) -> float:
        if step >= self.warmup_steps:
            return self.target
        return self.start + (self.target - self.start) * (step + 1) / self.warmup_steps


def schedule_step(epoch: int, offset: int, steps_per_epoch: int, step_samples: int) -> int:
    """The LR schedule's step at a position (`offset` samples into `epoch`) in this world's units:
    the epochs done times this world's steps per epoch, plus the steps `offset` takes at
    `step_samples` a step. Not the run's step counter: a checkpoint (or elastic reset) of
    another world size counted its steps in that world's, so 4 ranks -> 1 rank past the warmup
    re-entered it (warmup_steps is 4x larger at 1 rank). On one world size the two agree."""
    return epoch * steps_per_epoch + -(-offset // step_samples)


@dataclass
class Run:
    """Everything one training run holds: what it trains, who it talks to, where it writes."""

    cfg: Config
    spec: ModelSpec | None
    data: Dataset
    steps: StepRunner
    runtime: Runtime
    reporter: Reporter
    checkpoints: CheckpointManager
    metrics: MetricSet  # what evaluation sums and reports (the StepRunner's eval_sums layout)
    init_unread: bool = False  # model.init_from was not read: --resume expected a checkpoint to continue
    data_wait: float = 0.0  # seconds this rank's training thread waited for batches
    steps_done: int = 0  # optimizer steps taken in all (across resumes)
    stopped_early: bool = False  # train.max_steps ended the run before its last epoch's end
    signals: StopSignals | None = None  # SIGTERM/SIGUSR1 seen by this rank (pre-emption); None: not watched
    watchdog: Watchdog | None = None  # lost-host watchdog, told of every step (None: one rank, elastic, off)
    manifest: Callable[[], None] | None = None  # writes manifest.json once the run trains (not for a finished one)


def fit(run: Run, resume: str | None = None, elastic: Any = None) -> dict[str, Any]:
    """Train for `cfg.train.epochs`; write metrics.jsonl, summary.json, final.safetensors and
    (if configured) checkpoints; continue from a checkpoint when `resume` is given.

    Args:
        elastic: a hvtrain.elastic.Elastic driver (`--elastic`): state committed in memory every
            `train.elastic_commit_every` steps, restored and re-sharded when workers leave or join.
    """
    t0 = time.perf_counter()
    # Elastic runs start without talking (a joining worker must meet only Horovod's state sync);
    # their run id travels in the elastic state instead. They never resume from files.
    resumed = run.checkpoints.start(resume, run.steps.shard, run.steps.replicas) if elastic is None else None
    pos = Position()
    if resume and resumed is None and run.init_unread:
        raise HvtrainError(f"--resume {resume}: no checkpoint to continue, and model.init_from "
                           f"({run.cfg.model.init_from}) was not read because checkpoint files were there; start "
                           "without --resume to begin from init_from")
    if resume == "auto" and resumed is None:
        kept = _finished_without_checkpoints(run)
        if kept is not None:
            return kept
    if resume and resumed is None:
        run.reporter.notice(f"resume: no checkpoint in {run.reporter.out_dir}; starting from scratch")
        run.reporter.truncate_metrics(0)  # nothing to continue: a fresh history, not the old one's tail
    if resumed is not None:
        run.steps.set_state(resumed.state, rng=resumed.rng)
        m = resumed.meta
        pos = Position(m["epoch"], m["step"], m["offset"], m["loss_sum"], m["epoch_steps"])
        if finished(run.cfg, pos):
            kept = _kept_results(run, resumed.path, m, pos, resume)
            if kept is not None:
                return kept
        else:  # (a finished run's cut epoch keeps its partial line)
            run.reporter.truncate_metrics(pos.epoch)
    if run.manifest is not None:  # this run trains (or completes its outputs): its facts replace the last run's
        run.manifest()
    if elastic is not None:
        result = elastic.run(run, pos, _epochs)
    else:
        _stop_before_training(run, resumed)
        result = _epochs(run, pos, None)
    if result is None and resumed is not None:  # resumed at its end, its outputs never written
        result = _last_epoch(run, pos)
    return finish(run, result, t0, {"resumed_from": resumed.path if resumed else None,
                                    "run_id": run.checkpoints.run_id, "elastic": elastic is not None})


def finished(cfg: Config, pos: Position) -> bool:
    """Whether training from `pos` has nothing left: train.epochs done or train.max_steps reached."""
    return pos.epoch >= cfg.train.epochs or bool(cfg.train.max_steps) and pos.step >= cfg.train.max_steps


def _kept_results(run: Run, path: str, meta: dict[str, Any], pos: Position, resume: str) -> dict[str, Any] | None:
    """A resume from a checkpoint at the run's end (every requeue script passes `--resume auto`,
    finished or not): the run stays finished. Its summary.json, final.safetensors, metrics and
    scores are kept as they are and the summary is returned (it used to be rewritten with no
    train loss or val metrics, and val_scores.npz deleted). None when that run's outputs were never
    written (killed after its last checkpoint; a summary older than the checkpoint is an earlier
    run's): then the caller completes them from the checkpoint.

    Raises:
        HvtrainError: the directory's summary.json is another run's, written after the checkpoint
            (finishing this one would overwrite it).
    """
    reporter, limit, run_id = run.reporter, run.cfg.train.max_steps, meta["run_id"]
    summary, written = reporter.read_json("summary.json"), reporter.modified("summary.json")
    final = reporter.modified(WEIGHTS_FILE) is not None
    summary, written, final = run.runtime.broadcast_object((summary, written, final))
    end = (f"epoch {pos.epoch} of train.epochs {run.cfg.train.epochs}" if pos.epoch >= run.cfg.train.epochs
           else f"step {pos.step} of train.max_steps {limit}")
    if summary is not None and summary.get("run_id") != run_id and written < meta.get("created", 0.0):
        summary = None  # an earlier run's, which this one replaces in the directory
    if summary is None or not final:
        reporter.notice(f"resume: {path} is the end of training ({end}) but the run's outputs were not written: "
                        "writing them from it")
        return None
    if summary.get("run_id") != run_id:
        raise HvtrainError(f"--resume {resume}: {path} is the end of run {run_id} ({end}), but "
                           f"{reporter.out_dir / 'summary.json'} is run {summary.get('run_id')}'s, written after it, "
                           "which finishing it would overwrite; train in another output_dir, or without --resume to "
                           "train anew")
    reporter.notice(f"resume: {path} is the end of training ({end}): the run is finished and its results in "
                    f"{reporter.out_dir} are kept (raise train.epochs or train.max_steps to train on)")
    return summary


def _finished_without_checkpoints(run: Run) -> dict[str, Any] | None:
    """`--resume auto` (a requeue script passes it every time) where no checkpoint is, because
    this config writes none: when the directory holds the finished outputs of this same config
    (summary.json with its training_hash, and final.safetensors), the run is finished and they are
    kept (they used to be trained over from scratch); None otherwise (train anew, as before)."""
    summary = run.reporter.read_json("summary.json")
    final = run.reporter.modified(WEIGHTS_FILE) is not None
    summary, final = run.runtime.broadcast_object((summary, final))
    if summary is None or not final or summary.get("config_hash") != training_hash(run.cfg):
        return None
    run.reporter.notice(f"resume: no checkpoint in {run.reporter.out_dir}, but the run there finished on this config "
                        "(summary.json, final.safetensors): its results are kept (this config writes no checkpoints to "
                        "continue from: another config, or no --resume, trains anew)")
    return summary


def _last_epoch(run: Run, pos: Position) -> EpochResult:
    """The figures of a run resumed at its end whose outputs were never written: the checkpoint's
    weights evaluated now, the train loss and rate from that epoch's metrics.jsonl line."""
    val, _ = evaluate(run)
    record = run.runtime.broadcast_object(run.reporter.last_metrics()) or {}
    return EpochResult(int(record.get("epoch", pos.epoch)), record.get("train_loss"), val,
                       record.get("samples_per_sec"), 0.0)


def _epochs(run: Run, pos: Position, commit: Callable[[Position], None] | None) -> EpochResult | None:
    """The epoch loop from `pos` to the end. `commit` (elastic) is called with the position
    every `train.elastic_commit_every` steps and after each epoch."""
    cfg, data, steps, reporter, info = run.cfg, run.data, run.steps, run.reporter, run.runtime.info
    b, acc = cfg.data.batch_size, cfg.train.grad_accumulation
    global_batch = b * steps.replicas
    n_train = len(data.train)
    n_steps = steps_per_epoch(n_train, b, steps.replicas, acc)
    schedule = LRSchedule(cfg, steps.replicas, n_steps)
    reporter.print(f"hvtrain {__version__}: {cfg.name} on {cfg.backend}, {info.size} rank(s) [{info.controller}], "
                   f"{steps.describe()}, {data.name}: {n_train} train / {len(data.val)} val samples, "
                   f"global batch {global_batch * acc}, {n_steps} steps/epoch"
                   + (f", {run.spec.param_count:,} parameters" if run.spec else ""))
    current_lr = None
    step = pos.step
    result = None
    every, by_step = cfg.train.checkpoint_every, cfg.train.checkpoint_unit == "step"
    limit = cfg.train.max_steps or None
    run.steps_done = step
    for epoch in range(pos.epoch, cfg.train.epochs):
        if limit is not None and step >= limit:
            run.stopped_early = True
            break
        started = time.perf_counter()
        offset = pos.offset if epoch == pos.epoch else 0
        carried = pos.loss_sum if epoch == pos.epoch and info.is_main else 0.0
        first_steps = epoch_steps = pos.epoch_steps if epoch == pos.epoch else 0  # steps done in this epoch
        at = schedule_step(epoch, offset, n_steps, global_batch * acc) - first_steps  # + epoch_steps: the LR's step
        order = epoch_permutation(n_train, cfg.seed, epoch, cfg.data.shuffle)[offset:]
        steps.loss_sum(reset=True)
        bar = reporter.progress(n_steps, f"epoch {epoch + 1}/{cfg.train.epochs}")
        micro = 0
        batches = shard_batches(order, b, steps.replica, steps.replicas, acc)
        with Prefetcher(data.train, batches, cfg.data.prefetch, steps.needs_x, steps.needs_y) as loader:
            for batch, x, y in loader:
                lr = schedule(at + epoch_steps)
                if lr != current_lr:
                    steps.set_lr(lr)
                    current_lr = lr
                if not steps.train_batch(batch, x, y) and cfg.train.on_nan == "stop":
                    raise HvtrainError(f"non-finite loss at epoch {epoch + 1}, step {step + 1} on rank {info.rank} "
                                       "(train.on_nan: stop; set train.on_nan: skip to skip such updates)")
                micro += 1
                if run.watchdog is not None:
                    run.watchdog.beat()
                if not batch.apply:
                    continue
                step += 1
                run.steps_done = step
                epoch_steps += 1
                bar.update()
                if reporter.enabled and step % cfg.train.log_every == 0:
                    rate = (epoch_steps - first_steps) * global_batch * acc / (time.perf_counter() - started)
                    bar.set_postfix_str(f"{rate:,.0f} samples/s")
                consumed = min(n_train, offset + micro * global_batch)
                preempt = (run.signals is not None and run.signals.enabled
                           and step % cfg.train.signal_check_every == 0 and _signalled_anywhere(run))
                stop = limit is not None and step >= limit
                save = by_step and every and step % every == 0 or stop and every or preempt
                sync = commit is not None and step % cfg.train.elastic_commit_every == 0
                # At the epoch's end its own checkpoint and commit follow evaluation; a pre-emption
                # cannot wait for that (the resumed run evaluates the finished epoch instead).
                if (save or sync) and (consumed < n_train or preempt):
                    loss = float(run.runtime.allreduce_sum(np.array([carried + steps.loss_sum()]))[0])
                    position = Position(epoch, step, consumed, loss, epoch_steps)
                    path = _checkpoint(run, position) if save else None
                    if sync:
                        commit(position)
                    if preempt:
                        _preempted(run, position, path)
                if stop:
                    break
            run.data_wait += loader.wait_seconds
            epoch_wait = loader.wait_seconds
        bar.close()
        train_seconds = time.perf_counter() - started
        consumed = min(n_train, offset + micro * global_batch)
        val, (loss_total, wait_total) = evaluate(run, extra=[steps.loss_sum() + carried, epoch_wait])
        result = EpochResult(epoch + 1, loss_total / max(1, epoch_steps), val,
                             (consumed - offset) / train_seconds, time.perf_counter() - started,
                             wait_total / info.size)
        if consumed < n_train:  # stopped by train.max_steps inside the epoch
            run.stopped_early = True
            record_epoch(run, result, current_lr, partial=True)
            reporter.print(f"stopped at train.max_steps={limit} (epoch {epoch + 1}, {consumed} of {n_train} samples)")
            break
        record_epoch(run, result, current_lr if current_lr is not None else schedule(max(at + epoch_steps - 1, 0)))
        stop = limit is not None and step >= limit
        if every and (by_step and step % every == 0 or not by_step and (epoch + 1) % every == 0 or stop):
            _checkpoint(run, Position(epoch + 1, step))
        if commit is not None:
            commit(Position(epoch + 1, step))
    return result


def _checkpoint(run: Run, pos: Position) -> Any:
    return run.checkpoints.save(asdict(pos), run.steps.shard, run.steps.owns_shard, run.steps.get_state(),
                                run.steps.replicas, run.steps.weights() if run.steps.owns_shard else None)


def _signalled_anywhere(run: Run) -> bool:
    """One allreduce: did any rank get SIGTERM/SIGUSR1? Every rank gets the same answer, so a signal
    that reached one rank (or only the launcher) stops every rank at this same step."""
    mine = 1.0 if run.signals.received else 0.0
    return bool(run.runtime.allreduce_sum(np.array([mine]), name="hvtrain.preempt")[0] > 0)


def _stop_before_training(run: Run, resumed: Any) -> None:
    """A notice during start-up (config, data, framework import, Horovod, the first broadcasts) was
    recorded, not fatal: every rank stops here, before the first step, with nothing to lose (no
    checkpoint or result written; one allreduce, as the loop asks)."""
    if run.signals is None or not run.signals.enabled or not _signalled_anywhere(run):
        return
    kept = (f"{resumed.path} still holds the run at {where(resumed.meta)}; resume with --resume auto" if resumed
            else "run it again")
    message = f"preempted before training started: nothing trained, nothing to lose; {kept}"
    run.reporter.notice(message)
    raise Preempted(message)


def _preempted(run: Run, pos: Position, path: Any) -> None:
    """The checkpoint at `pos` is written by rank 0: every rank gets its path from there, so no rank
    exits before the file is complete (a launcher ends the job when its first rank exits, rank 0
    mid-write included); rank 0 says where, and every rank ends with Preempted."""
    path = run.runtime.broadcast_object(str(path) if path else None)
    message = f"preempted at {where(asdict(pos))}: checkpoint {path}; resume with --resume auto"
    run.reporter.notice(message)
    raise Preempted(message)


def evaluate(run: Run, extra: list[float] | None = None) -> tuple[dict[str, Any], list[float]]:
    """Validation metrics over every validation sample exactly once across replicas, and the
    `extra` values summed over ranks in the same allreduce. Every rank gets the same figures."""
    return reduce_metrics(run.runtime, run.metrics, run.steps.eval_sums(run.data.val), extra)


def reduce_metrics(runtime: Runtime, metrics: MetricSet, sums: np.ndarray,
                   extra: list[float] | None = None) -> tuple[dict[str, Any], list[float]]:
    """This rank's evaluation sums (`metrics`' layout) and `extra` values, summed over ranks in one
    allreduce -> the metric values (from global sums only) and the summed extras. roc_auc's
    kept rows are gathered once here too (MetricSet.reduce_scores)."""
    total = runtime.allreduce_sum(np.concatenate([sums, list(extra or [])]))
    metrics.reduce_scores(runtime)
    return metrics.values(total[:metrics.size]), [float(v) for v in total[metrics.size:]]


def record_epoch(run: Run, result: EpochResult, lr: float | None, partial: bool = False) -> None:
    """One metrics.jsonl line and one printed line per epoch (`partial`: cut short by max_steps;
    a resumed run rewrites that epoch whole)."""
    run.reporter.append_metrics({"epoch": result.epoch, "train_loss": result.train_loss,
                                 **{f"val_{k}": v for k, v in result.val.items()},
                                 "samples_per_sec": result.samples_per_sec, "lr": lr,
                                 "data_wait_s": result.data_wait,
                                 "world_size": run.runtime.info.size, **({"partial": True} if partial else {})})
    run.reporter.print(epoch_line(run.cfg, result))


def final_weights(run: Run) -> tuple[dict[str, np.ndarray], bool]:
    """The neutral weights of the whole model on rank 0 (each shard from its first rank), and whether
    every replica of every shard holds bitwise the same trainable weights (a silent divergence
    otherwise; batchnorm statistics are per replica and the file holds the first replica's)."""
    steps, rt = run.steps, run.runtime
    mine = steps.weights()
    trainable = steps.trainable_names()
    fingerprints = rt.allgather_object((steps.shard, digest({k: v for k, v in mine.items() if k in trainable})))
    agree = all(len({d for s, d in fingerprints if s == shard}) == 1 for shard, _ in fingerprints)
    blobs = rt.gather_bytes(encode(mine if steps.owns_shard else {}))
    weights: dict[str, np.ndarray] = {}
    for blob in blobs or []:
        weights.update(decode(blob))
    return weights, agree


def finish(run: Run, result: EpochResult | None, t0: float, extra: dict[str, Any]) -> dict[str, Any]:
    """final.safetensors and summary.json (the last epoch's figures plus run facts)."""
    cfg, info = run.cfg, run.runtime.info
    weights, agree = final_weights(run)
    if not agree:
        raise HvtrainError("replicas ended with different weights (every data-parallel replica must hold the "
                           "same model); the run's outputs were not written")
    layout = run.steps.summary()
    per_rank = run.runtime.allgather_object(layout.pop("rank", None)) if "rank" in layout else None
    usage = run.runtime.allgather_object((peak_rss_mb(), run.data_wait))
    run.reporter.write_weights(WEIGHTS_FILE, weights, weight_metadata(cfg, run.spec, run.data))
    run.reporter.write_arrays(SCORES_FILE, final_scores(run, result))
    summary = {
        "name": cfg.name, "backend": cfg.backend, "world_size": info.size, "controller": info.controller,
        "epochs": cfg.train.epochs, "train_loss": result.train_loss if result else None,
        **({f"val_{k}": v for k, v in result.val.items()} if result else {}),
        "samples_per_sec": result.samples_per_sec if result else None,
        "steps": run.steps_done, "max_steps": cfg.train.max_steps or None,
        "stopped_at_max_steps": run.stopped_early,
        "total_seconds": time.perf_counter() - t0, "weights": WEIGHTS_FILE, "replicas_agree": agree,
        "peak_rss_mb": {"max": max(u[0] for u in usage), "rank0": usage[0][0], "ranks": [u[0] for u in usage]},
        "data_wait_seconds": {"max": max(u[1] for u in usage), "rank0": usage[0][1]},
        **({"pipeline": {**layout, "ranks": per_rank}} if per_rank is not None else {}),
        **({"series": series_summary(run.data.series, result)} if run.data.series else {}),
        **extra, "config_hash": training_hash(cfg), "hvtrain_version": __version__,
    }
    run.reporter.write_json("summary.json", summary)
    run.reporter.close()
    if "val_mae" in summary.get("series", {}) and "persistence_val_mae" in summary["series"]:
        f = summary["series"]
        run.reporter.print(f"forecast val_mae={f['val_mae']:.4g} in the series' units (persistence: "
                           f"{f['persistence_val_mae']:.4g})")
    run.reporter.print(f"done in {summary['total_seconds']:.1f}s; outputs in {run.reporter.out_dir}")
    # Every rank returns once rank 0's files exist: the Python API's next call (evaluate, predict,
    # init_from) reads final.safetensors on every rank.
    run.runtime.broadcast_object(None)
    return summary


def series_summary(facts: dict[str, Any], result: EpochResult | None) -> dict[str, Any]:
    """data.window's facts and the model's validation MAE / RMSE in the series' own units."""
    return {**facts, **(in_series_units(facts, result.val) if result else {})}


def final_scores(run: Run, result: EpochResult | None) -> dict[str, np.ndarray] | None:
    """The last evaluation's validation scores (roc_auc: gathered on rank 0, which writes them),
    for `hvtrain report`'s ROC curve: `scores` [n, 1] P(class 1) (binary) or [n, classes],
    `labels` (class ids), `epoch`. None without roc_auc (any old file is removed)."""
    last = run.metrics.last_scores
    if last is None or result is None:
        return None
    return {"scores": last[0], "labels": last[1], "epoch": np.array(result.epoch)}


def peak_rss_mb() -> float:
    """This process's peak resident set size (Linux reports KiB)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def weight_metadata(cfg: Config, spec: ModelSpec | None, data: Dataset) -> dict[str, str]:
    """safetensors header metadata: how to read the file without the config, and `inputs` (the raw
    row shape, the training split's normalisation, the classes: predict needs no training data)."""
    return {
        INPUTS_KEY: json.dumps(describe_inputs(cfg, data)),
        "format": "hvtrain-neutral-v1" if spec is not None else f"hvtrain-native-{cfg.backend}",
        "backend": cfg.backend,
        **layer_metadata(spec),
        "input_shape": ",".join(map(str, spec.input_shape)) if spec else "",
        "hvtrain_version": __version__,
    }


def epoch_line(cfg: Config, r: EpochResult) -> str:
    """The printed line: scalar metrics only (per-class values and the confusion matrix are in
    metrics.jsonl and summary.json)."""
    metrics = " ".join(f"val_{k}={v:.4f}" for k, v in r.val.items() if k != "samples" and isinstance(v, float))
    return (f"epoch {r.epoch}/{cfg.train.epochs} train_loss={r.train_loss:.4f} {metrics} "
            f"{r.samples_per_sec:,.0f} samples/s {r.seconds:.2f}s")
