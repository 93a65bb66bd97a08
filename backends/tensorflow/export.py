"""Exported Keras models: the model behind the raw-row normalisation and predict's output
activation in one tf.function, written as a SavedModel (tf.saved_model.save, signature
`serving_default`) or as ONNX (tf2onnx.convert.from_function), and a SavedModel reloaded for the
verification (ONNX is run by onnxruntime in hvtrain.tools.export)."""

from __future__ import annotations

import math
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from hvtrain.model.native import PLAIN, OutputForm
from hvtrain.model.weights import Inputs, export_dtypes

from .native import scores

OPSET = 18  # as the torch backend's exporter


def _served(model: keras.Model, inputs: Inputs,
            form: OutputForm = PLAIN) -> tuple[tf.types.experimental.GenericFunction, str, list]:
    """Raw rows -> (x - shift) / scale (training statistics; in float32, or in float64 then cast
    to float32 where float32 would lose raw values far from zero: hvtrain.model.weights.export_dtypes)
    -> model input shape ->
    model -> softmax (cross_entropy) / sigmoid (binary_cross_entropy) / as is (regression; in the
    targets' units: * scale + shift when they were normalised)."""
    t = inputs.transform
    width = math.prod(inputs.features)
    shape = tuple(t.shape) if t.shape is not None else tuple(inputs.features)
    takes, normalise_in = export_dtypes(inputs)
    shift = None if normalise_in is None else np.asarray(t.shift, normalise_in)
    scale = None if normalise_in is None else np.asarray(t.scale, normalise_in)
    precise = normalise_in == np.float64
    name = "outputs" if inputs.loss not in ("cross_entropy", "binary_cross_entropy") else "probabilities"
    target = inputs.target
    signature = [tf.TensorSpec((None,) + tuple(inputs.features), tf.as_dtype(takes), name="x")]

    @tf.function(input_signature=signature)
    def serve(x):
        if precise:  # constants built inside the function: embedded in the graph, not captured inputs
            x = tf.cast((tf.cast(tf.reshape(x, (-1, width)), tf.float64) - tf.constant(shift)) / tf.constant(scale),
                        tf.float32)
        elif shift is not None:
            x = (tf.reshape(x, (-1, width)) - tf.constant(shift)) / tf.constant(scale)
        out = scores(form, model(tf.reshape(x, (-1,) + shape), training=False))  # logits, as training saw them
        if inputs.loss == "cross_entropy":
            out = tf.nn.softmax(out, axis=1)
        elif inputs.loss == "binary_cross_entropy":
            out = tf.sigmoid(out)
        elif target is not None:
            out = out * tf.constant(target[1], tf.float32) + tf.constant(target[0], tf.float32)
        return {name: out}

    return serve, name, signature


def export(model: keras.Model, fmt: str, path: str, inputs: Inputs, form: OutputForm = PLAIN) -> None:
    """Write `model` as `fmt` to `path` (a directory for savedmodel); `form` (hvtrain.model.native) turns an
    entrypoint model's output into the logits the activation is applied to."""
    serve, _, signature = _served(model, inputs, form)
    if fmt == "savedmodel":
        module = tf.Module()
        module.model, module.serve = model, serve
        tf.saved_model.save(module, path, signatures={"serving_default": serve})
    elif fmt == "onnx":
        import tf2onnx

        tf2onnx.convert.from_function(serve, input_signature=signature, opset=OPSET, output_path=path)
    else:
        raise ValueError(f"tensorflow exports onnx or savedmodel, got {fmt!r}")


def load(fmt: str, path: str) -> Callable[[np.ndarray], np.ndarray]:
    """A SavedModel reloaded (its serving_default signature), as a function of raw rows."""
    if fmt != "savedmodel":
        raise ValueError(f"tensorflow reloads savedmodel, got {fmt!r}")
    serve = tf.saved_model.load(path).signatures["serving_default"]

    def run(x: np.ndarray) -> np.ndarray:
        (out,) = serve(x=tf.constant(np.ascontiguousarray(x))).values()
        return out.numpy()

    return run
