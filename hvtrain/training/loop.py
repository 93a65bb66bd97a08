"""The one training loop, for every parallel layout: epochs, LR schedule, sharding, checkpoints,
resume, elastic commits, non-finite losses, pre-emption, metrics.

It drives a StepRunner (hvtrain.backends.steps): the data-parallel backend step or a pipeline
stage. It talks to other ranks only through the Runtime and to files only through the Reporter
and the CheckpointManager. Loss stays on the device until the epoch ends (or a progress-bar
refresh every `train.log_every` steps on the main rank).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from hvtrain.config.schema import Config
from hvtrain.config.validate import per_sample_randomness
from hvtrain.data.batches import epoch_permutation, shard_batches, steps_per_epoch
from hvtrain.data.loader import Prefetcher
from hvtrain.errors import HvtrainError, Preempted
from hvtrain.io.checkpoints import where
from hvtrain.metrics.suite import MetricSet
from hvtrain.runtime.horovod import Runtime
from hvtrain.training.finish import finish
from hvtrain.training.resume import finished, finished_without_checkpoints, kept_results, unnamed_data
from hvtrain.training.run import EpochResult, Position, Run
from hvtrain.training.schedule import LRSchedule, schedule_step
from hvtrain.version import __version__


def fit(run: Run, resume: str | None = None, elastic: Any = None) -> dict[str, Any]:
    """Train for `cfg.train.epochs`; write metrics.jsonl, summary.json, final.safetensors and
    (if configured) checkpoints; continue from a checkpoint when `resume` is given.

    Args:
        elastic: a hvtrain.training.elastic.Elastic driver (`--elastic`): state committed in memory every
            `train.elastic_commit_every` steps, restored and re-sharded when workers leave or join.
    """
    t0 = time.perf_counter()
    # Elastic runs start without talking (a joining worker must meet only Horovod's state sync);
    # their run id travels in the elastic state instead. They never resume from files.
    resumed = run.checkpoints.start(resume, run.steps.shard, run.steps.replicas, unnamed_data(run)) \
        if elastic is None else None
    pos = Position()
    if resume and resumed is None and run.init_unread:
        raise HvtrainError(f"--resume {resume}: no checkpoint to continue, and model.init_from "
                           f"({run.cfg.model.init_from}) was not read because checkpoint files were there; start "
                           "without --resume to begin from init_from")
    if resume == "auto" and resumed is None:
        kept = finished_without_checkpoints(run)
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
            kept = kept_results(run, resumed.path, m, pos, resume)
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
                   + (f", augment: {data.train.augment.describe()}" if data.train.augment else "")
                   + (f", {cfg.data.workers} data worker(s) per rank" if cfg.data.workers else "")
                   + (f", dropout masks {'per sample' if per_sample_randomness(cfg) else 'per rank'}"
                      if run.spec is not None and run.spec.draws_random else "")
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
        bad_steps: list[int] = []  # on_nan: skip: steps with a non-finite loss on this rank
        step_bad = False
        batches = shard_batches(order, b, steps.replica, steps.replicas, acc, epoch)
        with Prefetcher(data.train, batches, cfg.data.prefetch, steps.needs_x, steps.needs_y,
                        epoch, run.data_workers) as loader:
            for batch, x, y in loader:
                lr = schedule(at + epoch_steps)
                if lr != current_lr:
                    steps.set_lr(lr)
                    current_lr = lr
                if not steps.train_batch(batch, x, y):
                    if cfg.train.on_nan == "stop":
                        raise HvtrainError(f"non-finite loss at epoch {epoch + 1}, step {step + 1} on rank {info.rank} "
                                           "(train.on_nan: stop; set train.on_nan: skip to skip such updates)")
                    step_bad = True
                micro += 1
                if run.watchdog is not None:
                    run.watchdog.beat()
                if not batch.apply:
                    continue
                step += 1
                run.steps_done = step
                epoch_steps += 1
                if step_bad:
                    bad_steps.append(step)
                    step_bad = False
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
        skipped = _skipped_steps(run, bad_steps, epoch, epoch_steps - first_steps)
        train_seconds = time.perf_counter() - started
        consumed = min(n_train, offset + micro * global_batch)
        val, (loss_total, wait_total) = evaluate(run, extra=[steps.loss_sum() + carried, epoch_wait])
        result = EpochResult(epoch + 1, loss_total / max(1, epoch_steps), val,
                             (consumed - offset) / train_seconds, time.perf_counter() - started,
                             wait_total / info.size)
        if consumed < n_train:  # stopped by train.max_steps inside the epoch
            run.stopped_early = True
            record_epoch(run, result, current_lr, partial=True, skipped=skipped)
            reporter.print(f"stopped at train.max_steps={limit} (epoch {epoch + 1}, {consumed} of {n_train} samples)")
            break
        record_epoch(run, result, current_lr if current_lr is not None else schedule(max(at + epoch_steps - 1, 0)),
                     skipped=skipped)
        stop = limit is not None and step >= limit
        if every and (by_step and step % every == 0 or not by_step and (epoch + 1) % every == 0 or stop):
            _checkpoint(run, Position(epoch + 1, step))
        if commit is not None:
            commit(Position(epoch + 1, step))
    return result


def _skipped_steps(run: Run, bad: list[int], epoch: int, ran: int) -> int | None:
    """train.on_nan: skip: how many of the steps this epoch ran were skipped for a non-finite loss
    on some rank (one allgather at the epoch's end; None under stop, which never gets here with
    one). An epoch that skipped every step trained nothing: that ends the run, not train_loss 0.0.

    Raises:
        HvtrainError: every step of the epoch was skipped.
    """
    if run.cfg.train.on_nan != "skip":
        return None
    skipped = len(set().union(*(set(b) for b in run.runtime.allgather_object(bad))))
    if ran and skipped == ran:
        raise HvtrainError(f"train.on_nan: skip skipped every one of epoch {epoch + 1}'s {ran} steps (each had a "
                           "non-finite loss on some rank): nothing was trained; lower optimizer.lr or check the "
                           "data's scale")
    return skipped


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


def record_epoch(run: Run, result: EpochResult, lr: float | None, partial: bool = False,
                 skipped: int | None = None) -> None:
    """One metrics.jsonl line and one printed line per epoch (`partial`: cut short by max_steps;
    a resumed run rewrites that epoch whole; `skipped`: on_nan: skip's skipped steps, recorded
    as skipped_steps)."""
    if skipped:
        run.reporter.print(f"epoch {result.epoch}: {skipped} step(s) skipped: a non-finite loss (train.on_nan: skip)")
    run.reporter.append_metrics({"epoch": result.epoch, "train_loss": result.train_loss,
                                 **({"skipped_steps": skipped} if skipped is not None else {}),
                                 **{f"val_{k}": v for k, v in result.val.items()},
                                 "samples_per_sec": result.samples_per_sec, "lr": lr,
                                 "data_wait_s": result.data_wait,
                                 "world_size": run.runtime.info.size, **({"partial": True} if partial else {})})
    run.reporter.print(epoch_line(run.cfg, result))


def epoch_line(cfg: Config, r: EpochResult) -> str:
    """The printed line: scalar metrics only (per-class values and the confusion matrix are in
    metrics.jsonl and summary.json)."""
    metrics = " ".join(f"val_{k}={v:.4f}" for k, v in r.val.items() if k != "samples" and isinstance(v, float))
    return (f"epoch {r.epoch}/{cfg.train.epochs} train_loss={r.train_loss:.4f} {metrics} "
            f"{r.samples_per_sec:,.0f} samples/s {r.seconds:.2f}s")
