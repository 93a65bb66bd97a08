"""Pipeline execution: the schedule, MPI point-to-point between stages, and the training loop.

Every rank of a pipeline computes the same batch plan from the seed (replica d takes data
shard d of D), splits each rank-batch into micro-batches, and runs its stage's op list.
Activations go forward and gradients backward as float32 numpy buffers: non-blocking
sends (kept alive until the step ends), blocking receives into preallocated buffers, one
tag per (micro-batch, direction), so no two stages can deadlock on each other.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from mpi4py import MPI

from hvtrain import checkpoint
from hvtrain.config import Config
from hvtrain.data import Dataset, epoch_permutation, shard_batches, shard_eval, steps_per_epoch
from hvtrain.dist import ProcessInfo
from hvtrain.errors import HvtrainError
from hvtrain.output import Reporter
from hvtrain.placement.plan import PipelinePlan
from hvtrain.placement.schedule import stage_ops
from hvtrain.placement.stage import StageEngine
from hvtrain.spec import ModelSpec
from hvtrain.trainer import EVAL_BATCH, EpochResult, LRSchedule, finish, metrics_from_sums, record_epoch

# Training tags are 2m and 2m+1 (m < micro_batches <= 4096); MPI guarantees tags up to 32767.
_EVAL_TAG = 20_000


class PipelineRunner:
    def __init__(self, plan: PipelinePlan, spec: ModelSpec, engine: StageEngine, comm: Any, rank: int):
        self.plan, self.engine, self.comm = plan, engine, comm
        self.rank = rank
        self.s = plan.stage_of(rank)
        self.replica = plan.replica_of(rank)
        stage = plan.stages[self.s]
        self.first, self.last = self.s == 0, self.s == plan.num_stages - 1
        self.prev = None if self.first else rank - 1
        self.next = None if self.last else rank + 1
        self.in_shape = spec.layers[stage.first].input_shape
        self.out_shape = stage.out_shape
        self.peak_in_flight = 0

    def _recv(self, source: int, shape: tuple[int, ...], tag: int) -> np.ndarray:
        buf = np.empty(shape, np.float32)
        self.comm.Recv(buf, source=source, tag=tag)
        return buf

    def train_batch(self, data: Dataset, idx: np.ndarray, w: np.ndarray, apply: bool) -> None:
        chunks = np.array_split(np.arange(len(idx)), min(self.plan.micro_batches, len(idx)))
        sends, live = [], 0
        for kind, m in stage_ops(self.plan.schedule, self.plan.num_stages, self.s, len(chunks)):
            sel = chunks[m]
            if kind == "F":
                if self.first:
                    x = data.x_train[idx[sel]]
                else:
                    x = self._recv(self.prev, (len(sel),) + self.in_shape, 2 * m)
                if self.last:
                    if not self.engine.forward_loss(m, x, data.y_train[idx[sel]], w[sel]):
                        raise HvtrainError(f"non-finite loss in micro-batch {m} on rank {self.rank} (last stage; "
                                           "train.on_nan: stop)")
                else:
                    out = np.ascontiguousarray(self.engine.forward(m, x), np.float32)
                    sends.append((self.comm.Isend(out, dest=self.next, tag=2 * m), out))
                live += 1
                self.peak_in_flight = max(self.peak_in_flight, live)
            else:
                grad = None if self.last else self._recv(self.next, (len(sel),) + self.out_shape, 2 * m + 1)
                g_in = self.engine.backward(m, grad)
                if not self.first:
                    g_in = np.ascontiguousarray(g_in, np.float32)
                    sends.append((self.comm.Isend(g_in, dest=self.prev, tag=2 * m + 1), g_in))
                live -= 1
        MPI.Request.Waitall([req for req, _ in sends])
        if apply:
            self.engine.step()

    def eval_sums(self, data: Dataset) -> np.ndarray:
        """This replica's share of validation, pushed through the pipeline without gradients."""
        idx = shard_eval(len(data.x_val), self.replica, self.plan.replicas)
        sums = np.zeros(4, np.float64)
        for k, start in enumerate(range(0, len(idx), EVAL_BATCH)):
            chunk = idx[start: start + EVAL_BATCH]
            x = data.x_val[chunk] if self.first else self._recv(self.prev, (len(chunk),) + self.in_shape, _EVAL_TAG + k)
            if self.last:
                sums += self.engine.eval_sums(x, data.y_val[chunk])
            else:
                self.comm.Send(np.ascontiguousarray(self.engine.predict(x), np.float32), dest=self.next,
                               tag=_EVAL_TAG + k)
        return sums if self.last else np.zeros(4, np.float64)


def fit_pipeline(cfg: Config, spec: ModelSpec, data: Dataset, engine: StageEngine, plan: PipelinePlan,
                 info: ProcessInfo, reporter: Reporter, comm: Any, resume: str | None = None) -> dict[str, Any]:
    """The pipeline counterpart of trainer.fit: same outputs, same file formats, epoch checkpoints."""
    t0 = time.perf_counter()
    runner = PipelineRunner(plan, spec, engine, comm, info.rank)
    D, b, acc = plan.replicas, cfg.data.batch_size, cfg.train.grad_accumulation
    n_steps = steps_per_epoch(len(data.x_train), b, D, acc)
    schedule = LRSchedule(cfg, D, n_steps)
    reporter.print(f"hvtrain: {cfg.name} on {cfg.backend}, pipeline {plan.num_stages} stages x {D} replica(s), "
                   f"{plan.micro_batches} micro-batches ({plan.schedule}), {n_steps} steps/epoch, "
                   f"{spec.param_count:,} parameters")
    start_epoch, step = _resume(cfg, plan, engine, info, reporter, comm, resume) if resume else (0, 0)
    current_lr, result = None, None
    for epoch in range(start_epoch, cfg.train.epochs):
        started = time.perf_counter()
        order = epoch_permutation(len(data.x_train), cfg.seed, epoch, cfg.data.shuffle)
        engine.loss_sum(reset=True)
        for batch in shard_batches(order, b, runner.replica, D, acc):
            lr = schedule(step)
            if lr != current_lr:
                engine.set_lr(lr)
                current_lr = lr
            runner.train_batch(data, batch.indices, batch.weights, batch.apply)
            step += batch.apply
        train_seconds = time.perf_counter() - started
        local = np.concatenate([runner.eval_sums(data), [len(shard_eval(len(data.x_val), runner.replica, D))
                                                          if runner.last else 0],
                                [engine.loss_sum() if runner.last else 0.0]])
        total = np.empty_like(local)
        comm.Allreduce(local, total, op=MPI.SUM)
        val = metrics_from_sums(cfg, total[:5])
        result = EpochResult(epoch + 1, total[5] / n_steps, val, len(data.x_train) / train_seconds,
                             time.perf_counter() - started)
        record_epoch(cfg, info, reporter, result, current_lr)
        if cfg.train.checkpoint_every and (epoch + 1) % cfg.train.checkpoint_every == 0:
            _checkpoint(cfg, plan, engine, info, reporter, comm, epoch + 1, step)

    # One neutral file, identical to an unpipelined run's: replica 0's stages, gathered on rank 0.
    pieces = comm.gather(engine.get_weights() if runner.replica == 0 else {}, root=0)
    per_rank = comm.gather({"params": engine.param_count(), "peak_in_flight": runner.peak_in_flight,
                            "peak_activation_bytes": engine.peak_activation_bytes()}, root=0)
    weights = {k: v for piece in (pieces or []) for k, v in piece.items()}
    pipeline = {"stages": plan.num_stages, "replicas": D, "micro_batches": plan.micro_batches,
                "schedule": plan.schedule, "bubble": plan.bubble, "stage_params": [st.params for st in plan.stages],
                "ranks": per_rank}
    return finish(cfg, spec, info, reporter, result, t0, weights, {"pipeline": pipeline, "resumed_from": resume})


def _layout(plan: PipelinePlan) -> list[list[int]]:
    return [[st.first, st.last] for st in plan.stages]


def _checkpoint(cfg: Config, plan: PipelinePlan, engine: StageEngine, info: ProcessInfo, reporter: Reporter,
                comm: Any, epoch: int, step: int) -> None:
    """One file for the whole pipeline: every stage's state (from replica 0) and every rank's RNG."""
    state, rng = checkpoint.split_rng(engine.get_state())
    replica0 = plan.replica_of(info.rank) == 0
    pieces = comm.gather((plan.stage_of(info.rank), state if replica0 else None, rng), root=0)
    if not info.is_main:
        return
    tensors: dict[str, np.ndarray] = {}
    for r, (s, stage_state, rank_rng) in enumerate(pieces):
        if stage_state is not None:
            tensors.update({f"stage{s}.{k}": v for k, v in stage_state.items()})
        tensors.update({f"rng.rank{r}.{k[4:]}": v for k, v in rank_rng.items()})
    meta = {"epoch": epoch, "step": step, "offset": 0, "loss_sum": 0.0, "epoch_steps": 0,
            "world_size": info.size, "backend": cfg.backend, "config": cfg.to_dict(), "pipeline": _layout(plan)}
    path = checkpoint.save(reporter.out_dir, tensors, meta, cfg.train.keep)
    reporter.print(f"checkpoint: {path} (epoch {epoch}, step {step})")


def _resume(cfg: Config, plan: PipelinePlan, engine: StageEngine, info: ProcessInfo, reporter: Reporter,
            comm: Any, resume: str) -> tuple[int, int]:
    found: Any = None
    if info.is_main:
        try:
            found = checkpoint.find_resume(reporter.out_dir, resume, reporter.notice)
        except checkpoint.CheckpointError as exc:
            found = exc
    found = comm.bcast(found, root=0)
    if isinstance(found, checkpoint.CheckpointError):
        raise found
    if found is None:
        reporter.notice(f"resume: no checkpoint in {reporter.out_dir}; starting from scratch")
        return 0, 0
    meta = found.meta
    if meta.get("pipeline") != _layout(plan) or meta["backend"] != cfg.backend:
        raise HvtrainError(f"{found.path}: made with backend {meta['backend']!r} and stages {meta.get('pipeline')}, "
                           f"this run has {cfg.backend!r} and stages {_layout(plan)}; resume with the same placement")
    prefix = f"stage{plan.stage_of(info.rank)}."
    state = {k[len(prefix):]: v for k, v in found.tensors.items() if k.startswith(prefix)}
    same_world = meta["world_size"] == info.size
    if same_world:
        mine = f"rng.rank{info.rank}."
        state.update({f"rng.{k[len(mine):]}": v for k, v in found.tensors.items() if k.startswith(mine)})
    engine.set_state(state, rng=same_world)
    changed = "" if same_world else f"; world size changed {meta['world_size']} -> {info.size}"
    reporter.notice(f"resumed from {found.path} (epoch {meta['epoch']}, step {meta['step']}){changed}")
    reporter.truncate_metrics(meta["epoch"])
    return meta["epoch"], meta["step"]
