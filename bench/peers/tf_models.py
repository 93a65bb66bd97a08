"""The benchmark models written directly in Keras 3 (TensorFlow backend), one thread per process,
and the synthetic data every TF peer trains on: the shapes of bench/configs/{mlp,resnet18}.yaml."""

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


SHAPES = {"mlp": (64,), "resnet18": (28, 28, 3)}


def build(name: str = "mlp") -> keras.Model:
    """mlp: 64-1024-1024-10; resnet18: CIFAR-style ResNet-18 (bench/peers/torch_models.py's, NHWC,
    Keras's functional API; a strided conv pads 1 on each side as torch's padding=1). Logits out."""
    if name == "mlp":
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024, activation="relu"),
                                 keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)])
    if name != "resnet18":
        raise ValueError(f"unknown model {name!r}; expected mlp or resnet18")
    L = keras.layers

    def conv(x, width: int, kernel: int, stride: int):
        if stride > 1 and kernel > 1:
            return L.Conv2D(width, kernel, stride, use_bias=False)(L.ZeroPadding2D(1)(x))
        return L.Conv2D(width, kernel, stride, padding="same" if kernel > 1 else "valid", use_bias=False)(x)

    inputs = keras.Input(SHAPES["resnet18"])
    x = L.ReLU()(L.BatchNormalization()(conv(inputs, 64, 3, 1)))
    cin = 64
    for i, width in enumerate((64, 128, 256, 512)):
        for b in range(2):
            stride = 2 if i > 0 and b == 0 else 1
            out = L.ReLU()(L.BatchNormalization()(conv(x, width, 3, stride)))
            out = L.BatchNormalization()(conv(out, width, 3, 1))
            short = x if stride == 1 and cin == width else L.BatchNormalization()(conv(x, width, 1, stride))
            x = L.ReLU()(L.Add()([out, short]))
            cin = width
    return keras.Model(inputs, L.Dense(10)(L.GlobalAveragePooling2D()(x)))


def data(samples: int, seed: int, name: str = "mlp") -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((samples, *SHAPES[name]), dtype=np.float32), rng.integers(0, 10, samples)


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
