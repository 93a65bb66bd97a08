"""Losses (per sample), optimizers and evaluation sums, shared by the model and pipeline stages."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from hvtrain.config import Config


def _ce(out, y):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=out)


def _bce(out, y):
    return tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.cast(y, out.dtype), logits=out[:, 0])


def _mse(out, y):
    return tf.reduce_mean(tf.square(out - y), axis=1)


def _mae(out, y):
    return tf.reduce_mean(tf.abs(out - y), axis=1)


LOSSES = {"cross_entropy": _ce, "binary_cross_entropy": _bce, "mse": _mse, "mae": _mae}


def make_optimizer(cfg: Config) -> keras.optimizers.Optimizer:
    """Same semantics as the torch backend: weight_decay is L2 (added to the gradient) except
    for adamw, where it is decoupled."""
    o = cfg.optimizer
    if o.name == "sgd":
        return keras.optimizers.SGD(o.lr, momentum=o.momentum, nesterov=o.nesterov)
    if o.name == "adam":
        return keras.optimizers.Adam(o.lr, beta_1=o.betas[0], beta_2=o.betas[1], epsilon=o.eps)
    if o.name == "adamw":
        return keras.optimizers.AdamW(o.lr, weight_decay=o.weight_decay, beta_1=o.betas[0], beta_2=o.betas[1],
                                      epsilon=o.eps)
    return keras.optimizers.RMSprop(o.lr, rho=o.rho, momentum=o.momentum, epsilon=o.eps)


def eval_sums(loss: str, out: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[loss, correct, squared error, absolute error] summed over a batch of outputs."""
    total = float(np.sum(LOSSES[loss](tf.constant(out), tf.constant(y)).numpy()))
    correct = sq = ab = 0.0
    if loss == "cross_entropy":
        correct = float(np.sum(out.argmax(axis=1) == y))
    elif loss == "binary_cross_entropy":
        correct = float(np.sum((out[:, 0] > 0).astype(np.int64) == y))
    else:
        diff = out - y
        sq, ab = float(np.sum(np.mean(diff ** 2, axis=1))), float(np.sum(np.mean(np.abs(diff), axis=1)))
    return np.array([total, correct, sq, ab], np.float64)


def is_rng(variable) -> bool:
    """Keras seed-generator state: per rank, never broadcast."""
    return "seed_generator" in variable.path


def training_state(model: keras.Model, optimizer: keras.optimizers.Optimizer) -> dict[str, np.ndarray]:
    """Every model variable (seed generators under rng.*) and optimizer variable, by position."""
    state = {f"{'rng.' if is_rng(v) else ''}model.{i}": np.array(v.numpy()) for i, v in enumerate(model.variables)}
    state.update({f"optim.{i}": np.array(v.numpy()) for i, v in enumerate(optimizer.variables)})
    return state


def load_training_state(state: dict[str, np.ndarray], model: keras.Model, optimizer: keras.optimizers.Optimizer,
                        rng: bool = True) -> None:
    for i, v in enumerate(model.variables):
        if not is_rng(v):
            v.assign(state[f"model.{i}"])
        elif rng:
            v.assign(state[f"rng.model.{i}"])
    for i, v in enumerate(optimizer.variables):
        v.assign(state[f"optim.{i}"])
