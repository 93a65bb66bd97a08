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
from hvtrain.errors import HvtrainError
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


def _activation(model: keras.Model, out: Any) -> dict[str, Any]:
    """The activation that made `out`: Keras marks a softmax's or sigmoid's output with the
    logits it was given (what its own losses read: `pre`, read again in every call); a
    Sequential's last layer names its own."""
    logits = getattr(out, "_keras_logits", None)
    if logits is not None and tuple(logits.shape) == tuple(out.shape):
        return {"activation": _sigmoid_or_softmax(np.asarray(tf.cast(logits, tf.float64)),
                                                  np.asarray(tf.cast(out, tf.float64))), "pre": True}
    if isinstance(model, keras.Sequential) and model.layers:
        name = getattr(getattr(model.layers[-1], "activation", None), "__name__", None)
        return {"activation": name} if name in ACTIVATIONS else {}
    return {}


def _sigmoid_or_softmax(z: np.ndarray, p: np.ndarray) -> str | None:
    """Which of the two made `p` from `z`, compared in log space on the finite rows (a sure
    softmax's [1, 1e-7] and the sigmoid of its logits, [0.9997, 3e-4], agree to 1e-3 in value,
    not in log: -16 against -8). None: no finite row to tell by."""
    z, p = z.reshape(len(z), -1), p.reshape(len(p), -1)
    rows = np.all(np.isfinite(z), axis=1) & np.all(np.isfinite(p), axis=1)
    z, p = z[rows], p[rows]
    if not len(z):
        return None
    seen = p > 1e-30  # an underflowed probability has no log to compare
    logp = np.log(np.where(seen, p, 1.0))
    log_sigmoid = -np.logaddexp(0.0, -z)
    log_softmax = z - np.logaddexp.reduce(z, axis=1, keepdims=True)
    off = [float(np.max(np.abs(logp - c)[seen], initial=0.0)) for c in (log_sigmoid, log_softmax)]
    if z.shape[1] == 1 and off[0] <= 1e-6:  # one output: a softmax's is exactly 1 (log 0), and so is a
        return "sigmoid"  # sure sigmoid's in float32 (z > 16.6): the sigmoid explains it, the only trainable one
    return "sigmoid" if off[0] <= off[1] else "softmax"


def returned(cfg: Config, model: keras.Model, x: np.ndarray, device: Any = None) -> Returned:
    """What the model returns for the probe batch `x`, and the activation that made its scores."""
    out = _run(cfg, model, x)
    want = cfg.model.output_key
    if isinstance(out, Mapping):
        keys = tuple(str(k) for k in out)
        key = want if isinstance(want, str) else "logits"
        t = out.get(key)
        if key in out and not tf.is_tensor(t):
            return Returned(f"mapping whose {key!r} is a {type(t).__name__}")
        if t is None or not isinstance(want, (str, type(None))):
            return Returned("mapping", keys)
        return Returned("mapping", keys, scores=np.asarray(t, np.float64), **_activation(model, t))
    if isinstance(out, (tuple, list)):
        index = want if type(want) is int else 0
        t = out[index] if 0 <= index < len(out) else None
        if not tf.is_tensor(t):
            return Returned("sequence", length=len(out))
        return Returned("sequence", length=len(out), scores=np.asarray(t, np.float64), **_activation(model, t))
    if not tf.is_tensor(out):
        return Returned(type(out).__name__)
    return Returned("tensor", scores=np.asarray(out, np.float64), **_activation(model, out))


def reading(form: OutputForm) -> None:
    """What a call runs under so that `scores` can read its final activation's logits: nothing,
    Keras attaches them to the output itself (torch's forward runs under a recorder)."""
    return None


def scores(form: OutputForm, out: Any, seen: None = None) -> tf.Tensor:
    """The model's output as [batch, width] float32 logits, as `form` says: where it reads the
    final activation's input, the `_keras_logits` Keras attached to the output (in a traced step
    too, as its own losses read them). `seen`: `reading`'s, None.

    Raises:
        HvtrainError: the form reads them and this call's output carries none (a call that differs
            from the probe's).
    """
    if form.key is not None:
        out = out[form.key]
    elif isinstance(out, (tuple, list)) and out:  # a tensor in inference (the probe), a tuple in training:
        out = out[0]  # torchvision's Inception/GoogLeNet (logits, aux): the contract's first value
    elif isinstance(out, Mapping) and "logits" in out:
        out = out["logits"]
    if form.pre:
        logits = getattr(out, "_keras_logits", None)
        if logits is None:
            raise HvtrainError(f"model.entrypoint: this call's output carries no logits of its final {form.undo} "
                               "(Keras's _keras_logits, which the probe batch's had), whose input hvtrain trains "
                               "on: a call must end the same way every time")
        out = logits
    out = tf.cast(out, tf.float32)
    if form.flat:
        out = tf.reshape(out, (-1, 1))
    if form.pre:
        return out
    if form.undo == "softmax":
        return tf.math.log(tf.maximum(out, TINY))
    if form.undo == "sigmoid":
        p = tf.clip_by_value(out, TINY, ONE_BELOW)
        return tf.math.log(p) - tf.math.log1p(-p)
    return out
