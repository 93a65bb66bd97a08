"""The benchmark MLP written directly in Keras 3 (TensorFlow backend), one thread per process,
and the synthetic data every TF peer trains on: the shapes of bench/configs/mlp.yaml."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def one_thread() -> None:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def build() -> keras.Model:
    """64-1024-1024-10, logits out."""
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024, activation="relu"),
                             keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)])


def data(samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((samples, 64), dtype=np.float32), rng.integers(0, 10, samples)


def epochs(step, x: np.ndarray, y: np.ndarray, n_epochs: int, steps: int, batch: int, size: int) -> list[float]:
    """Run `step(xb, yb)` over a fresh permutation each epoch; job-wide samples/s per epoch."""
    import time

    rng = np.random.default_rng(0)
    rates = []
    for _ in range(n_epochs):
        perm = rng.permutation(len(x))
        t0 = time.perf_counter()
        for s in range(steps):
            idx = perm[s * batch:(s + 1) * batch]
            loss = step(x[idx], y[idx])
        float(loss)
        rates.append(steps * batch * size / (time.perf_counter() - t0))
    return rates
