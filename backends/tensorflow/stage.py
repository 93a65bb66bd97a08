"""TensorFlowStage: one pipeline stage (a slice of the neutral layers) on this rank.

Each live micro-batch keeps its own GradientTape (eager): backward(key) asks that tape for
the gradients of the stage's variables and of its input, given the output's gradient."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from hvtrain.config import Config
from hvtrain.placement.stage import StageEngine
from hvtrain.runtime import grouped_allreduce
from hvtrain.spec import INPUT, ModelSpec, per_layer

from .model import build_model, layer_from_native, layer_to_native, native_layers
from .ops import LOSSES, eval_sums, load_training_state, make_optimizer, training_state

POLICY = {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


class TensorFlowStage(StageEngine):
    def __init__(self, hvd: Any, cfg: Config, spec: ModelSpec, layers: list[int], sources: tuple[int, ...],
                 outputs: tuple[int, ...], device: str, replicas: int, weights: dict[str, np.ndarray],
                 process_set: Any) -> None:
        self.hvd, self.cfg, self.replicas, self.process_set = hvd, cfg, replicas, process_set
        self.layers = [spec.layers[i] for i in layers]
        self.device = "/CPU:0" if device == "cpu" else f"/GPU:{device.split(':')[1]}"
        with tf.device(self.device):
            self.model = build_model(spec, POLICY.get(cfg.train.precision), sources, outputs, self.layers)
            self.natives = native_layers(self.model, self.layers)
            grouped = per_layer(spec, weights)
            for layer, native in zip(self.layers, self.natives, strict=True):
                layer_to_native(layer, native, grouped[layer.index])
            self.optimizer = make_optimizer(cfg, self.model)
            self.vars = self.model.trainable_variables
            self.accum = [tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False) for v in self.vars]
        self.loss_fn = LOSSES[cfg.loss]
        self.l2 = cfg.optimizer.weight_decay if cfg.optimizer.name != "adamw" else 0.0
        self.first = sources == (INPUT,) and self.layers[0].index == 0
        self.graphs: dict[int, tuple] = {}
        self.grads: list[tf.Tensor] | None = None
        self.loss_acc = 0.0

    def _run(self, key: int, xs: list[np.ndarray], padding: bool, finish=None) -> list[tf.Tensor]:
        inps = [tf.constant(x) for x in xs]
        with tf.device(self.device), tf.GradientTape() as tape:
            if not self.first:
                for t in inps:
                    if t.dtype.is_floating:
                        tape.watch(t)
            out = self.model(inps[0] if len(inps) == 1 else inps, training=not padding)
            outs = [tf.cast(o, tf.float32) for o in (out if isinstance(out, (list, tuple)) else [out])]
            targets = [finish(outs[0])] if finish else outs
        self.graphs[key] = (tape, inps, targets)
        return outs

    def forward(self, key: int, xs: list[np.ndarray], padding: bool = False) -> list[np.ndarray]:
        return [o.numpy() for o in self._run(key, xs, padding)]

    def forward_loss(self, key: int, xs: list[np.ndarray], y: np.ndarray, sample_weight: np.ndarray,
                     scale: float = 1.0) -> float:
        losses = []

        def finish(out):
            loss = tf.reduce_sum(self.loss_fn(out, tf.constant(y)) * tf.constant(sample_weight))
            losses.append(loss)
            return loss * (self.replicas * scale)  # Horovod averages over the replicas

        self._run(key, xs, not sample_weight.any(), finish)
        value = float(losses[0])
        if np.isfinite(value):
            self.loss_acc += value
        return value

    def backward(self, key: int, grads: list[np.ndarray] | None) -> list[np.ndarray] | None:
        tape, inps, targets = self.graphs.pop(key)
        sources = [v.value for v in self.vars] + ([] if self.first else inps)
        out_grads = None if grads is None else [tf.constant(g) for g in grads]
        got = tape.gradient(targets, sources, output_gradients=out_grads)
        for acc, g in zip(self.accum, got[: len(self.vars)], strict=True):
            if g is not None:
                acc.assign_add(tf.cast(g, tf.float32))
        if self.first:
            return None
        return [np.zeros(t.shape, np.float32) if g is None else tf.cast(g, tf.float32).numpy()
                for t, g in zip(inps, got[len(self.vars):], strict=True)]

    def reduce_gradients(self, inv_scale: float = 1.0) -> bool:
        grads = [tf.convert_to_tensor(a) for a in self.accum]
        if self.process_set is not None:
            hvd = self.hvd
            compression = hvd.Compression.fp16 if self.cfg.train.compression == "fp16" else hvd.Compression.none
            grads = grouped_allreduce(hvd, grads, self.cfg.horovod.num_groups, "hvtrain.stage_grads", op=hvd.Average,
                                      compression=compression, process_set=self.process_set)
        if inv_scale != 1.0:
            grads = [g * inv_scale for g in grads]
        if self.l2:  # L2 on the unscaled gradient, as in the unpipelined step
            grads = [g + self.l2 * v.value for g, v in zip(grads, self.vars, strict=True)]
        self.grads = grads
        return bool(all(tf.reduce_all(tf.math.is_finite(g)) for g in grads))

    def apply_update(self, update: bool = True) -> None:
        if update:
            self.optimizer.apply(self.grads, self.vars)
        self.discard_gradients()

    def discard_gradients(self) -> None:
        self.graphs.clear()
        self.grads = None
        for acc in self.accum:
            acc.assign(tf.zeros_like(acc))

    def set_lr(self, lr: float) -> None:
        self.optimizer.learning_rate.assign(lr)

    def predict(self, xs: list[np.ndarray]) -> list[np.ndarray]:
        inps = [tf.constant(x) for x in xs]
        with tf.device(self.device):
            out = self.model(inps[0] if len(inps) == 1 else inps, training=False)
        return [tf.cast(o, tf.float32).numpy() for o in (out if isinstance(out, (list, tuple)) else [out])]

    def eval_sums(self, xs: list[np.ndarray], y: np.ndarray) -> np.ndarray:
        return eval_sums(self.cfg.loss, self.predict(xs)[0], y)

    def loss_sum(self, reset: bool = False) -> float:
        value = self.loss_acc
        if reset:
            self.loss_acc = 0.0
        return value

    def get_weights(self) -> dict[str, np.ndarray]:
        return {f"layers.{layer.index}.{param}": v for layer, native in zip(self.layers, self.natives, strict=True)
                for param, v in layer_from_native(layer, native).items()}

    def get_state(self) -> dict[str, np.ndarray]:
        return training_state(self.model, self.optimizer)

    def set_state(self, state: dict[str, np.ndarray], rng: bool = True) -> None:
        load_training_state(state, self.model, self.optimizer, rng=rng)

    def param_count(self) -> int:
        return int(sum(np.prod(v.shape) for v in self.vars))

    def peak_activation_bytes(self) -> int | None:
        return None  # TF's tapes do not expose the tensors they keep for backward
