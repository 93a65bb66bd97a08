"""The neutral model spec: a graph of catalogue layers, shape inference, neutral weight layout, init.

Both backends build their native model from a `ModelSpec` and load the same initial weights,
generated here once in numpy from the seed. Tensors are channels-last (batch, H, W, C) and
sequences (batch, T, F), as in Keras; the torch backend permutes around its NCHW ops so that the
neutral layout is the same for both.

A model is a list of layers in topological order. Each layer may carry `name: STR` and
`inputs: [NAME, ...]` (default: the previous layer; `input` is the model input); `model.output`
names the output layer (default: the last). A plain list without names is a straight stack.
`{repeat: N, layers: [...]}` inlines a block N times. Names bind in order like assignments: an
input name means the latest layer bound to it before the reader (see `_expand`).

Neutral weight names are `layers.<i>.<param>` (i counts layers after repeats are expanded); the
catalogue and its layouts are hvtrain.model.layers. Layer i draws its initial weights from numpy's
default_rng([seed, i]) in the order of its weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hvtrain.config.schema import Config
from hvtrain.errors import ConfigError
from hvtrain.model.layers import ARITY, LAYER_OPTIONS, WeightSpec, infer, initialise, layer_options

__all__ = ["LayerSpec", "ModelSpec", "WeightSpec", "build_spec"]

INPUT = -1  # the producer index of the model input
_STRUCTURE_KEYS = ("type", "name", "inputs", "stage", "trainable")


@dataclass(frozen=True)
class LayerSpec:
    index: int
    type: str
    options: dict[str, Any]
    input_shape: tuple[int, ...]  # of the first input, without the batch axis
    output_shape: tuple[int, ...]
    weights: tuple[WeightSpec, ...] = ()
    stage: int | None = None  # a `stage: N` key on the layer (pipeline placement)
    name: str = ""
    inputs: tuple[int, ...] = ()  # producer layer indices (INPUT = the model input)
    input_shapes: tuple[tuple[int, ...], ...] = ()
    path: str = ""  # where the layer is written: model.layers[i] (inside repeats: ...layers[j])
    trainable: bool = True  # `trainable: false`: frozen (no gradient, no update; batchnorm keeps its statistics)

    @property
    def param_count(self) -> int:
        return sum(math.prod(w.shape) for w in self.weights if w.trainable)


def draws_random(layers: list[LayerSpec]) -> bool:
    """A layer draws random numbers in training: a dropout, or attention dropout (rate > 0)."""
    return any(layer.type == "dropout" and layer.options["rate"] > 0 or layer.options.get("dropout", 0.0) > 0
               for layer in layers)


@dataclass
class ModelSpec:
    input_shape: tuple[int, ...]
    layers: list[LayerSpec] = field(default_factory=list)
    output: int | None = None  # index of the output layer (None: the last)

    @property
    def output_index(self) -> int:
        return len(self.layers) - 1 if self.output is None else self.output

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.layers[self.output_index].output_shape if self.layers else self.input_shape

    @property
    def param_count(self) -> int:
        return sum(layer.param_count for layer in self.layers)

    @property
    def integer_input(self) -> bool:
        """An embedding reads the model input: inputs are token ids, not features."""
        return any(layer.type == "embedding" and INPUT in layer.inputs for layer in self.layers)

    @property
    def draws_random(self) -> bool:
        return draws_random(self.layers)

    @property
    def sequential(self) -> bool:
        """Every layer reads only the one before it (the old list spec)."""
        return all(layer.inputs == (layer.index - 1 if layer.index else INPUT,) for layer in self.layers) and \
            self.output_index == len(self.layers) - 1

    def weight_specs(self) -> list[WeightSpec]:
        return [w for layer in self.layers for w in layer.weights]

    def init_weights(self, seed: int) -> dict[str, np.ndarray]:
        """Initial weights in the neutral layout, identical for every backend."""
        out = {}
        for layer in self.layers:
            rng = np.random.default_rng([seed, layer.index])
            for w in layer.weights:
                out[w.name] = initialise(w, rng)
        return out

    def consumers(self) -> dict[int, list[int]]:
        """Producer index (INPUT for the model input) -> the layers that read it."""
        out: dict[int, list[int]] = {}
        for layer in self.layers:
            for j in layer.inputs:
                out.setdefault(j, []).append(layer.index)
        return out


@dataclass
class _Item:
    path: str
    raw: dict
    name: str  # "" when unnamed
    inputs: list[str] | None  # full names


def build_spec(cfg: Config) -> ModelSpec:
    """Validate `model.layers` (and `model.output`), resolve the graph and infer every shape.

    Raises:
        ConfigError: unknown layer type or option, bad option value, unknown or later-defined
            input names, a layer whose output is never used, or shapes that do not fit; located
            at `model.layers[i]...` and naming the layer.
    """
    scope: dict[str, str] = {}
    items = _expand(cfg, cfg.model.layers, "model.layers", scope, set())
    spec = ModelSpec(input_shape=tuple(cfg.model.input_shape or ()))
    names = {item.name: i for i, item in enumerate(items) if item.name}  # unique full names
    for i, item in enumerate(items):
        spec.layers.append(_layer(cfg, spec, items, names, i, item))
    if cfg.model.output is not None:
        full = scope.get(cfg.model.output)
        if full is None:
            raise cfg.fail("model.output", f"no layer is named {cfg.model.output!r}")
        spec.output = names[full]
    if spec.layers:
        _check_all_used(cfg, spec, items)
        _check_token_input(cfg, spec, items)
    return spec


def _expand(cfg: Config, raw_layers: list, path: str, scope: dict[str, str], used: set[str], suffix: str = ""
            ) -> list[_Item]:
    """The layer list with `repeat` blocks inlined.

    Names bind in order, like assignments: `inputs` naming `x` mean the latest `x` bound before
    this layer (inside copy k of a block, before `x` is bound again there, that is copy k-1's, or
    for the first copy the `x` before the block). `scope` (name -> full name) is updated, so after
    a block its names mean the last copy's. Full names are unique: `x` at top level, `x.k` in copy
    k of a block (nested blocks append their copy numbers), and `~2`, `~3`... when a name is
    bound again where that would repeat (a second block, or a top-level rebinding)."""
    out: list[_Item] = []
    for i, raw in enumerate(raw_layers):
        p = f"{path}[{i}]"
        if not isinstance(raw, dict):
            raise cfg.fail(p, f"expected a mapping like {{type: dense, units: 10}}, got {raw!r}")
        if "repeat" in raw:
            extra = sorted(set(raw) - {"repeat", "layers"})
            n, body = raw.get("repeat"), raw.get("layers")
            if extra:
                raise cfg.fail(f"{p}.{extra[0]}", "unknown key in a repeat block; expected repeat, layers")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise cfg.fail(f"{p}.repeat", f"expected a number of copies >= 1, got {n!r}")
            if not isinstance(body, list) or not body:
                raise cfg.fail(f"{p}.layers", "expected a non-empty list of layers to repeat")
            for k in range(1, n + 1):
                out.extend(_expand(cfg, body, f"{p}.layers", scope, used, f"{suffix}.{k}"))
            continue
        name = raw.get("name")
        if name is not None and (not isinstance(name, str) or not name or "." in name or "~" in name):
            raise cfg.fail(f"{p}.name", f"expected a name without dots or tildes, got {name!r}")
        if name == "input":
            raise cfg.fail(f"{p}.name", "'input' names the model input; choose another name")
        inputs = raw.get("inputs")
        if inputs is not None:
            if isinstance(inputs, str):
                inputs = [inputs]
            if not isinstance(inputs, list) or not inputs or not all(isinstance(x, str) for x in inputs):
                raise cfg.fail(f"{p}.inputs", f"expected a list of layer names (or input), got {inputs!r}")
            inputs = [scope.get(x, x) for x in inputs]
        full = ""
        if name:
            full, n_bound = f"{name}{suffix}", 1
            while full in used:
                n_bound += 1
                full = f"{name}{suffix}~{n_bound}"
            used.add(full)
            scope[name] = full
        out.append(_Item(p, raw, full, inputs))
    return out


def _layer(cfg: Config, spec: ModelSpec, items: list[_Item], names: dict[str, int], i: int, item: _Item
           ) -> LayerSpec:
    raw, path = item.raw, item.path
    label = f" ({item.name})" if item.name else ""

    def fail(p: str, message: str) -> ConfigError:
        if p == path:
            return ConfigError(f"{cfg.where(p)}: {p}{label}: {message}")
        return cfg.fail(p, message)

    kind = raw.get("type")
    if kind not in LAYER_OPTIONS:
        raise cfg.fail(f"{path}.type" if "type" in raw else path,
                       f"unknown layer type {kind!r}; expected one of {', '.join(LAYER_OPTIONS)}")
    stage = raw.get("stage")
    if stage is not None and (not isinstance(stage, int) or isinstance(stage, bool) or stage < 0):
        raise cfg.fail(f"{path}.stage", f"expected a stage number >= 0, got {stage!r}")
    trainable = raw.get("trainable", True)
    if not isinstance(trainable, bool):
        raise cfg.fail(f"{path}.trainable", f"expected true or false, got {trainable!r}")
    options = layer_options(fail, path, kind, {k: v for k, v in raw.items() if k not in _STRUCTURE_KEYS})
    if item.inputs is None:
        inputs = [i - 1 if i else INPUT]
    else:
        inputs = []
        for name in item.inputs:
            if name == "input":
                inputs.append(INPUT)
            elif name not in names:
                raise fail(path, f"inputs: unknown layer {name!r}")
            elif names[name] >= i:
                what = "its own output" if names[name] == i else f"{items[names[name]].path}, defined later"
                raise fail(path, f"inputs: {name!r} is {what}; a layer must come after its inputs")
            else:
                inputs.append(names[name])
    low, high = ARITY.get(kind, (1, 1))
    if not low <= len(inputs) <= high:
        want = f"{low}" if low == high else f"{low} to {high}" if high < 64 else f"at least {low}"
        raise fail(path, f"{kind} takes {want} input(s), got {len(inputs)}")
    if kind == "embedding" and inputs != [INPUT]:
        raise fail(f"{path}.type", "embedding must read the model input (it takes token ids)")
    shapes = [spec.input_shape if j == INPUT else spec.layers[j].output_shape for j in inputs]
    try:
        out_shape, weights = infer(fail, path, i, kind, options, shapes)
    except ConfigError as exc:
        previous = spec.layers[-1].stage if spec.layers else None
        if stage is not None and previous is not None and stage != previous:
            raise ConfigError(f"{exc} (stage boundary {previous} -> {stage}: stage {previous} outputs "
                              f"{list(shapes[0])})") from None
        raise
    if not trainable:  # its weights are never updated: not trainable whatever they are
        weights = [replace(w, trainable=False) for w in weights]
    return LayerSpec(i, kind, options, shapes[0], out_shape, tuple(weights), stage, item.name, tuple(inputs),
                     tuple(shapes), path, trainable)


def _check_token_input(cfg: Config, spec: ModelSpec, items: list[_Item]) -> None:
    """Token ids (an embedding reads the input) can only be read by embeddings."""
    if not spec.integer_input:
        return
    for layer in spec.layers:
        if INPUT in layer.inputs and layer.type != "embedding":
            path = items[layer.index].path
            label = f" ({layer.name})" if layer.name else ""
            raise ConfigError(f"{cfg.where(path)}: {path}{label}: {layer.type} reads the model input, which holds "
                              "token ids (an embedding reads it); only embeddings may read `input` here")


def _check_all_used(cfg: Config, spec: ModelSpec, items: list[_Item]) -> None:
    used = spec.consumers()
    for layer in spec.layers:
        if layer.index != spec.output_index and layer.index not in used:
            label = f" ({layer.name})" if layer.name else ""
            raise ConfigError(f"{cfg.where(items[layer.index].path)}: {items[layer.index].path}{label}: its output "
                              "is never used (an unused branch); connect it with `inputs` or remove it")


def check_against_data(cfg: Config, spec: ModelSpec, feature_shape: tuple[int, ...], num_outputs: int) -> None:
    """The model's input must take the data and its output must match the targets."""
    want = math.prod(spec.input_shape)
    have = math.prod(feature_shape)
    if want != have:
        raise cfg.fail("model.input_shape", f"expected {have} values per sample to match dataset "
                       f"{cfg.data.dataset!r} (features {list(feature_shape)}), got {list(spec.input_shape)} "
                       f"({want} values)")
    out = spec.output_shape
    if len(out) != 1 or out[0] != num_outputs:
        what = {"cross_entropy": f"{num_outputs} classes", "binary_cross_entropy": "1 logit"}.get(
            cfg.loss, f"{num_outputs} targets")
        last = "model.output" if cfg.model.output else \
            f"model.layers[{len(cfg.model.layers) - 1}]" if cfg.model.layers else "model.layers"
        raise cfg.fail(last, f"model output shape {list(out)} does not match the data: expected [{num_outputs}] "
                       f"({what} for loss {cfg.loss!r})")


def check_token_ids(cfg: Config, spec: ModelSpec, largest: int | None, what: str) -> None:
    """Every embedding reading the input must have a row for the largest token id (`what` says
    where it comes from): torch would fail mid-step with an IndexError, TensorFlow on a GPU would
    silently embed zeros."""
    if largest is None:
        return
    for layer in spec.layers:
        if layer.type == "embedding" and INPUT in layer.inputs and layer.options["input_dim"] <= largest:
            raise cfg.fail(f"{layer.path}.input_dim", f"expected more than the largest token id {largest} "
                           f"({what}), got {layer.options['input_dim']}")


# ----------------------------------------------------------------------------- neutral files


def check_weights(spec: ModelSpec, weights: dict[str, np.ndarray], source: str) -> None:
    """Names and shapes of a neutral weight set must be exactly the spec's.

    Raises:
        DataError: naming the first missing, unexpected or mis-shaped key.
    """
    from hvtrain.errors import DataError

    expected = {w.name: w.shape for w in spec.weight_specs()}
    for name, shape in expected.items():
        if name not in weights:
            raise DataError(f"{source}: missing weight {name!r} (shape {list(shape)}) required by the config")
        if tuple(weights[name].shape) != shape:
            raise DataError(f"{source}: weight {name!r} has shape {list(weights[name].shape)}, "
                            f"the config's model needs {list(shape)}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise DataError(f"{source}: weight {extra[0]!r} is not part of the config's model "
                        f"({len(extra)} unexpected key(s))")


def per_layer(spec: ModelSpec, weights: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Neutral weights grouped by layer: result[i][param] = weights['layers.<i>.<param>']."""
    out: list[dict[str, np.ndarray]] = [{} for _ in spec.layers]
    for layer in spec.layers:
        for w in layer.weights:
            out[layer.index][w.name.rsplit(".", 1)[1]] = weights[w.name]
    return out


def from_layers(spec: ModelSpec, grouped: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Inverse of per_layer."""
    return {f"layers.{i}.{param}": np.asarray(v, np.float32)
            for i, layer_w in enumerate(grouped) for param, v in layer_w.items()}
