"""Neutral spec graph -> a Keras 3 functional model, and neutral <-> Keras weight conversion.

The neutral layout *is* Keras's (channels-last, kernels [in, out], LSTM i,f,c,o gates,
GRU z,r,h with reset_after=True), so conversion is by order of `layer.weights`, with
shapes checked.
"""

from __future__ import annotations

import re
from collections import defaultdict

import keras
import numpy as np

from hvtrain.model.entrypoint import check_native_names
from hvtrain.model.spec import INPUT, LayerSpec, ModelSpec, check_weights, from_layers, per_layer

from .draws import SampleDraws
from .layers import build_layer


def build_model(spec: ModelSpec, dtype_policy: str | None = None, sources: tuple[int, ...] = (INPUT,),
                outputs: tuple[int, ...] = (), layers: list[LayerSpec] | None = None,
                draws: SampleDraws | None = None) -> keras.Model:
    """A Keras functional model of the spec's graph (or of `layers`, a pipeline stage, fed the
    producer tensors `sources` and returning `outputs`). Layer i is named `n<i>`. `draws`: dropout
    masks per sample (the compiled steps key them)."""
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
        native = build_layer(layer, dtype_policy, draws)
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
        weights = _same_model_names(weights, list(by_path))
        check_native_names(by_path, {k: tuple(v.shape) for k, v in by_path.items()}, weights)
        for name, value in weights.items():
            by_path[name].assign(value)
        return
    check_weights(spec, weights, "weights")
    for layer, native, w in zip(spec.layers, native_layers(model, spec.layers), per_layer(spec, weights),
                                strict=True):
        layer_to_native(layer, native, w)


_COUNTED = re.compile(r"^(.*?)(?:_(\d+))?$")


def _same_model_names(weights: dict[str, np.ndarray], paths: list[str]) -> dict[str, np.ndarray]:
    """`weights` keyed by `paths` when they name the same model built again in this process.

    Keras names a layer or model it was not given a name for by a per-process counter
    (`sequential/dense/kernel`, then `sequential_1/dense_2/kernel` for a second build): weights
    saved by hvtrain.train would not load into the model hvtrain.predict or evaluate builds next
    in the same Python process. Both sides' counters are renumbered in order of appearance
    (a counted name's n-th value per base name); when that makes them the same names, one to one,
    the keys are translated. Otherwise `weights` come back as given (and the name check says
    what differs).
    """
    if set(weights) == set(paths):
        return weights
    mine, theirs = _renumbered(paths), _renumbered(list(weights))
    if len(set(mine.values())) != len(mine) or len(set(theirs.values())) != len(theirs) \
            or set(mine.values()) != set(theirs.values()):
        return weights
    path_of = {canonical: path for path, canonical in mine.items()}
    return {path_of[theirs[name]]: value for name, value in weights.items()}


def _renumbered(paths: list[str]) -> dict[str, str]:
    """path -> the path with each `name_N` component's counter replaced by its rank among the
    counters of that base name in `paths` (no counter ranks first, as Keras's first name has none)."""
    counters: dict[str, set[int]] = defaultdict(set)
    for path in paths:
        for part in path.split("/"):
            base, n = _COUNTED.match(part).groups()
            counters[base].add(-1 if n is None else int(n))
    rank = {(base, n): i for base, ns in counters.items() for i, n in enumerate(sorted(ns))}

    def renumber(part: str) -> str:
        base, n = _COUNTED.match(part).groups()
        i = rank[base, -1 if n is None else int(n)]
        return base if i == 0 else f"{base}_{i}"

    return {path: "/".join(renumber(part) for part in path.split("/")) for path in paths}


def from_native(spec: ModelSpec | None, model: keras.Model) -> dict[str, np.ndarray]:
    """All weights, neutral layout (variable paths for entrypoint models)."""
    if spec is None:
        return {v.path: np.array(v.numpy()) for v in model.variables if "seed_generator" not in v.path}
    pairs = zip(spec.layers, native_layers(model, spec.layers), strict=True)
    return from_layers(spec, [layer_from_native(layer, native) for layer, native in pairs])
