"""Neutral spec -> keras.Sequential (Keras 3), and neutral <-> Keras weight conversion.

The neutral layout *is* Keras's (channels-last, kernels [in, out], LSTM i,f,c,o gates,
GRU z,r,h with reset_after=True), so conversion is by order of `layer.weights`, with
shapes checked.
"""

from __future__ import annotations

import keras
import numpy as np

from hvtrain.spec import LayerSpec, ModelSpec


def build_model(spec: ModelSpec, dtype_policy: str | None = None) -> keras.Sequential:
    kw = {"dtype": dtype_policy} if dtype_policy else {}
    inputs = keras.Input(shape=spec.input_shape, dtype="int64" if spec.integer_input else "float32")
    return keras.Sequential([inputs] + [_layer(layer, kw) for layer in spec.layers])


def _layer(layer: LayerSpec, kw: dict) -> keras.layers.Layer:
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
        return keras.layers.BatchNormalization(momentum=o["momentum"], epsilon=o["epsilon"], **kw)
    if kind == "activation":
        return keras.layers.Activation(o["activation"], **kw)
    if kind == "embedding":
        return keras.layers.Embedding(o["input_dim"], o["output_dim"], **kw)
    if kind == "lstm":
        return keras.layers.LSTM(o["units"], return_sequences=o["return_sequences"], **kw)
    if kind == "gru":
        return keras.layers.GRU(o["units"], return_sequences=o["return_sequences"], reset_after=True, **kw)
    raise AssertionError(kind)


def neutral_to_keras(layer: LayerSpec, keras_layer: keras.layers.Layer, w: dict[str, np.ndarray]) -> None:
    names = [spec.name.rsplit(".", 1)[1] for spec in layer.weights]
    values = [w[n] for n in names]
    current = keras_layer.weights
    if [tuple(v.shape) for v in current] != [tuple(v.shape) for v in values]:
        raise AssertionError(f"layer {layer.index} ({layer.type}): keras shapes "
                             f"{[tuple(v.shape) for v in current]} != neutral {[v.shape for v in values]}")
    for var, value in zip(current, values, strict=True):
        var.assign(value)


def keras_to_neutral(layer: LayerSpec, keras_layer: keras.layers.Layer) -> dict[str, np.ndarray]:
    names = [spec.name.rsplit(".", 1)[1] for spec in layer.weights]
    return {n: np.array(v.numpy(), np.float32) for n, v in zip(names, keras_layer.weights, strict=True)}
