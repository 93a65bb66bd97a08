"""An entrypoint Keras model against hvtrain's native-model contract (hvtrain.model.native): what it
reads and returns on the probe batch (the first call also builds a model that is not built yet:
a subclassed keras.Model, a Sequential without keras.Input), and its output turned into logits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hvtrain.config.schema import Config
from hvtrain.model.native import ACTIVATIONS, ONE_BELOW, TINY, NativeInputs, OutputForm, Returned


def _run(cfg: Config, model: keras.Model, x: np.ndarray) -> Any:
    """One call in inference mode (no statistics updated); a failure is the user's code failing on
    the data, located at model.entrypoint."""
    try:
        return model(tf.constant(np.ascontiguousarray(x)), training=False)
    except _ReadsIds:
        raise
    except Exception as exc:  # noqa: BLE001 - user code: any failure is reported, located
        raise cfg.fail("model.entrypoint", f"{cfg.model.entrypoint} raised {type(exc).__name__} on a probe batch of "
                                           f"{len(x)} training samples {list(x.shape)} {x.dtype}: "
                                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


class _ReadsIds(Exception):
    """An embedding was handed ids it has no row for: stop the call there (hvtrain.model.native.check_reads
    says what is wrong)."""


def _declared_ids(model: keras.Model) -> bool:
    """A built functional model whose Input is declared with an integer dtype."""
    try:
        inputs = model.inputs
    except AttributeError:  # not built yet, or subclassed
        return False
    return bool(inputs) and "int" in str(inputs[0].dtype)


def reads(cfg: Config, model: keras.Model, x: np.ndarray, device: Any = None) -> NativeInputs:
    """What the model reads, from its first call on the probe batch `x` (which builds a model that
    is not built yet, before its optimizer is): token ids when its Input is declared integer or an
    Embedding is handed the model input (Keras casts floats to ids silently), float32 otherwise.
    `device` is unused: a TensorFlow rank sees only its pinned GPU."""
    declared = _declared_ids(model)
    feed = x.astype(np.int64) if declared else x
    # every Embedding, nested ones too (Keras's own layer walk; model.layers lists only the top level)
    embeddings = [layer for layer in model._flatten_layers(include_self=False)
                  if isinstance(layer, keras.layers.Embedding)]
    hits: list[int] = []

    def watch(layer: keras.layers.Embedding) -> Any:
        call = layer.call

        def watched(inputs, *args, **kwargs):
            ids = np.asarray(inputs)
            if ids.size == feed.size and np.array_equal(ids.reshape(-1), feed.reshape(-1).astype(ids.dtype)):
                hits.append(int(layer.input_dim))
                if ids.size and (ids.min() < 0 or ids.max() >= layer.input_dim or not np.all(ids == np.round(ids))):
                    raise _ReadsIds
            return call(inputs, *args, **kwargs)

        return watched

    for layer in embeddings:
        object.__setattr__(layer, "call", watch(layer))  # this instance only, for this call
    try:
        _run(cfg, model, feed)
    except _ReadsIds:
        pass
    finally:
        for layer in embeddings:
            object.__delattr__(layer, "call")
    if not (declared or hits):
        return NativeInputs()
    return NativeInputs(True, min(hits) if hits else None)


def _activation(model: keras.Model, out: Any) -> str | None:
    """The activation that made `out`: Keras marks a softmax's or sigmoid's output with the
    logits it was given (what its own losses read); a Sequential's last layer names its own."""
    logits = getattr(out, "_keras_logits", None)
    if logits is not None:
        near = np.allclose(np.asarray(tf.sigmoid(tf.cast(logits, tf.float32))), np.asarray(out, np.float32), atol=1e-3)
        return "sigmoid" if near else "softmax"
    if isinstance(model, keras.Sequential) and model.layers:
        name = getattr(getattr(model.layers[-1], "activation", None), "__name__", None)
        return name if name in ACTIVATIONS else None
    return None


def returned(cfg: Config, model: keras.Model, x: np.ndarray, device: Any = None) -> Returned:
    """What the model returns for the probe batch `x`, and the activation that made its scores."""
    out = _run(cfg, model, x)
    if isinstance(out, Mapping):
        keys = tuple(str(k) for k in out)
        t = out.get("logits")
        if "logits" in out and not tf.is_tensor(t):
            return Returned(f"mapping whose 'logits' is a {type(t).__name__}")
        if t is None:
            return Returned("mapping", keys)
        return Returned("mapping", keys, scores=np.asarray(t, np.float64), activation=_activation(model, t))
    if isinstance(out, (tuple, list)):
        return Returned("sequence", length=len(out))
    if not tf.is_tensor(out):
        return Returned(type(out).__name__)
    return Returned("tensor", scores=np.asarray(out, np.float64), activation=_activation(model, out))


def scores(form: OutputForm, out: Any) -> tf.Tensor:
    """The model's output as [batch, width] float32 logits, as `form` says."""
    if form.key is not None:
        out = out[form.key]
    out = tf.cast(out, tf.float32)
    if form.flat:
        out = tf.reshape(out, (-1, 1))
    if form.undo == "softmax":
        return tf.math.log(tf.maximum(out, TINY))
    if form.undo == "sigmoid":
        p = tf.clip_by_value(out, TINY, ONE_BELOW)
        return tf.math.log(p) - tf.math.log1p(-p)
    return out
