"""Neutral spec -> keras.Sequential (Keras 3), and neutral <-> Keras weight conversion.

The neutral layout *is* Keras's (channels-last, kernels [in, out], LSTM i,f,c,o gates,
GRU z,r,h with reset_after=True), so conversion is by order of `layer.weights`, with
shapes checked.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from hvtrain.entrypoint import check_native_names
from hvtrain.spec import LayerSpec, ModelSpec, check_weights, from_layers, per_layer


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


def build_model(spec: ModelSpec, dtype_policy: str | None = None) -> keras.Sequential:
    inputs = keras.Input(shape=spec.input_shape, dtype="int64" if spec.integer_input else "float32")
    return keras.Sequential([inputs] + [build_layer(layer, dtype_policy) for layer in spec.layers])


def build_layer(layer: LayerSpec, dtype_policy: str | None = None) -> keras.layers.Layer:
    kw = {"dtype": dtype_policy} if dtype_policy else {}
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
    if kind == "reshape":
        return keras.layers.Reshape(o["shape"], **kw)
    if kind == "dropout":
        return keras.layers.Dropout(o["rate"], **kw)
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
    raise AssertionError(kind)


def layer_to_native(layer: LayerSpec, native: keras.layers.Layer, w: dict[str, np.ndarray]) -> None:
    """Load one layer's neutral weights (keyed by param name, e.g. 'kernel') into its Keras layer."""
    names = [spec.name.rsplit(".", 1)[1] for spec in layer.weights]
    values = [w[n] for n in names]
    current = native.weights
    if [tuple(v.shape) for v in current] != [tuple(v.shape) for v in values]:
        raise AssertionError(f"layer {layer.index} ({layer.type}): keras shapes "
                             f"{[tuple(v.shape) for v in current]} != neutral {[v.shape for v in values]}")
    for var, value in zip(current, values, strict=True):
        var.assign(value)


def layer_from_native(layer: LayerSpec, native: keras.layers.Layer) -> dict[str, np.ndarray]:
    """One layer's neutral weights (keyed by param name) read from its Keras layer."""
    names = [spec.name.rsplit(".", 1)[1] for spec in layer.weights]
    return {n: np.array(v.numpy(), np.float32) for n, v in zip(names, native.weights, strict=True)}


def to_native(spec: ModelSpec | None, model: keras.Model, weights: dict[str, np.ndarray]) -> None:
    """Load neutral weights (variable paths for entrypoint models, spec None).

    Raises:
        DataError: names or shapes that do not match the model.
    """
    if spec is None:
        by_path = {v.path: v for v in model.variables if "seed_generator" not in v.path}
        check_native_names(by_path, {k: tuple(v.shape) for k, v in by_path.items()}, weights)
        for name, value in weights.items():
            by_path[name].assign(value)
        return
    check_weights(spec, weights, "weights")
    for layer, native, w in zip(spec.layers, model.layers, per_layer(spec, weights), strict=True):
        layer_to_native(layer, native, w)


def from_native(spec: ModelSpec | None, model: keras.Model) -> dict[str, np.ndarray]:
    """All weights, neutral layout (variable paths for entrypoint models)."""
    if spec is None:
        return {v.path: np.array(v.numpy()) for v in model.variables if "seed_generator" not in v.path}
    return from_layers(spec, [layer_from_native(layer, native) for layer, native in zip(spec.layers, model.layers,
                                                                                          strict=True)])
