"""One rank of the real training loop with faked collaborators (no Horovod, no framework):
`FakeRuntime` has the Runtime's collectives for a world whose other ranks agree with rank 0,
`FakeSteps` is a StepRunner whose model is its update count (its validation loss says which
weights made it), `fit_loop` runs hvtrain.training.loop.fit on `LOOP` into a directory.
For N ranks that really exchange values, use tests.support.fakes.World."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hvtrain.config.load import load_config
from hvtrain.data.dataset import load_dataset


class FakeRuntime:
    """Rank 0's view of a world of `size` ranks whose other ranks agree with it: the collectives
    hvtrain.runtime.horovod.Runtime has, without Horovod (the loop and the checkpoint manager are real)."""

    def __init__(self, size: int = 1) -> None:
        from hvtrain.launch.process import ProcessInfo

        self.info, self.elastic = ProcessInfo(0, size), False

    def allreduce_sum(self, values, name: str = "") -> np.ndarray:
        return np.ascontiguousarray(values, np.float64)

    def broadcast_object(self, obj, root: int = 0):
        return obj

    def allgather_object(self, obj) -> list:
        return [obj] * self.info.size

    def gather_bytes(self, blob: bytes, root: int = 0, process_set: Any = None) -> list[bytes]:
        return [blob] + [b""] * (self.info.size - 1)

    def scatter_bytes(self, blobs: list[bytes], root: int = 0) -> bytes:
        return blobs[0]


class FakeSteps:
    """A StepRunner whose model is its update count: it records the lr of every micro-batch, and
    its validation loss is the number of updates taken (so results say which weights made them)."""

    def __init__(self, metrics, replicas: int = 1) -> None:
        self.metrics, self.replica, self.replicas = metrics, 0, replicas
        self.shard, self.owns_shard, self.needs_x, self.needs_y = "model", True, True, True
        self.updates, self.lr, self.lrs, self.loss = 0.0, None, [], 0.0

    def describe(self) -> str:
        return f"fake x {self.replicas}"

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def train_batch(self, batch, x, y) -> bool:
        self.lrs.append(self.lr)
        self.loss += float(batch.weights.sum())
        self.updates += batch.apply
        return True

    def loss_sum(self, reset: bool = False) -> float:
        value = self.loss
        if reset:
            self.loss = 0.0
        return value

    def eval_sums(self, split) -> np.ndarray:
        self.metrics.begin()
        n = len(split)
        sums = np.zeros(self.metrics.size, np.float64)
        sums[0], sums[1], sums[-1] = self.updates * n, n / 2, n  # loss sum, correct, count
        return sums

    def get_state(self) -> dict[str, np.ndarray]:
        return {"updates": np.array([self.updates])}

    def set_state(self, state, rng: bool) -> None:
        self.updates = float(state["updates"][0])

    def weights(self) -> dict[str, np.ndarray]:
        return {"layers.0.kernel": np.array([self.updates], np.float32)}

    def trainable_names(self) -> set[str]:
        return {"layers.0.kernel"}

    def summary(self) -> dict:
        return {}

    def optimizer_state_bytes(self) -> int | None:
        return None

    def release_training_state(self) -> None:
        pass


LOOP = {"name": "loop", "seed": 3, "data": {"dataset": "synthetic:classification", "samples": 500, "features": 4,
                                            "batch_size": 10},
        "model": {"input_shape": [4], "layers": [{"type": "dense", "units": 2}]},
        "optimizer": {"name": "sgd", "lr": 0.1, "warmup_epochs": 1.0}, "metrics": ["accuracy"],
        "train": {"epochs": 2, "checkpoint_every": 1}}


def fit_loop(out: Path, *overrides: str, size: int = 1, resume: str | None = None, data: Any = None,
             model: Any = None) -> tuple[dict, FakeSteps]:
    """hvtrain.training.loop.fit on LOOP (or its overrides) with the fakes above, writing into `out`;
    `data` and `model` as the Python API's data= and model= (replacing LOOP's dataset and layers)."""
    from hvtrain.io.reporter import Reporter
    from hvtrain.metrics.suite import MetricSet
    from hvtrain.training.checkpoint import CheckpointManager
    from hvtrain.training.loop import fit
    from hvtrain.training.run import Run

    mapping: dict[str, Any] = {**LOOP, "output_dir": str(out)}
    if data is not None:
        mapping["data"] = {"batch_size": LOOP["data"]["batch_size"]}
    if model is not None:
        mapping.pop("model")
    cfg = load_config(mapping, list(overrides), model=model, data=data)
    data = load_dataset(cfg)
    rt, metrics = FakeRuntime(size), MetricSet.of(cfg, data)
    reporter = Reporter(rt.info, out, quiet=True, keep_metrics=resume is not None)
    steps = FakeSteps(metrics, replicas=size)
    run = Run(cfg, None, data, steps, rt, reporter, CheckpointManager(cfg, rt, reporter, None, None), metrics)
    run.manifest = lambda: reporter.write_json("manifest.json", {"written_by_run_of": cfg.train.epochs})
    return fit(run, resume), steps
