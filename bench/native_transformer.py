"""The peer for examples/digits_transformer.yaml: the same model written natively in one framework,
trained by a plain loop (no hvtrain, no Horovod), same data, batch, optimizer and threads.

    python bench/native_transformer.py torch|tensorflow EPOCHS [THREADS]   (default: every core)
Prints one JSON line: samples/s of each epoch's training steps (evaluation excluded, as in hvtrain)
and the process's peak RSS in MiB.
"""

from __future__ import annotations

import json
import os
import sys
import time

from hvtrain.config.load import load_config
from hvtrain.data.batches import epoch_permutation
from hvtrain.data.dataset import load_dataset

CONFIG = "examples/digits_transformer.yaml"
D, HEADS, KEY, HIDDEN, BLOCKS, CLASSES = 32, 4, 8, 64, 2, 10


def data():
    cfg = load_config(CONFIG)
    return cfg, load_dataset(cfg, (8, 8))


def run_torch(epochs: int, threads: int) -> list[float]:
    import torch
    from torch import nn

    torch.set_num_threads(threads)
    cfg, ds = data()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(D, eps=1e-3), nn.LayerNorm(D, eps=1e-3)
            self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))

        def forward(self, x):
            h = self.n1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.n2(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.pos = nn.Linear(8, D), nn.Parameter(torch.zeros(8, D))
            self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])
            self.norm, self.head = nn.LayerNorm(D, eps=1e-3), nn.Linear(D, CLASSES)

        def forward(self, x):
            return self.head(self.norm(self.blocks(self.proj(x) + self.pos)).mean(dim=1))

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, eps=1e-7)
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    rates = []
    for epoch in range(epochs):
        order = torch.from_numpy(epoch_permutation(len(x), cfg.seed, epoch, True))
        t0 = time.perf_counter()
        for s in range(0, len(x), cfg.data.batch_size):
            idx = order[s: s + cfg.data.batch_size]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        rates.append(len(x) / (time.perf_counter() - t0))
    return rates


def run_tensorflow(epochs: int, threads: int) -> list[float]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(max(1, min(2, threads)))
    cfg, ds = data()

    class Pos(keras.layers.Layer):
        def build(self, shape):
            self.table = self.add_weight(shape=(8, D), initializer="zeros")

        def call(self, x):
            return x + self.table

    inp = keras.Input((8, 8))
    x = Pos()(keras.layers.Dense(D)(inp))
    for _ in range(BLOCKS):
        h = keras.layers.LayerNormalization(epsilon=1e-3)(x)
        x = keras.layers.Add()([x, keras.layers.MultiHeadAttention(HEADS, KEY)(h, h)])
        h = keras.layers.LayerNormalization(epsilon=1e-3)(x)
        x = keras.layers.Add()([x, keras.layers.Dense(D)(keras.layers.Dense(HIDDEN, activation="gelu")(h))])
    out = keras.layers.Dense(CLASSES)(keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization(
        epsilon=1e-3)(x)))
    model = keras.Model(inp, out)
    opt = keras.optimizers.AdamW(3e-3, weight_decay=0.01)
    opt.build(model.trainable_variables)

    @tf.function(reduce_retracing=True)
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(yb, model(xb, training=True)))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    rates = []
    for epoch in range(epochs):
        order = epoch_permutation(len(ds.x_train), cfg.seed, epoch, True)
        t0 = time.perf_counter()
        for s in range(0, len(order), cfg.data.batch_size):
            idx = order[s: s + cfg.data.batch_size]
            loss = step(ds.x_train[idx], ds.y_train[idx])
        float(loss)
        rates.append(len(order) / (time.perf_counter() - t0))
    return rates


if __name__ == "__main__":
    fw, epochs = sys.argv[1], int(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else len(os.sched_getaffinity(0))
    rates = run_torch(epochs, n) if fw == "torch" else run_tensorflow(epochs, n)
    import resource

    peak = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps({"framework": fw, "samples_per_sec": rates, "peak_rss_mb": peak}))
