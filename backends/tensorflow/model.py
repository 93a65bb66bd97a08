"""Neutral spec graph -> a Keras 3 functional model, and neutral <-> Keras weight conversion.

The neutral layout *is* Keras's (channels-last, kernels [in, out], LSTM i,f,c,o gates,
GRU z,r,h with reset_after=True), so conversion is by order of `layer.weights`, with
shapes checked.
"""

from __future__ import annotations

import keras
import numpy as np

from hvtrain.entrypoint import check_native_names
from hvtrain.spec import INPUT, LayerSpec, ModelSpec, check_weights, from_layers, per_layer

from .layers import build_layer


def build_model(spec: ModelSpec, dtype_policy: str | None = None, sources: tuple[int, ...] = (INPUT,),
                outputs: tuple[int, ...] = (), layers: list[LayerSpec] | None = None) -> keras.Model:
    """A Keras functional model of the spec's graph (or of `layers`, a pipeline stage, fed the
    producer tensors `sources` and returning `outputs`). Layer i is named `n<i>`."""
    layers = spec.layers if layers is None else layers
    values = {}
    inputs = []
    for j in sources:
        shape = spec.input_shape if j == INPUT else spec.layers[j].output_shape
        dtype = "int64" if j == INPUT and spec.integer_input else "float32"
        values[j] = keras.Input(shape=shape, dtype=dtype)
        inputs.append(values[j])
    for layer in layers:
        args = [values[j] for j in layer.inputs]
        native = build_layer(layer, dtype_policy)
        values[layer.index] = native(args) if layer.type in ("add", "multiply", "concatenate") else native(*args)
    outs = [values[j] for j in (outputs or (spec.output_index if layers is spec.layers else layers[-1].index,))]
    return keras.Model(inputs[0] if len(inputs) == 1 else inputs, outs[0] if len(outs) == 1 else outs)


def native_layers(model: keras.Model, layers: list[LayerSpec]) -> list[keras.layers.Layer]:
    """The Keras layer of each spec layer, in spec order."""
    return [model.get_layer(f"n{layer.index}") for layer in layers]


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
    for layer, native, w in zip(spec.layers, native_layers(model, spec.layers), per_layer(spec, weights),
                                strict=True):
        layer_to_native(layer, native, w)


def from_native(spec: ModelSpec | None, model: keras.Model) -> dict[str, np.ndarray]:
    """All weights, neutral layout (variable paths for entrypoint models)."""
    if spec is None:
        return {v.path: np.array(v.numpy()) for v in model.variables if "seed_generator" not in v.path}
    pairs = zip(spec.layers, native_layers(model, spec.layers), strict=True)
    return from_layers(spec, [layer_from_native(layer, native) for layer, native in pairs])
