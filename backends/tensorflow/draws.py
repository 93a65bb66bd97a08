"""Per-sample dropout masks in TensorFlow (train.randomness: per_sample).

The mask of an element is a hash of its sample's key (hvtrain.data.draws.dropout_keys: seed, epoch,
sample), the layer and the element's position within the sample, computed with int64 tensor ops that
give exactly hvtrain.data.draws.keep_mask: the same masks as torch (backends/torch/draws.py), on any
rank count and after any resume. The compiled steps take the batch's keys as an argument and set them
here while they trace the model; an inference call draws nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import keras
import tensorflow as tf

from hvtrain.data.draws import GOLDEN32, LAYER32, M32, MIX32_A, MIX32_B, drop_threshold


class SampleDraws:
    """The sample keys (int64 [batch, 2]) of the training step being traced, shared by the dropouts."""

    def __init__(self) -> None:
        self.keys: tf.Tensor | None = None

    @contextmanager
    def keyed(self, keys: tf.Tensor | None) -> Iterator[None]:
        """Inside a traced step: the model's dropouts read `keys` (symbolic) while it is called."""
        self.keys = keys
        try:
            yield
        finally:
            self.keys = None  # no graph tensor outlives its trace

    def keep(self, layer: int, x: tf.Tensor, rate: float) -> tf.Tensor:
        """bool, x's shape: hvtrain.data.draws.keep_mask for the current keys."""
        if self.keys is None:
            raise ValueError(f"per-sample dropout of layer {layer}: a training call without the batch's sample "
                             "keys (train.randomness: per_sample)")
        n = math.prod(x.shape[1:])
        j = tf.range(n, dtype=tf.int64)
        salts = mix32(tf.bitwise.bitwise_and(j * GOLDEN32 + (layer + 1) * LAYER32, M32))
        keys = self.keys
        h = mix32(tf.bitwise.bitwise_xor(mix32(tf.bitwise.bitwise_xor(keys[:, :1], salts[None, :])), keys[:, 1:2]))
        return tf.reshape(h >= drop_threshold(rate), tf.shape(x))


def keyed(draws: SampleDraws | None, keys: tf.Tensor | None) -> Any:
    """The context of a traced training call: `draws` keyed by the batch's `keys` (None: nothing drawn)."""
    return nullcontext() if draws is None else draws.keyed(keys)


def mix32(x: tf.Tensor) -> tf.Tensor:
    """hvtrain.data.draws.mix32 on int64 tensors holding 32-bit values."""
    b = tf.bitwise
    x = b.bitwise_xor(x, b.right_shift(x, 16))
    x = b.bitwise_and(x * MIX32_A, M32)
    x = b.bitwise_xor(x, b.right_shift(x, 15))
    x = b.bitwise_and(x * MIX32_B, M32)
    return b.bitwise_xor(x, b.right_shift(x, 15))


def dropped(x: tf.Tensor, keep: tf.Tensor, rate: float) -> tf.Tensor:
    """x / (1 - rate) where kept, 0 elsewhere (torch computes the same, element for element)."""
    return tf.where(keep, x * tf.constant(1.0 / (1.0 - rate), x.dtype), tf.zeros((), x.dtype))


class HashedDropout(keras.layers.Layer):
    """The catalogue's dropout layer under per-sample randomness (no seed generator, no state)."""

    def __init__(self, rate: float, layer: int, draws: SampleDraws, **kw):
        super().__init__(**kw)
        self.rate, self.layer, self.draws = rate, layer, draws
        self.supports_masking = True  # as keras.layers.Dropout: a mask passes through

    def call(self, inputs, training=None):
        if not training or self.rate == 0.0:
            return inputs
        return dropped(inputs, self.draws.keep(self.layer, inputs, self.rate), self.rate)

    def compute_output_shape(self, input_shape):
        return input_shape


class HashedMultiHeadAttention(keras.layers.MultiHeadAttention):
    """keras.layers.MultiHeadAttention whose attention-weight dropout is hashed per sample."""

    def __init__(self, *args, layer: int, draws: SampleDraws, **kw):
        super().__init__(*args, **kw)
        self.layer_index, self.draws = layer, draws

    def _build_attention(self, rank):
        rate, self._dropout = self._dropout, 0.0
        try:  # Keras's own dropout layer made at rate 0: no seed generator in the model's variables
            super()._build_attention(rank)
        finally:
            self._dropout = rate
        self._dropout_layer = HashedDropout(rate, self.layer_index, self.draws, dtype=self.dtype_policy)
