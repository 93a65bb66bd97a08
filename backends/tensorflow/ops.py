"""Losses (per sample), optimizers and evaluation sums, shared by the model and pipeline stages."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hvtrain.config.schema import Config
from hvtrain.metrics.suite import MetricSet, batch_stats


def _fits(out, y, width: int | None = None) -> None:
    """Outputs [batch, width] against labels [batch] (width None: targets of the outputs' shape),
    checked on the static shapes (when traced; the backend's step signature gives the labels
    theirs). Elementwise ops would broadcast a [batch] output against [batch, 1] targets into a
    [batch, batch] loss: the batch mean is learned, silently."""
    o, t = out.shape, y.shape
    if o.rank is None or t.rank is None:
        return
    ok = o.is_compatible_with(t) if width is None else \
        (o.rank == 2 and t.rank == 1 and o[:1].is_compatible_with(t) and (width == 0 or o[1] in (None, width)))
    if not ok:
        raise ValueError(f"loss: outputs of shape {o.as_list()} do not fit labels of shape {t.as_list()}")


def _ce(out, y):
    _fits(out, y, 0)
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=out)


def _bce(out, y):
    _fits(out, y, 1)
    return tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.cast(y, out.dtype), logits=out[:, 0])


def _mse(out, y):
    _fits(out, y)
    return tf.reduce_mean(tf.square(out - y), axis=1)


def _mae(out, y):
    _fits(out, y)
    return tf.reduce_mean(tf.abs(out - y), axis=1)


LOSSES = {"cross_entropy": _ce, "binary_cross_entropy": _bce, "mse": _mse, "mae": _mae}


class _TorchAdamStep:
    """Adam's step as PyTorch (and the paper's Algorithm 1) writes it: eps is added to sqrt(v_hat).
    Keras adds it to sqrt(v) with the bias correction folded into the rate, so the same `eps`
    would mean a different, step-dependent epsilon."""

    def update_step(self, gradient, variable, learning_rate):
        ops = keras.ops
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        step = ops.cast(self.iterations + 1, variable.dtype)
        m = self._momentums[self._get_variable_index(variable)]
        v = self._velocities[self._get_variable_index(variable)]
        self.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1 - self.beta_1))
        self.assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v), 1 - self.beta_2))
        # torch's order of operations: denom = sqrt(v) / sqrt(bc2) + eps; var -= (lr / bc1) * m / denom
        bc1 = 1 - ops.power(ops.cast(self.beta_1, variable.dtype), step)
        bc2_sqrt = ops.sqrt(1 - ops.power(ops.cast(self.beta_2, variable.dtype), step))
        denom = ops.add(ops.divide(ops.sqrt(v), bc2_sqrt), self.epsilon)
        self.assign_sub(variable, ops.multiply(lr / bc1, ops.divide(m, denom)))


class Adam(_TorchAdamStep, keras.optimizers.Adam):
    pass


class AdamW(_TorchAdamStep, keras.optimizers.AdamW):
    """Decoupled decay (var -= lr * wd * var, applied by Keras before the step), then Adam's step."""


class RMSprop(keras.optimizers.RMSprop):
    """PyTorch's RMSprop: eps added to sqrt(v); momentum accumulates g / (sqrt(v) + eps) and lr
    multiplies the buffer (Keras puts eps under the root and lr inside the buffer)."""

    def update_step(self, gradient, variable, learning_rate):
        ops = keras.ops
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        v = self._velocities[self._get_variable_index(variable)]
        self.assign(v, ops.add(ops.multiply(self.rho, v), ops.multiply(1 - self.rho, ops.square(gradient))))
        step = ops.divide(gradient, ops.add(ops.sqrt(v), self.epsilon))
        if self.momentum > 0:
            buf = self._momentums[self._get_variable_index(variable)]
            self.assign(buf, ops.add(ops.multiply(self.momentum, buf), step))
            step = buf
        self.assign_sub(variable, ops.multiply(lr, step))


def make_optimizer(cfg: Config, model: keras.Model | list) -> keras.optimizers.Optimizer:
    """The optimizer for `model`'s trainable variables (or the variables themselves; built). Same
    semantics as the torch backend:
    weight_decay is L2 (added to the gradient) except for adamw, where it is decoupled; Adam and
    RMSprop take eps as PyTorch does. fp16 wraps it in Keras's dynamic loss scaling."""
    o = cfg.optimizer
    if o.name == "sgd":
        opt = keras.optimizers.SGD(o.lr, momentum=o.momentum, nesterov=o.nesterov)
    elif o.name == "adam":
        opt = Adam(o.lr, beta_1=o.betas[0], beta_2=o.betas[1], epsilon=o.eps)
    elif o.name == "adamw":
        opt = AdamW(o.lr, weight_decay=o.weight_decay, beta_1=o.betas[0], beta_2=o.betas[1], epsilon=o.eps)
    else:
        opt = RMSprop(o.lr, rho=o.rho, momentum=o.momentum, epsilon=o.eps)
    opt.build(model.trainable_variables if isinstance(model, keras.Model) else model)
    return opt


def state_bytes(optimizer: keras.optimizers.Optimizer) -> int:
    """Bytes of an optimizer's variables."""
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in optimizer.variables)


def eval_sums(loss: str, out: np.ndarray, y: np.ndarray, metrics: MetricSet | None = None,
              index: np.ndarray | None = None) -> np.ndarray:
    """A batch's evaluation statistics: the loss summed by TensorFlow (the training objective), the
    rest from the outputs by hvtrain.metrics.suite. Without `metrics` (pipeline stages, for now): the head
    [loss, correct, squared error, absolute error]."""
    total = float(np.sum(LOSSES[loss](tf.constant(out), tf.constant(y)).numpy()))
    return batch_stats(loss, total, out, y, metrics, index)


def is_rng(variable) -> bool:
    """Keras seed-generator state: per rank, never broadcast."""
    return "seed_generator" in variable.path


def training_state(model: keras.Model, optimizer: Any, scaler=None) -> dict[str, np.ndarray]:
    """Every model variable (seed generators under rng.*) and optimizer variable, by position.
    `scaler` is always None here: Keras keeps the loss scale among the optimizer's variables.
    A sharded optimizer (backends/tensorflow/shard.py) gives the whole optimizer's, gathered."""
    state = {f"{'rng.' if is_rng(v) else ''}model.{i}": np.array(v.numpy()) for i, v in enumerate(model.variables)}
    if isinstance(optimizer, keras.optimizers.Optimizer):
        state.update({f"optim.{i}": np.array(v.numpy()) for i, v in enumerate(optimizer.variables)})
    else:
        state.update(optimizer.state_arrays())
    return state


def load_training_state(state: dict[str, np.ndarray], model: keras.Model, optimizer: Any,
                        scaler=None, rng: bool = True) -> None:
    """The saved model variables in order, the seed generators apart: `model.{i}` counts every
    variable, and a catalogue dropout has a seed generator under train.randomness: per_rank and
    none under per_sample, so a checkpoint of the other mode (or from before the key) shifts the
    positions; its seed generators are restored only when the model has the same ones."""
    def ordered(prefix: str) -> list[np.ndarray]:
        found = sorted((int(k[len(prefix):]), k) for k in state if k.startswith(prefix) and k[len(prefix):].isdigit())
        return [state[k] for _, k in found]

    weights, seeds = ordered("model."), ordered("rng.model.")
    plain = [v for v in model.variables if not is_rng(v)]
    generators = [v for v in model.variables if is_rng(v)]
    if len(weights) != len(plain) or any(tuple(np.shape(a)) != tuple(v.shape)
                                         for a, v in zip(weights, plain, strict=True)):
        from hvtrain.errors import HvtrainError

        raise HvtrainError(f"the checkpoint's model state does not fit this model ({len(weights)} saved variables "
                           f"for its {len(plain)})")
    for v, value in zip(plain, weights, strict=True):
        v.assign(value)
    if rng and len(seeds) == len(generators):
        for v, value in zip(generators, seeds, strict=True):
            v.assign(value)
    if not isinstance(optimizer, keras.optimizers.Optimizer):  # sharded: this rank's pieces of it
        optimizer.load_arrays(state)
        return
    for i, v in enumerate(optimizer.variables):
        v.assign(state[f"optim.{i}"])
