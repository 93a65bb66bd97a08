"""TensorFlowBackend: TF 2 / Keras 3 under horovod.tensorflow, compiled (tf.function) steps.

Horovod's TF helpers expect tf.Variables; Keras 3 variables wrap one in `.value`, so
everything handed to Horovod is `[v.value for v in ...]`. Gradients are accumulated
locally and reduced once per optimizer step with one grouped (fused) allreduce.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvtrain.backend import Backend
from hvtrain.collectives import HorovodCollectives, load_entrypoint  # noqa: E402
from hvtrain.config import Config  # noqa: E402
from hvtrain.dist import (  # noqa: E402
    ProcessInfo,
    default_threads,
    elastic_launch,
    local_size_from_env,
)
from hvtrain.placement.plan import PipelinePlan, Stage  # noqa: E402
from hvtrain.spec import ModelSpec, check_weights, from_layers, per_layer  # noqa: E402

from .elastic import keras_state  # noqa: E402
from .model import build_model, keras_to_neutral, neutral_to_keras  # noqa: E402
from .ops import LOSSES, eval_sums, is_rng, load_training_state, make_optimizer, training_state  # noqa: E402
from .stage import TensorFlowStage  # noqa: E402

_POLICY = {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


class TensorFlowBackend(HorovodCollectives, Backend):
    name = "tensorflow"

    def __init__(self) -> None:
        import horovod.tensorflow as hvd

        self.hvd = hvd
        self.model: keras.Model | None = None
        self.spec: ModelSpec | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def init(self, cfg: Config, comm: Any = None, groups: list[list[int]] | None = None) -> ProcessInfo:
        threads = cfg.train.threads or default_threads(local_size_from_env())
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(max(1, min(2, threads)))
        return self._init_horovod(cfg, comm, groups)

    def build(self, cfg: Config, spec: ModelSpec | None, weights: dict[str, np.ndarray] | None,
              num_outputs: int) -> None:
        hvd = self.hvd
        self.cfg, self.spec = cfg, spec
        keras.utils.set_random_seed(cfg.seed * 7919 + self.info.rank)  # dropout masks differ per rank
        policy = _POLICY.get(cfg.train.precision)
        self.model = load_entrypoint(cfg, keras.Model, "keras.Model") if spec is None else build_model(spec, policy)
        if weights is not None:
            self.set_weights(weights)
        self.optimizer = make_optimizer(cfg)
        if cfg.train.precision == "fp16":
            self.optimizer = keras.optimizers.LossScaleOptimizer(self.optimizer)
        self.train_vars = self.model.trainable_variables
        self.optimizer.build(self.train_vars)
        if self.info.size > 1 and not elastic_launch():  # elastic: the state's sync() broadcasts
            # RNG (seed generator) states stay per rank, everything else comes from rank 0
            hvd.broadcast_variables([v.value for v in self.model.variables if not is_rng(v)], root_rank=0)
            hvd.broadcast_variables([v.value for v in self.optimizer.variables], root_rank=0)
        self.accum = [tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False) for v in self.train_vars]
        self.loss_acc = tf.Variable(0.0, dtype=tf.float64, trainable=False)
        self.loss_fn = LOSSES[cfg.loss]
        self.skip_nan = cfg.train.on_nan == "skip"
        self.l2 = cfg.optimizer.weight_decay if cfg.optimizer.name != "adamw" else 0.0
        self.compression = hvd.Compression.fp16 if cfg.train.compression == "fp16" else hvd.Compression.none
        self._compile()

    def shutdown(self) -> None:
        self.hvd.shutdown()

    def local_gpus(self) -> int:
        return len(tf.config.list_physical_devices("GPU"))

    def build_stage(self, cfg: Config, spec: ModelSpec, stage: Stage, plan: PipelinePlan,
                    weights: dict[str, np.ndarray]) -> TensorFlowStage:
        ps = self.process_sets[stage.index] if plan.replicas > 1 else None
        return TensorFlowStage(self.hvd, cfg, spec, stage, plan.replicas, weights, ps)

    # -- compiled steps ----------------------------------------------------------------------
    def _compile(self) -> None:
        x_sig = tf.TensorSpec((None,) + self._input_shape(), tf.int64 if self._integer_input() else tf.float32)
        y_dtype = tf.float32 if self.cfg.loss in ("mse", "mae") else tf.int64
        y_sig = tf.TensorSpec(None, y_dtype)
        w_sig = tf.TensorSpec((None,), tf.float32)
        size = float(self.info.size)
        scaled = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)

        def local_grads(x, y, w):
            with tf.GradientTape() as tape:
                out = tf.cast(self.model(x, training=True), tf.float32)
                loss = tf.reduce_sum(self.loss_fn(out, y) * w)
                total = loss * size  # Horovod averages; see hvtrain.data.Batch
                if scaled:
                    total = self.optimizer.scale_loss(total)
            grads = tape.gradient(total, [v.value for v in self.train_vars])
            finite = tf.math.is_finite(loss)
            self.loss_acc.assign_add(tf.where(finite, tf.cast(loss, tf.float64), tf.constant(0.0, tf.float64)))
            return grads, loss

        @tf.function(input_signature=[x_sig, y_sig, w_sig], reduce_retracing=True)
        def accumulate(x, y, w):
            grads, loss = local_grads(x, y, w)
            for acc, g in zip(self.accum, grads, strict=True):
                acc.assign_add(g)
            return loss

        @tf.function(input_signature=[x_sig, y_sig, w_sig], reduce_retracing=True)
        def apply(x, y, w):
            local, loss = local_grads(x, y, w)
            grads = [acc + g for acc, g in zip(self.accum, local, strict=True)]
            if self.info.size > 1:
                grads = self.hvd.grouped_allreduce(grads, op=self.hvd.Average, compression=self.compression,
                                                   name="hvtrain.grads")
            if self.l2:
                grads = [g + self.l2 * v.value for g, v in zip(grads, self.train_vars, strict=True)]
            if self.skip_nan:  # decided on averaged gradients: the same on every rank
                finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])

                def update():
                    self.optimizer.apply(grads, self.train_vars)
                    return tf.constant(True)

                tf.cond(finite, update, lambda: tf.constant(False))
            else:
                self.optimizer.apply(grads, self.train_vars)
            for acc in self.accum:
                acc.assign(tf.zeros_like(acc))
            return loss

        @tf.function(input_signature=[x_sig], reduce_retracing=True)
        def forward(x):
            return tf.cast(self.model(x, training=False), tf.float32)

        self._accumulate, self._apply, self._forward = accumulate, apply, forward

    def _input_shape(self) -> tuple:
        if self.spec is not None:
            return tuple(self.spec.input_shape)
        if self.cfg.model.input_shape:
            return tuple(self.cfg.model.input_shape)
        return tuple(self.model.inputs[0].shape[1:])

    def _integer_input(self) -> bool:
        if self.spec is not None:
            return self.spec.integer_input
        return self.model.inputs is not None and "int" in str(self.model.inputs[0].dtype)

    def set_lr(self, lr: float) -> None:
        self.optimizer.learning_rate.assign(lr)

    def train_step(self, x: np.ndarray, y: np.ndarray, weights: np.ndarray, apply: bool) -> bool:
        loss = (self._apply if apply else self._accumulate)(x, y, weights)
        return bool(np.isfinite(loss.numpy()))

    def loss_sum(self, reset: bool = False) -> float:
        value = float(self.loss_acc.numpy())
        if reset:
            self.loss_acc.assign(0.0)
        return value

    def eval_batch(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return eval_sums(self.cfg.loss, self._forward(x).numpy(), y)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self._forward(x).numpy()

    def allreduce_sum(self, values: np.ndarray) -> np.ndarray:
        if self.info.size == 1:
            return values
        t = tf.constant(np.ascontiguousarray(values, np.float64))
        return self.hvd.allreduce(t, op=self.hvd.Sum, name="hvtrain.allreduce_sum").numpy()

    def elastic_state(self, counters: dict[str, Any]) -> Any:
        return keras_state(self.hvd, lambda: [v for v in self.model.variables if not is_rng(v)]
                           + list(self.optimizer.variables), **counters)

    def elastic_run(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        from horovod.common.exceptions import HorovodInternalError

        def guarded(state: Any) -> Any:
            # horovod.tensorflow.elastic.run recognises a failed collective only by op names in the
            # message (not GroupedAllreduce, nor a bare gloo "connection closed") and otherwise
            # returns None. Collective failures surface as Unknown/Internal/Aborted op errors:
            # hand them to Horovod as HorovodInternalError so it restores and resets.
            try:
                return fn(state)
            except (tf.errors.UnknownError, tf.errors.InternalError, tf.errors.AbortedError) as exc:
                raise HorovodInternalError(exc) from exc

        return self.hvd.elastic.run(guarded)

    def refresh(self) -> ProcessInfo:
        self.info = self._read_info("gloo")  # elastic runs use the Gloo controller
        self._compile()  # the world size is baked into the compiled steps
        return self.info

    # -- state and weights -------------------------------------------------------------------
    def get_state(self) -> dict[str, np.ndarray]:
        return training_state(self.model, self.optimizer)

    def set_state(self, state: dict[str, np.ndarray], rng: bool = True) -> None:
        load_training_state(state, self.model, self.optimizer, rng)

    # -- weights ---------------------------------------------------------------------------
    def get_weights(self) -> dict[str, np.ndarray]:
        if self.spec is None:
            return {v.path: np.array(v.numpy()) for v in self.model.variables}
        return from_layers(self.spec, [keras_to_neutral(layer, kl)
                                       for layer, kl in zip(self.spec.layers, self.model.layers, strict=True)])

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        if self.spec is None:
            by_path = {v.path: v for v in self.model.variables}
            for name, value in weights.items():
                by_path[name].assign(value)
            return
        check_weights(self.spec, weights, "weights")
        for layer, kl, w in zip(self.spec.layers, self.model.layers, per_layer(self.spec, weights), strict=True):
            neutral_to_keras(layer, kl, w)


# ----------------------------------------------------------------------------- helpers
