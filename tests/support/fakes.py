"""A framework-free world for the real training loop: N simulated ranks in one process.

`World(n).run(...)` runs hvtrain.training.loop.fit on n threads, one per rank, each with the real
Reporter, CheckpointManager, MetricSet, Prefetcher and the loop's own resume/pre-emption/elastic
logic. What is faked is only what needs Horovod or a framework:

- `SimRuntime`: the Runtime's collectives (allreduce_sum, broadcast/allgather of objects, byte
  gather/scatter, elastic_run) over a shared barrier: every rank contributes, every rank gets the
  result, exactly as the Horovod ones behave.
- `LinearSteps`: a StepRunner whose model is a float64 vector w trained by SGD on 0.5*||w - x||^2,
  its gradients averaged over ranks through the runtime. Its updates depend on exactly which
  samples, weights and learning rates it saw, so a run's final w says whether the loop fed it the
  right batches (np=2 with batch b equals np=1 with batch 2b; a resume equals an uninterrupted run).
  Its evaluation outputs are a fixed function of the validation rows, so metrics reduced over any
  number of ranks must equal one rank's.

Tests in milliseconds; the multi-process proofs stay in tests/parallel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hvtrain.config.load import load_config
from hvtrain.data.batches import shard_eval
from hvtrain.data.dataset import load_dataset
from hvtrain.errors import Preempted
from hvtrain.launch.process import ProcessInfo
from hvtrain.metrics.suite import MetricSet, batch_stats

TIMEOUT_S = 60.0


class Reset(Exception):
    """A simulated worker failure: the elastic driver rolls back to the last commit."""


class _Shared:
    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=TIMEOUT_S)
        self.slots: list[Any] = [None] * n
        self.lock = threading.Lock()

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's value, in rank order, on every rank (one collective)."""
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class SimRuntime:
    """hvtrain.runtime.horovod.Runtime's interface for one simulated rank."""

    def __init__(self, shared: _Shared, rank: int) -> None:
        self.shared, self.rank = shared, rank
        self.info = ProcessInfo(rank, shared.n, rank, shared.n, "mpi" if shared.n > 1 else "none")
        self.elastic = False
        self.calls: list[str] = []  # the collectives this rank took part in, by name

    @property
    def distributed(self) -> bool:
        return self.info.size > 1 or self.elastic

    def allreduce_sum(self, values: np.ndarray, name: str = "hvtrain.allreduce_sum") -> np.ndarray:
        self.calls.append(name)
        got = self.shared.exchange(self.rank, (name, np.array(values, np.float64)))  # a copy: ranks go on
        assert len({n for n, _ in got}) == 1, f"ranks met in different collectives: {[n for n, _ in got]}"
        return np.sum([v for _, v in got], axis=0)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        self.calls.append("broadcast_object")
        return self.shared.exchange(self.rank, obj)[root]

    def allgather_object(self, obj: Any) -> list[Any]:
        self.calls.append("allgather_object")
        return self.shared.exchange(self.rank, obj)

    def gather_bytes(self, blob: bytes, root: int = 0, process_set: Any = None) -> list[bytes] | None:
        self.calls.append("gather_bytes")
        got = self.shared.exchange(self.rank, blob)
        return got if self.rank == root else None

    def scatter_bytes(self, blobs: list[bytes] | None, root: int = 0) -> bytes:
        self.calls.append("scatter_bytes")
        return self.shared.exchange(self.rank, blobs)[root][self.rank]

    def refresh(self) -> ProcessInfo:
        return self.info

    def abort(self, code: int) -> None:
        self.shared.barrier.abort()
        raise SystemExit(code)

    def elastic_run(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """hvd.elastic.run's contract: on a reset, restore the last commit and call again."""

        def wrapped(state: Any) -> Any:
            while True:
                try:
                    return fn(state)
                except Reset:
                    state.restore()

        return wrapped


class SimState:
    """hvd.elastic.ObjectState's contract for LinearSteps: commit saves, restore rolls back."""

    def __init__(self, steps: LinearSteps, counters: dict[str, Any]) -> None:
        self._steps, self._counters = steps, dict(counters)
        self.__dict__.update(counters)
        self.commits = 0
        self.commit()
        self.commits = 0

    def commit(self) -> None:
        self._saved = (self._steps.w.copy(), {k: getattr(self, k) for k in self._counters})
        self.commits += 1

    def restore(self) -> None:
        w, counters = self._saved
        self._steps.w = w.copy()
        self.__dict__.update(counters)


class SimBackend:
    """What hvtrain.training.elastic.Elastic asks of a backend."""

    def __init__(self, steps: LinearSteps) -> None:
        self.steps = steps

    def elastic_state(self, counters: dict[str, Any]) -> SimState:
        return SimState(self.steps, counters)

    def on_world_change(self) -> None:
        pass


@dataclass
class LinearSteps:
    """A StepRunner (hvtrain.backends.steps) over the simulated runtime: see the module docstring."""

    runtime: SimRuntime
    metrics: MetricSet
    features: int
    loss: str
    nan_at: dict[int, Any] = field(default_factory=dict)  # rank -> optimizer step(s) (an int or a range) whose loss is non-finite
    reset_at: int | None = None  # raise Reset once, before this optimizer step (elastic)
    signal_at: dict[int, int] = field(default_factory=dict)  # rank -> step after which it is signalled

    def __post_init__(self) -> None:
        info = self.runtime.info
        self.replica, self.replicas = info.rank, info.size
        self.shard, self.owns_shard, self.needs_x, self.needs_y = "model", info.is_main, True, True
        self.w = np.zeros(self.features, np.float64)
        self.acc = np.zeros(self.features, np.float64)
        self.lr, self.loss_total, self.lrs, self.steps_taken, self.seen = 0.0, 0.0, [], 0, []
        self.signals = None  # the run's StopSignals, to simulate a notice at `signal_at`

    def describe(self) -> str:
        return f"simulated data parallel x {self.replicas}"

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def train_batch(self, batch, x, y) -> bool:
        if self.reset_at is not None and self.steps_taken + 1 == self.reset_at:
            self.reset_at = None
            raise Reset()
        x = np.asarray(x, np.float64).reshape(len(x), -1)[:, :self.features]
        wt = np.asarray(batch.weights, np.float64)[:, None]
        self.seen.extend(int(i) for i in batch.indices[batch.weights > 0])
        self.acc += np.sum(wt * (self.w - x), axis=0)
        self.loss_total += float(np.sum(wt[:, 0] * 0.5 * np.sum((self.w - x) ** 2, axis=1)))
        bad = self.nan_at.get(self.replica)
        finite = not (bad == self.steps_taken + 1 or isinstance(bad, range) and self.steps_taken + 1 in bad)
        if batch.apply:
            self.lrs.append(self.lr)
            grad = self.runtime.allreduce_sum(self.acc, name="sim.grads")  # sum of 1/total-weighted shares
            self.w -= self.lr * grad
            self.acc[:] = 0.0
            self.steps_taken += 1
            if self.signals is not None and self.signal_at.get(self.replica) == self.steps_taken:
                self.signals.received = "SIGTERM"
        return finite

    def loss_sum(self, reset: bool = False) -> float:
        value = self.loss_total
        if reset:
            self.loss_total = 0.0
        return value

    def outputs(self, x: np.ndarray) -> np.ndarray:
        """Fixed scores of validation rows (not of w): metrics over any world size must agree."""
        x = np.asarray(x, np.float64).reshape(len(x), -1)
        k = self.metrics.classes if self.loss == "cross_entropy" else 1
        return x[:, :k] * np.arange(1, k + 1) if x.shape[1] >= k else np.tile(x[:, :1], (1, k))

    def eval_sums(self, split) -> np.ndarray:
        self.metrics.begin()
        idx = shard_eval(len(split), self.replica, self.replicas)
        x, y = split.take(idx)
        out = self.outputs(x)
        loss_sum = float(np.sum(0.5 * np.sum((np.asarray(x, np.float64).reshape(len(x), -1)[:, :self.features]
                                               - self.w) ** 2, axis=1)))
        sums = batch_stats(self.loss, loss_sum, out.astype(np.float32), y, self.metrics, idx)
        return np.concatenate([sums, [len(idx)]])

    def get_state(self) -> dict[str, np.ndarray]:
        return {"w": self.w.copy(), f"rng.rank{self.replica}": np.array([self.replica])}

    def set_state(self, state: dict[str, np.ndarray], rng: bool) -> None:
        self.w = np.asarray(state["w"], np.float64).copy()

    def weights(self) -> dict[str, np.ndarray]:
        return {"layers.0.kernel": self.w.astype(np.float32)}

    def trainable_names(self) -> set[str]:
        return {"layers.0.kernel"}

    def discard_gradients(self) -> None:
        self.acc[:] = 0.0

    def optimizer_state_bytes(self) -> int | None:
        return None  # plain SGD: no state

    def release_training_state(self) -> None:
        pass

    def refresh(self) -> None:
        info = self.runtime.info
        self.replica, self.replicas, self.owns_shard = info.rank, info.size, info.is_main

    def summary(self) -> dict:
        return {}


BASE = {"name": "loop", "seed": 3, "loss": "cross_entropy",
        "data": {"dataset": "synthetic:classification", "samples": 500, "features": 4, "classes": 3,
                 "batch_size": 10, "prefetch": 0},
        "model": {"input_shape": [4], "layers": [{"type": "dense", "units": 3}]},
        "optimizer": {"name": "sgd", "lr": 0.1}, "metrics": ["accuracy", "confusion_matrix", "f1"],
        "train": {"epochs": 2}}


@dataclass
class Outcome:
    """Every simulated rank's return value (or exception), runner and runtime."""

    results: list[Any]
    errors: list[BaseException | None]
    steps: list[LinearSteps]
    runtimes: list[SimRuntime]

    @property
    def summary(self) -> dict[str, Any]:
        assert not any(self.errors), self.errors
        return self.results[0]


class World:
    """`n` simulated ranks running the real loop over one output directory."""

    def __init__(self, n: int) -> None:
        self.n = n

    def run(self, out: Path, *overrides: str, resume: str | None = None, elastic: bool = False,
            signals: bool = False, notice_before: bool = False, config: dict | None = None,
            **faults: Any) -> Outcome:
        """The loop on every rank; `signals`: a StopSignals the runner can set (`signal_at`),
        `notice_before`: rank 0's notice already recorded when training starts; `faults`:
        LinearSteps' nan_at / reset_at / signal_at."""
        from hvtrain.io.reporter import Reporter
        from hvtrain.training.checkpoint import CheckpointManager
        from hvtrain.training.elastic import Elastic
        from hvtrain.training.loop import fit
        from hvtrain.training.preempt import StopSignals
        from hvtrain.training.run import Run

        cfg = load_config({**(config or BASE), "output_dir": str(out)}, list(overrides))
        data = load_dataset(cfg)
        shared = _Shared(self.n)
        results: list[Any] = [None] * self.n
        errors: list[BaseException | None] = [None] * self.n
        runners: list[LinearSteps] = [None] * self.n  # type: ignore[list-item]
        runtimes = [SimRuntime(shared, r) for r in range(self.n)]

        def rank(r: int) -> None:
            rt = runtimes[r]
            metrics = MetricSet.of(cfg, data)
            reporter = Reporter(rt.info, out, quiet=True, keep_metrics=resume is not None or elastic)
            steps = LinearSteps(rt, metrics, cfg.data.features or 4, cfg.loss, **faults)
            runners[r] = steps
            run = Run(cfg, None, data, steps, rt, reporter, CheckpointManager(cfg, rt, reporter, None, None), metrics)
            if signals or notice_before:
                run.signals = StopSignals(enabled=True)  # not installed: the runner sets `received`
                run.signals.received = "SIGTERM" if notice_before and r == 0 else None
                steps.signals = run.signals
            try:
                results[r] = fit(run, resume, Elastic(SimBackend(steps)) if elastic else None)
            except BaseException as exc:  # noqa: BLE001 - each rank's outcome is reported to the test
                errors[r] = exc
                # a failing rank ends the job (Session's failure path: MPI_Abort); a pre-empted one
                # stops with the others at the same step
                if not isinstance(exc, (threading.BrokenBarrierError, Preempted)):
                    shared.barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S * 2)
        assert not any(t.is_alive() for t in threads), "a simulated rank hung"
        return Outcome(results, errors, runners, runtimes)
