"""The neutral training loop: epochs, LR schedule, sharding, metrics, outputs.

It talks to the framework only through the Backend interface. Per step it slices numpy
arrays and calls `train_step`; loss stays on the device until the epoch ends (or a
progress-bar refresh every `train.log_every` steps on the main rank).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvtrain import __version__
from hvtrain.backend import Backend
from hvtrain.config import Config
from hvtrain.data import Dataset, epoch_permutation, shard_batches, shard_eval, steps_per_epoch
from hvtrain.dist import ProcessInfo
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
        reporter: Reporter, initial_weights: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Train for `cfg.train.epochs`; write metrics.jsonl, summary.json and final.safetensors."""
    t0 = time.perf_counter()
    if initial_weights is None and spec is not None:
        initial_weights = spec.init_weights(cfg.seed)
    backend.build(cfg, spec, initial_weights, data.num_outputs)

    b, acc = cfg.data.batch_size, cfg.train.grad_accumulation
    n_steps = steps_per_epoch(len(data.x_train), b, info.size, acc)
    schedule = LRSchedule(cfg, info.size, n_steps)
    reporter.print(f"hvtrain {__version__}: {cfg.name} on {cfg.backend}, {info.size} rank(s) "
                   f"[{info.controller}], {len(data.x_train)} train / {len(data.x_val)} val samples, "
                   f"global batch {b * info.size * acc}, {n_steps} steps/epoch"
                   + (f", {spec.param_count:,} parameters" if spec else ""))
    current_lr = None
    step = 0
    result = None
    for epoch in range(cfg.train.epochs):
        started = time.perf_counter()
        order = epoch_permutation(len(data.x_train), cfg.seed, epoch, cfg.data.shuffle)
        backend.loss_sum(reset=True)
        bar = reporter.progress(n_steps, f"epoch {epoch + 1}/{cfg.train.epochs}")
        for batch in shard_batches(order, b, info.rank, info.size, acc):
            lr = schedule(step)
            if lr != current_lr:
                backend.set_lr(lr)
                current_lr = lr
            idx = batch.indices
            backend.train_step(data.x_train[idx], data.y_train[idx], batch.weights, batch.apply)
            if batch.apply:
                step += 1
                bar.update()
                if reporter.enabled and step % cfg.train.log_every == 0:
                    done = step - epoch * n_steps
                    rate = done * b * acc * info.size / (time.perf_counter() - started)
                    bar.set_postfix_str(f"loss~{backend.loss_sum() * info.size / done:.4f} {rate:,.0f} samples/s")
        bar.close()
        train_seconds = time.perf_counter() - started
        val = evaluate(cfg, data, backend, info, extra=[backend.loss_sum()])
        train_loss = val.pop("extra0") / n_steps
        result = EpochResult(epoch + 1, train_loss, val, len(data.x_train) / train_seconds,
                             time.perf_counter() - started)
        record = {"epoch": result.epoch, "train_loss": result.train_loss,
                  **{f"val_{k}": v for k, v in val.items()},
                  "samples_per_sec": result.samples_per_sec, "lr": current_lr, "world_size": info.size}
        reporter.append_metrics(record)
        reporter.print(epoch_line(cfg, result))

    weights = backend.get_weights()
    reporter.write_weights(WEIGHTS_FILE, weights, weight_metadata(cfg, spec))
    summary = {
        "name": cfg.name, "backend": cfg.backend, "world_size": info.size, "controller": info.controller,
        "epochs": cfg.train.epochs, "train_loss": result.train_loss if result else None,
        **({f"val_{k}": v for k, v in result.val.items()} if result else {}),
        "samples_per_sec": result.samples_per_sec if result else None,
        "total_seconds": time.perf_counter() - t0, "weights": WEIGHTS_FILE,
        "hvtrain_version": __version__,
    }
    reporter.write_json("summary.json", summary)
    reporter.print(f"done in {summary['total_seconds']:.1f}s; outputs in {reporter.out_dir}")
    return summary


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
    loss, correct, sq, ab, count = total[:5]
    out: dict[str, float] = {"loss": loss / count if count else float("nan")}
    for name in cfg.metrics:
        value = {"accuracy": correct, "mse": sq, "mae": ab}[name]
        out[name] = value / count if count else float("nan")
    out["samples"] = int(count)
    for i, v in enumerate(total[5:]):
        out[f"extra{i}"] = float(v)
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
