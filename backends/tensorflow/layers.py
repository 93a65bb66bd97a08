"""The neutral layer catalogue as Keras 3 layers (the neutral layout is Keras's own)."""

from __future__ import annotations

import keras
import tensorflow as tf

from hvtrain.model.spec import LayerSpec

from .draws import HashedDropout, HashedMultiHeadAttention, SampleDraws


class BatchNorm(keras.layers.BatchNormalization):
    """A training batch with one value per channel (one sample of a dense layer) has no batch
    statistics: it is normalised with the moving statistics, which it leaves unchanged (Keras
    would output beta, torch would raise); both backends do the same."""

    def call(self, inputs, training=None, mask=None):
        parent = super()
        if not training:
            return parent.call(inputs, training=False, mask=mask)
        single = tf.equal(tf.size(inputs), tf.shape(inputs)[-1])
        return tf.cond(single, lambda: parent.call(inputs, training=False, mask=mask),
                       lambda: parent.call(inputs, training=True, mask=mask))


class PositionalEmbedding(keras.layers.Layer):
    """A learned position table added to a (T, D) sequence (positions 0..T-1)."""

    def __init__(self, max_len: int, **kw):
        super().__init__(**kw)
        self.max_len = max_len

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=(self.max_len, input_shape[-1]), initializer="zeros",
                                          name="embeddings")

    def call(self, inputs):
        return inputs + keras.ops.cast(self.embeddings[: keras.ops.shape(inputs)[1]], inputs.dtype)


class Attention(keras.layers.Layer):
    """keras.layers.MultiHeadAttention with the causal flag fixed at build: self-attention with one
    input, (query, key/value) with two. `hashed` (layer index, draws): its dropout per sample."""

    def __init__(self, num_heads: int, key_dim: int, causal: bool, dropout: float,
                 hashed: tuple[int, SampleDraws] | None = None, **kw):
        super().__init__(**kw)
        self.causal = causal
        if hashed is None:
            self.mha = keras.layers.MultiHeadAttention(num_heads, key_dim, dropout=dropout, dtype=kw.get("dtype"))
        else:
            self.mha = HashedMultiHeadAttention(num_heads, key_dim, dropout=dropout, dtype=kw.get("dtype"),
                                                layer=hashed[0], draws=hashed[1])

    def call(self, query, source=None, training=None):
        source = query if source is None else source
        return self.mha(query, source, use_causal_mask=self.causal, training=training)


def build_layer(layer: LayerSpec, dtype_policy: str | None = None,
                draws: SampleDraws | None = None) -> keras.layers.Layer:
    """The Keras layer of `layer`; a frozen one (`trainable: false`) has no trainable variables and,
    for batchnorm, normalises with its moving statistics and leaves them unchanged (Keras's rule).
    `draws`: its dropout masks are per sample (hashed), else Keras's seed generators'."""
    native = _build(layer, dtype_policy, draws)
    if not layer.trainable:
        native.trainable = False  # recursive: sublayers too
    return native


def _build(layer: LayerSpec, dtype_policy: str | None, draws: SampleDraws | None) -> keras.layers.Layer:
    kw = {"dtype": dtype_policy} if dtype_policy else {}
    kw["name"] = f"n{layer.index}"
    o, kind = layer.options, layer.type
    if kind == "dense":
        return keras.layers.Dense(o["units"], activation=o["activation"], use_bias=o["use_bias"], **kw)
    if kind == "conv2d":
        return keras.layers.Conv2D(o["filters"], o["kernel_size"], strides=o["strides"], padding=o["padding"],
                                   activation=o["activation"], use_bias=o["use_bias"], **kw)
    if kind == "maxpool2d":
        return keras.layers.MaxPooling2D(o["pool_size"], strides=o["strides"] or o["pool_size"], **kw)
    if kind == "avgpool2d":
        return keras.layers.AveragePooling2D(o["pool_size"], strides=o["strides"] or o["pool_size"], **kw)
    if kind == "flatten":
        return keras.layers.Flatten(**kw)
    if kind == "zeropad2d":
        return keras.layers.ZeroPadding2D(o["padding"], **kw)
    if kind == "reshape":
        return keras.layers.Reshape(o["shape"], **kw)
    if kind == "dropout":
        return keras.layers.Dropout(o["rate"], **kw) if draws is None else HashedDropout(o["rate"], layer.index,
                                                                                         draws, **kw)
    if kind == "batchnorm":
        return BatchNorm(momentum=o["momentum"], epsilon=o["epsilon"], **kw)
    if kind == "activation":
        return keras.layers.Activation(o["activation"], **kw)
    if kind == "embedding":
        return keras.layers.Embedding(o["input_dim"], o["output_dim"], **kw)
    if kind == "lstm":
        return keras.layers.LSTM(o["units"], return_sequences=o["return_sequences"], **kw)
    if kind == "gru":
        return keras.layers.GRU(o["units"], return_sequences=o["return_sequences"], reset_after=True, **kw)
    if kind == "conv1d":
        return keras.layers.Conv1D(o["filters"], o["kernel_size"], strides=o["strides"], padding=o["padding"],
                                   activation=o["activation"], use_bias=o["use_bias"], **kw)
    if kind == "maxpool1d":
        return keras.layers.MaxPooling1D(o["pool_size"], strides=o["strides"] or o["pool_size"], **kw)
    if kind == "avgpool1d":
        return keras.layers.AveragePooling1D(o["pool_size"], strides=o["strides"] or o["pool_size"], **kw)
    if kind in ("global_avgpool", "global_maxpool"):
        two_d = len(layer.input_shape) == 3
        cls = {("global_avgpool", True): keras.layers.GlobalAveragePooling2D,
               ("global_avgpool", False): keras.layers.GlobalAveragePooling1D,
               ("global_maxpool", True): keras.layers.GlobalMaxPooling2D,
               ("global_maxpool", False): keras.layers.GlobalMaxPooling1D}[(kind, two_d)]
        return cls(**kw)
    if kind == "layernorm":
        return keras.layers.LayerNormalization(epsilon=o["epsilon"], **kw)
    if kind == "positional_embedding":
        return PositionalEmbedding(o["max_len"], **kw)
    if kind == "multi_head_attention":
        return Attention(o["num_heads"], o["key_dim"], o["causal"], o["dropout"],
                         None if draws is None else (layer.index, draws), **kw)
    if kind == "add":
        return keras.layers.Add(**kw)
    if kind == "multiply":
        return keras.layers.Multiply(**kw)
    if kind == "concatenate":
        return keras.layers.Concatenate(axis=o["axis"] if o["axis"] < 0 else o["axis"] + 1, **kw)
    raise AssertionError(kind)
