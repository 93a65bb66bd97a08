"""Pipeline steps: the schedule and MPI point-to-point between stages, behind the loop's StepRunner.

Every rank of a pipeline computes the same batch plan from the seed (replica d takes data
shard d of D), splits each rank-batch into micro-batches, and runs its stage's op list.
Activations go forward and gradients backward as float32 numpy buffers: non-blocking
sends (kept alive until the step ends), blocking receives into preallocated buffers, one
tag per (micro-batch, direction), so no two stages can deadlock on each other. A boundary may
carry several tensors (a skip connection crossing the cut): they travel packed in one message.

An update is decided for the whole pipeline at once: each stage reduces its gradients over its
replicas, then one world allreduce of "not finite" flags says whether every stage steps or none
does (fp16 loss scaling backs off the same way on every rank; `train.on_nan: skip` likewise).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from mpi4py import MPI

from hvtrain.backends.base import Collectives
from hvtrain.backends.stage import StageEngine
from hvtrain.backends.steps import EVAL_BATCH, StepRunner
from hvtrain.config.schema import Config
from hvtrain.config.validate import draws_seed
from hvtrain.data.batches import Batch, shard_eval
from hvtrain.data.dataset import Split
from hvtrain.data.draws import dropout_keys
from hvtrain.metrics.suite import MetricSet
from hvtrain.model.spec import ModelSpec
from hvtrain.pipeline.plan import PipelinePlan

# Training tags are 2m and 2m+1 (m < micro_batches <= 4096); MPI guarantees tags up to 32767.
_EVAL_TAG = 20_000


class LossScale:
    """Dynamic fp16 loss scaling (the GradScaler rule): halve on a non-finite step, double after
    `interval` finite ones. Identical on every rank: it sees the same world-wide decisions."""

    def __init__(self, enabled: bool, init: float = 2.0 ** 15, interval: int = 2000) -> None:
        self.enabled, self.scale, self.interval, self.good = enabled, init if enabled else 1.0, interval, 0

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.scale, self.good = self.scale / 2, 0
        else:
            self.good += 1
            if self.good == self.interval:
                self.scale, self.good = self.scale * 2, 0

    def state(self) -> dict[str, np.ndarray]:
        return {"pipeline.loss_scale": np.array([self.scale, self.good], np.float64)}

    def load(self, state: dict[str, np.ndarray]) -> None:
        if "pipeline.loss_scale" in state:
            self.scale, self.good = float(state["pipeline.loss_scale"][0]), int(state["pipeline.loss_scale"][1])


class PipelineSteps(StepRunner):
    def __init__(self, cfg: Config, plan: PipelinePlan, spec: ModelSpec, engine: StageEngine, runtime: Collectives,
                 comm: Any, metrics: MetricSet) -> None:
        """This rank's stage of the plan; `metrics`: what eval_sums computes (on the last stage)."""
        self.cfg, self.plan, self.engine, self.runtime, self.comm = cfg, plan, engine, runtime, comm
        self.metrics = metrics
        self.spec = spec
        rank = runtime.info.rank
        self.rank = rank
        self.s = plan.stage_of(rank)
        self.replica, self.replicas = plan.replica_of(rank), plan.replicas
        self.shard, self.owns_shard = f"stage{self.s}", self.replica == 0
        stage = plan.stages[self.s]
        self.first, self.last = self.s == 0, self.s == plan.num_stages - 1
        self.needs_x, self.needs_y = self.first, self.last
        self.prev = None if self.first else rank - 1
        self.next = None if self.last else rank + 1
        self.in_shapes, self.out_shapes = stage.in_shapes, stage.out_shapes
        self.peak_in_flight = 0
        self.scaler = LossScale(cfg.train.precision == "fp16")
        # Every rank joins the flag allreduce when any rank may decide to skip.
        self.agree = self.scaler.enabled or cfg.train.on_nan == "skip"
        self._nonfinite = False  # a loss of this step's batches so far was not finite
        self.draws_seed = draws_seed(cfg)

    def describe(self) -> str:
        p = self.plan
        return (f"pipeline {p.num_stages} stages x {p.replicas} replica(s), {p.micro_batches} micro-batches "
                f"({p.schedule})")

    def _recv(self, source: int, n: int, shapes: tuple[tuple[int, ...], ...], tag: int) -> list[np.ndarray]:
        """One message per micro-batch and direction: every boundary tensor, packed per sample."""
        buf = np.empty((n, sum(math.prod(s) for s in shapes)), np.float32)
        self.comm.Recv(buf, source=source, tag=tag)
        if len(shapes) == 1:  # the usual boundary: one tensor, no copy
            return [buf.reshape((n, *shapes[0]))]
        out, at = [], 0
        for shape in shapes:
            size = math.prod(shape)
            out.append(np.ascontiguousarray(buf[:, at: at + size]).reshape((n, *shape)))
            at += size
        return out

    def _send(self, arrays: list[np.ndarray], dest: int, tag: int, sends: list | None = None) -> None:
        if len(arrays) == 1:  # not written to until the send completes: sent as it is
            buf = np.ascontiguousarray(arrays[0], np.float32)
        else:
            buf = np.ascontiguousarray(np.concatenate([a.reshape(len(a), -1) for a in arrays], axis=1), np.float32)
        if sends is None:
            self.comm.Send(buf, dest=dest, tag=tag)
        else:
            sends.append((self.comm.Isend(buf, dest=dest, tag=tag), buf))  # kept alive until the step ends

    def set_lr(self, lr: float) -> None:
        self.engine.set_lr(lr)

    def train_batch(self, batch: Batch, x: np.ndarray | None, y: np.ndarray | None) -> bool:
        from hvtrain.pipeline.schedule import stage_ops

        idx, w = batch.indices, batch.weights
        keys = None if self.draws_seed is None else dropout_keys(self.draws_seed, batch.epoch, idx)
        chunks = np.array_split(np.arange(len(idx)), min(self.plan.micro_batches, len(idx)))
        sends, live, finite = [], 0, True
        for kind, m in stage_ops(self.plan.schedule, self.plan.num_stages, self.s, len(chunks)):
            sel = chunks[m]
            if kind == "F":
                xs = [x[sel]] if self.first else self._recv(self.prev, len(sel), self.in_shapes, 2 * m)
                if self.last:
                    loss = self.engine.forward_loss(m, xs, y[sel], w[sel], self.scaler.scale,
                                                    None if keys is None else keys[sel])
                    finite = finite and bool(np.isfinite(loss))
                else:
                    self._send(self.engine.forward(m, xs, not w[sel].any(), None if keys is None else keys[sel]),
                               self.next, 2 * m, sends)
                live += 1
                self.peak_in_flight = max(self.peak_in_flight, live)
            else:
                grads = None if self.last else self._recv(self.next, len(sel), self.out_shapes, 2 * m + 1)
                g_in = self.engine.backward(m, grads)
                if not self.first:
                    self._send(g_in, self.prev, 2 * m + 1, sends)
                live -= 1
        MPI.Request.Waitall([req for req, _ in sends])
        if not finite and self.cfg.train.on_nan == "stop":
            return False  # the loop ends the job, naming this rank
        self._nonfinite = self._nonfinite or not finite  # over the step's accumulated batches
        if batch.apply:
            ok = self.engine.reduce_gradients(1.0 / self.scaler.scale, check_finite=self.agree)
            ok = ok and not self._nonfinite  # an inf loss can have finite gradients (an overflowing squared error)
            self._nonfinite = False
            if self.agree:
                ok = self.runtime.allreduce_sum(np.array([0.0 if ok else 1.0]), name="hvtrain.step_ok")[0] == 0
            self.engine.apply_update(ok)
            self.scaler.update(ok)
        return True

    def loss_sum(self, reset: bool = False) -> float:
        return self.engine.loss_sum(reset) if self.last else 0.0

    def eval_sums(self, split: Split) -> np.ndarray:
        """This replica's share of validation, pushed through the pipeline without gradients."""
        idx = shard_eval(len(split), self.replica, self.replicas)
        self.metrics.begin()
        sums = np.zeros(self.metrics.size - 1, np.float64)
        for k, start in enumerate(range(0, len(idx), EVAL_BATCH)):
            chunk = idx[start: start + EVAL_BATCH]
            if self.first:
                xs = [split.features(chunk)]
            else:
                xs = self._recv(self.prev, len(chunk), self.in_shapes, _EVAL_TAG + k)
            if self.last:
                sums += self.engine.eval_sums(xs, split.y[chunk], self.metrics, chunk)
            else:
                self._send(self.engine.predict(xs), self.next, _EVAL_TAG + k)
        # the other stages add nothing (the count too: each sample is counted once, by its last stage)
        return np.concatenate([sums, [len(idx)]]) if self.last else np.zeros(self.metrics.size, np.float64)

    def get_state(self) -> dict[str, np.ndarray]:
        return {**self.engine.get_state(), **self.scaler.state()}

    def set_state(self, state: dict[str, np.ndarray], rng: bool) -> None:
        self.scaler.load(state)
        self.engine.set_state({k: v for k, v in state.items() if not k.startswith("pipeline.")}, rng=rng)

    def weights(self) -> dict[str, np.ndarray]:
        return self.engine.get_weights()

    def trainable_names(self) -> set[str]:
        return {w.name for w in self.spec.weight_specs() if w.trainable}

    def discard_gradients(self) -> None:
        self.engine.discard_gradients()
        self._nonfinite = False

    def optimizer_state_bytes(self) -> int | None:
        return self.engine.optimizer_state_bytes()

    def summary(self) -> dict[str, Any]:
        p = self.plan
        return {"stages": p.num_stages, "replicas": p.replicas, "micro_batches": p.micro_batches,
                "schedule": p.schedule, "bubble": p.bubble, "stage_params": [st.params for st in p.stages],
                "rank": {"params": self.engine.param_count(), "peak_in_flight": self.peak_in_flight,
                         "peak_activation_bytes": self.engine.peak_activation_bytes()}}


def layout(plan: PipelinePlan) -> list[list[int]]:
    """The stage boundaries a checkpoint records: it resumes only under the same placement."""
    return [[st.first, st.last] for st in plan.stages]
