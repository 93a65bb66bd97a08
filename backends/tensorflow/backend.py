"""TensorFlowBackend: TF 2 / Keras 3 math under horovod.tensorflow, compiled (tf.function) steps.

Keras 3 variables go to Horovod as they are (hvtrain's Keras 3 patch of Horovod); the tape
differentiates the tf.Variables they wrap (`.value`). Gradients are accumulated locally and
reduced once per optimizer step with one grouped (fused) allreduce.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvtrain.backends.base import Backend, Collectives
from hvtrain.backends.reduce import direct_reduction, sum_arrays
from hvtrain.config.schema import Config
from hvtrain.config.validate import per_sample_randomness
from hvtrain.launch.process import ProcessInfo, default_threads
from hvtrain.metrics.suite import MetricSet
from hvtrain.model.entrypoint import load_entrypoint
from hvtrain.model.native import PLAIN, NativeInputs, OutputForm, check_reads, decide_form
from hvtrain.model.spec import ModelSpec
from hvtrain.model.weights import Inputs

from .draws import SampleDraws, keyed  # noqa: E402
from .export import export as export_model  # noqa: E402
from .export import load as load_exported  # noqa: E402
from .model import build_model, from_native, to_native  # noqa: E402
from .native import reads, returned, scores  # noqa: E402
from .ops import (  # noqa: E402
    LOSSES,
    eval_sums,
    is_rng,
    load_training_state,
    make_optimizer,
    state_bytes,
    training_state,
)
from .shard import ShardedOptimizer  # noqa: E402
from .stage import TensorFlowStage  # noqa: E402

POLICY = {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


class TensorFlowBackend(Backend):
    name = "tensorflow"

    def __init__(self) -> None:
        self.model: keras.Model | None = None
        self.spec: ModelSpec | None = None
        self.on_gpu = False

    def configure(self, cfg: Config, info: ProcessInfo, gpu: int | None) -> None:
        threads = cfg.train.threads or default_threads(info)
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(max(1, min(2, threads)))
        except RuntimeError:  # TF already ran in this process (an earlier session of the Python API):
            pass  # its thread pools cannot be resized and stay as the first session made them
        gpus = tf.config.list_physical_devices("GPU")
        self.on_gpu = gpu is not None or bool(gpus)
        try:
            if gpu is not None:  # Horovod's local-rank pinning: this rank sees one GPU
                tf.config.experimental.set_memory_growth(gpus[gpu], True)
                tf.config.set_visible_devices(gpus[gpu], "GPU")
            else:  # pipeline stages on the plan's GPUs: no rank takes every GPU's whole memory at start
                for g in gpus:
                    tf.config.experimental.set_memory_growth(g, True)
        except RuntimeError:  # the GPUs were initialised by an earlier session in this process (the API):
            pass  # they stay as that session set them
        # fp32 is fp32 on a GPU too: TensorFlow's default TF32 matmuls and convolutions (Ampere and
        # later) round inputs to 10 mantissa bits, 1e-3 from the CPU's results; bf16/fp16 are the fast paths
        tf.config.experimental.enable_tensor_float_32_execution(cfg.train.precision != "fp32")
        # dropout masks differ per rank; Keras seeds numpy's legacy generator too, which takes < 2**32
        # (a seed of 542363 or more crashed here); unchanged below that
        keras.utils.set_random_seed((cfg.seed * 7919 + info.rank) % 2**32)

    def export(self, fmt: str, path: str, inputs: Inputs) -> None:
        export_model(self.model, fmt, path, inputs, self.form)

    def load_export(self, fmt: str, path: str) -> Callable[[np.ndarray], np.ndarray]:
        return load_exported(fmt, path)

    def local_gpus(self) -> int:
        return len(tf.config.list_physical_devices("GPU"))

    def native_inputs(self) -> NativeInputs:
        return self.native

    def output_form(self) -> OutputForm:
        return self.form

    def build(self, cfg: Config, spec: ModelSpec | None, weights: dict[str, np.ndarray] | None,
              num_outputs: int, runtime: Collectives, example: np.ndarray | None = None,
              form: OutputForm | None = None) -> None:
        self.cfg, self.spec, self.runtime, self.num_outputs = cfg, spec, runtime, num_outputs
        self.form, self.native = PLAIN, NativeInputs(spec.integer_input) if spec is not None else None
        self.draws = SampleDraws() if per_sample_randomness(cfg) and spec is not None and spec.draws_random else None
        policy = POLICY.get(cfg.train.precision)
        if spec is None:  # the user's code builds the layers: under the run's dtype policy
            previous = keras.mixed_precision.dtype_policy()
            keras.mixed_precision.set_dtype_policy(policy or "float32")
            try:
                self.model = load_entrypoint(cfg, keras.Model, "keras.Model")
            finally:
                keras.mixed_precision.set_dtype_policy(previous)
            # the first call builds a model that is not built yet, before the optimizer takes its variables
            self.native = reads(cfg, self.model, example)
            check_reads(cfg, self.native, example)
            self.example_shape = tuple(example.shape[1:])
        else:
            self.model = build_model(spec, policy, draws=self.draws)
        if weights is not None:
            self.set_weights(weights)
        self.train_vars = self.model.trainable_variables
        sharded = cfg.train.shard_optimizer  # its optimizer is built on the broadcast weights (no whole state)
        self.optimizer = None if sharded else make_optimizer(cfg, self.model)
        if cfg.train.precision == "fp16":
            self.optimizer = keras.optimizers.LossScaleOptimizer(self.optimizer)
            self.optimizer.build(self.train_vars)
        if runtime.info.size > 1 and not runtime.elastic:  # elastic: the state's sync() broadcasts
            # RNG (seed generator) states stay per rank, everything else comes from rank 0
            runtime.horovod.broadcast([v for v in self.model.variables if not is_rng(v)])
            if not sharded:
                runtime.horovod.broadcast(self.optimizer.variables)
        if sharded:
            self.optimizer = ShardedOptimizer(cfg, self.train_vars, runtime)
        if spec is None:  # decided on the broadcast weights: the same on every rank
            x = example.astype(np.int64) if self.native.token_ids else example
            self.form = decide_form(cfg, returned(cfg, self.model, x), len(x), num_outputs, form,
                                    training=weights is None)
        self.accum = [tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False) for v in self.train_vars]
        self.loss_acc = tf.Variable(0.0, dtype=tf.float64, trainable=False)
        self.loss_fn = LOSSES[cfg.loss]
        self.skip_nan = cfg.train.on_nan == "skip"
        self.l2 = cfg.optimizer.weight_decay if cfg.optimizer.name != "adamw" else 0.0
        self._compile()

    def build_stage(self, cfg: Config, spec: ModelSpec, layers: list[int], sources: tuple[int, ...],
                    outputs: tuple[int, ...], device: str, weights: dict[str, np.ndarray], replicas: int,
                    runtime: Collectives, process_set: Any) -> TensorFlowStage:
        return TensorFlowStage(runtime, cfg, spec, layers, sources, outputs, device, replicas, weights,
                               process_set)

    # -- compiled steps ----------------------------------------------------------------------
    def _compile(self) -> None:
        x_sig = tf.TensorSpec((None,) + self._input_shape(), tf.int64 if self._integer_input() else tf.float32)
        regression = self.cfg.loss in ("mse", "mae")  # labels [batch], targets [batch, outputs]: never broadcast
        y_sig = tf.TensorSpec((None, self.num_outputs) if regression else (None,),
                              tf.float32 if regression else tf.int64)
        w_sig = tf.TensorSpec((None,), tf.float32)
        k_sig = tf.TensorSpec((None, 2), tf.int64)  # the samples' dropout keys (per_sample; zeros otherwise)
        horovod, size = self.runtime.horovod, float(self.runtime.info.size)
        distributed = self.runtime.info.size > 1
        # summed on the direct MPI communicator (backends/reduce.py; through tf.numpy_function: measured, a
        # 32-256-4 MLP at batch 32, np=2, +0.3 ms a step over one plain rank, +0.8 ms with Horovod's
        # in-graph allreduce)
        direct = distributed and self.runtime.direct and direct_reduction(self.cfg, bool(self.on_gpu))
        loss_factor = 1.0 if direct else size  # each rank's loss is its share of the global mean: summed as is
        scaled = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)

        def local_grads(x, y, w, k, training):
            with tf.GradientTape() as tape:
                with keyed(self.draws, k):
                    out = scores(self.form, self.model(x, training=training))
                loss = tf.reduce_sum(self.loss_fn(out, y) * w)
                total = loss * loss_factor  # Horovod averages; see hvtrain.data.batches.Batch
                if scaled:
                    total = self.optimizer.scale_loss(total)
            grads = tape.gradient(total, [v.value for v in self.train_vars])
            grads = [tf.zeros_like(v.value) if g is None else g for g, v in zip(grads, self.train_vars, strict=True)]
            # An embedding's gradient comes as IndexedSlices, one slice per token occurrence: summed
            # into a dense tensor here, else Adam/RMSprop square each occurrence's slice before the
            # sum (keras.ops.square keeps them sparse) and their second moment is wrong.
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
            finite = tf.math.is_finite(loss)
            self.loss_acc.assign_add(tf.where(finite, tf.cast(loss, tf.float64), tf.constant(0.0, tf.float64)))
            # An inf loss can have finite gradients (an overflowing squared error): NaN ones make every
            # rank skip this update alike (on_nan: skip, and the loss scale's own skip)
            if self.skip_nan or scaled:  # under on_nan: stop the loop ends the job on this step
                poison = tf.where(finite, tf.constant(1.0, tf.float32), tf.constant(float("nan"), tf.float32))
                grads = [g * tf.cast(poison, g.dtype) for g in grads]
            return grads, loss

        def accumulate(x, y, w, k, training):
            grads, loss = local_grads(x, y, w, k, training)
            for acc, g in zip(self.accum, grads, strict=True):
                acc.assign_add(g)
            return loss

        accumulating = self.cfg.train.grad_accumulation > 1  # else the accumulator stays zero: skip it

        def whole_update(grads):
            """Average over the ranks, L2, and one optimizer step on every variable (the whole state)."""
            if direct:
                grads = self._summed(grads)
            elif distributed:
                grads = horovod.average(grads, self.cfg.horovod.num_groups, "hvtrain.grads", self.cfg.train.compression)
            if self.l2:  # L2 on the gradient; loss-scaled gradients get the term scaled alike
                factor = self.l2 * (self.optimizer.dynamic_scale if scaled else 1.0)
                grads = [g + factor * v.value for g, v in zip(grads, self.train_vars, strict=True)]
            if scaled:  # the LossScaleOptimizer skips a non-finite update itself and halves its scale:
                # it must see every step, or an overflow at the initial scale is skipped for good
                self.optimizer.apply(grads, self.train_vars)
            elif self.skip_nan:  # decided on averaged gradients: the same on every rank
                finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])

                def update():
                    self.optimizer.apply(grads, self.train_vars)
                    return tf.constant(True)

                tf.cond(finite, update, lambda: tf.constant(False))
            else:
                self.optimizer.apply(grads, self.train_vars)

        def apply(x, y, w, k, training):
            local, loss = local_grads(x, y, w, k, training)
            grads = [acc + g for acc, g in zip(self.accum, local, strict=True)] if accumulating else local
            if isinstance(self.optimizer, ShardedOptimizer):  # reduce-scatter, update 1/N, allgather
                self.optimizer.apply(grads, self.l2)
            else:
                whole_update(grads)
            if accumulating:
                for acc in self.accum:
                    acc.assign(tf.zeros_like(acc))
            return loss

        @tf.function(input_signature=[x_sig], reduce_retracing=True)
        def forward(x):
            return scores(self.form, self.model(x, training=False))

        def compiled(step, training: bool):
            return tf.function(lambda x, y, w, k: step(x, y, w, k, training),
                               input_signature=[x_sig, y_sig, w_sig, k_sig], reduce_retracing=True)

        # (apply?, training?) -> step. An all-zero-weight batch (a rank's empty share of a tail batch)
        # runs in inference mode: no statistics updated, zero gradients. Separate functions, not a
        # tf.cond, keep the hot path free of a branch (traced on first use).
        self._steps = {(a, t): compiled(apply if a else accumulate, t) for a in (False, True) for t in (False, True)}
        self._forward = forward

    def _summed(self, grads: list[tf.Tensor]) -> list[tf.Tensor]:
        """Every rank's gradients summed, inside the compiled step, on the runtime's direct
        communicator, into buffers kept from step to step (TensorFlow's inputs are not ours to
        write; new arrays each step cost their page faults: measured ~4% of an MLP step)."""
        runtime = self.runtime
        shapes = [v.shape for v in self.train_vars]  # a gradient's static shape may be unknown (IndexedSlices)
        into = [np.empty(s, g.dtype.as_numpy_dtype) for s, g in zip(shapes, grads, strict=True)]

        def sum_all(*arrays: np.ndarray) -> list[np.ndarray]:
            return sum_arrays(runtime, [np.require(a, requirements="C") for a in arrays], into)  # 0-d stays 0-d

        summed = tf.numpy_function(sum_all, grads, [g.dtype for g in grads], stateful=True)
        return [tf.ensure_shape(s, shape) for s, shape in zip(summed, shapes, strict=True)]

    def _input_shape(self) -> tuple:
        if self.spec is not None:
            return tuple(self.spec.input_shape)
        return self.example_shape  # the data's, as the entrypoint model was probed on it

    def _integer_input(self) -> bool:
        return self.native.token_ids

    def set_lr(self, lr: float) -> None:
        self.optimizer.learning_rate.assign(lr)

    def train_step(self, x: np.ndarray, y: np.ndarray, sample_weight: np.ndarray, apply: bool,
                   keys: np.ndarray | None = None) -> bool:
        if keys is None:
            if self.draws is not None:
                raise ValueError("train.randomness: per_sample needs each training batch's sample keys")
            keys = np.zeros((len(x), 2), np.int64)
        loss = self._steps[(apply, bool(sample_weight.any()))](x, y, sample_weight, keys)
        return bool(np.isfinite(loss.numpy()))

    def discard_gradients(self) -> None:
        for acc in self.accum:
            acc.assign(tf.zeros_like(acc))

    def on_world_change(self) -> None:
        self._compile()  # the world size is baked into the compiled steps

    def release_training_state(self) -> None:
        pass  # Keras owns its optimizer's variables for the optimizer's life: nothing freed early here

    def optimizer_state_bytes(self) -> int:
        if isinstance(self.optimizer, ShardedOptimizer):
            return self.optimizer.state_bytes()
        return state_bytes(self.optimizer)

    def loss_sum(self, reset: bool = False) -> float:
        value = float(self.loss_acc.numpy())
        if reset:
            self.loss_acc.assign(0.0)
        return value

    def eval_batch(self, x: np.ndarray, y: np.ndarray, metrics: MetricSet, index: np.ndarray) -> np.ndarray:
        return eval_sums(self.cfg.loss, self._forward(x).numpy(), y, metrics, index)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self._forward(x).numpy()

    # -- state and weights -------------------------------------------------------------------
    def get_state(self) -> dict[str, np.ndarray]:
        return training_state(self.model, self.optimizer)

    def set_state(self, state: dict[str, np.ndarray], rng: bool = True) -> None:
        load_training_state(state, self.model, self.optimizer, rng=rng)

    def elastic_state(self, counters: dict[str, Any]) -> Any:
        model, optimizer = self.model, self.optimizer
        return self.runtime.horovod.elastic_state(
            lambda: [v for v in model.variables if not is_rng(v)] + list(optimizer.variables),
            lambda: [v for v in model.variables if is_rng(v)], counters)

    def get_weights(self) -> dict[str, np.ndarray]:
        return from_native(self.spec, self.model)

    def trainable_names(self) -> set[str]:
        if self.spec is not None:
            return {w.name for w in self.spec.weight_specs() if w.trainable}
        return {v.path for v in self.model.trainable_variables}

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        to_native(self.spec, self.model, weights)
        if isinstance(getattr(self, "optimizer", None), ShardedOptimizer):  # its pieces hold the weights too
            self.optimizer.take_weights()
