"""Validation metrics, reduced across ranks from additive statistics (framework-neutral numpy).

Each rank turns its batches of model outputs and labels into one float64 vector of sums (the
counts of a confusion matrix, top-k hits by the rank of the true class, log-loss sums, sums of
targets and errors for R2); the trainer allreduces that vector once and every rank turns the
global sums into the same metric values. Ratios are formed from global sums only, never averaged
across ranks (averaging the accuracies of a rank with 180 samples and one with 179 is not the
accuracy of the 359).

Layout of the vector: the head `[loss, correct, squared error, absolute error]`, then one block
per requested metric family, then the sample count (appended by the StepRunner). Both layouts
sum it the same way: the whole model on each replica (steps.DataParallelSteps) or the last
pipeline stage of each replica (placement.runner.PipelineSteps; the other stages add zeros).

ROC-AUC is a statistic of the ranking of all validation scores, which no fixed set of counts
reproduces exactly, so it is not in the vector. Each rank keeps its samples' (index, scores,
label) rows while it evaluates; once per evaluation `reduce_scores` gathers them on rank 0 (one
gather of bytes), places them by index and computes the exact AUC there (Mann-Whitney, ties
counted half, as scikit-learn's trapezoids do), and broadcasts the value. Rank 0 then holds
n_val x scores float64 values (twice, briefly); `notes` warns above SCORES_NOTE_BYTES."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hvtrain.config.validate import parse_metrics
from hvtrain.metrics.names import CLASSIFICATION, REGRESSION, Metric

if TYPE_CHECKING:
    from hvtrain.config.schema import Config
    from hvtrain.data.dataset import Dataset



HEAD = 4  # loss, correct, squared error, absolute error


_CONFUSION = ("precision", "recall", "f1", "confusion_matrix")


_EPS = float(np.finfo(np.float64).eps)  # scikit-learn clips float64 probabilities to [eps, 1 - eps]


SCORES_NOTE_BYTES = 256 << 20  # roc_auc's scores on rank 0 above this: a note at the start


def check_metrics(cfg: Config, num_outputs: int) -> None:
    """The metrics against the data: top-k needs more classes than k.

    Raises:
        ConfigError: located at the metric.
    """
    for i, metric in enumerate(parse_metrics(cfg)):
        if metric.name == "top_k_accuracy" and metric.k >= num_outputs:
            raise cfg.fail(f"metrics[{i}]", f"top_k_accuracy with k={metric.k} needs more than {metric.k} classes "
                                            f"(every prediction would count), the data has {num_outputs}; give "
                                            "{top_k_accuracy: {k: N}} with a smaller N")


def probabilities(loss: str, out: np.ndarray) -> np.ndarray:
    """Class probabilities in float64 from the model's outputs (logits): softmax for cross_entropy,
    `[1 - p, p]` with p = sigmoid for binary_cross_entropy (scikit-learn's reading of a 1-D p)."""
    z = np.asarray(out, np.float64)
    if loss == "binary_cross_entropy":
        z = z[:, 0]
        e = np.exp(-np.abs(z))  # no overflow for any sign
        p = np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        return np.stack([1.0 - p, p], axis=1)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def predicted_class(loss: str, out: np.ndarray) -> np.ndarray:
    """The predicted class id: argmax of the logits, or logit > 0 (binary)."""
    if loss == "binary_cross_entropy":
        return (out[:, 0] > 0).astype(np.int64)
    return np.asarray(out.argmax(axis=1), np.int64)


def check_shapes(loss: str, out: np.ndarray, y: np.ndarray) -> None:
    """Outputs [batch, width] against class ids [batch], or targets of the outputs' own shape.
    numpy would broadcast a [batch] output against [batch, 1] targets into [batch, batch] errors
    (every sample scored against every target), silently.

    Raises:
        HvtrainError: naming both shapes.
    """
    out, y = np.asarray(out), np.asarray(y)
    fits = (out.ndim == 2 and y.ndim == 1 and len(out) == len(y)) if loss in CLASSIFICATION else out.shape == y.shape
    if not fits:
        from hvtrain.errors import HvtrainError

        want = "[batch, width] against class ids [batch]" if loss in CLASSIFICATION else "the targets' shape"
        raise HvtrainError(f"metrics: outputs of shape {list(out.shape)} do not fit labels of shape "
                           f"{list(y.shape)} (expected {want})")


def head_sums(loss: str, loss_sum: float, out: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[loss, correct, squared error, absolute error] of a batch (errors: mean over outputs, summed
    over samples)."""
    check_shapes(loss, out, y)
    correct = sq = ab = 0.0
    if loss in CLASSIFICATION:
        correct = float(np.sum(predicted_class(loss, out) == y))
    else:
        diff = np.asarray(out, np.float64) - y
        sq, ab = float(np.sum(np.mean(diff ** 2, axis=1))), float(np.sum(np.mean(np.abs(diff), axis=1)))
    return np.array([loss_sum, correct, sq, ab], np.float64)


def batch_stats(loss: str, loss_sum: float, out: np.ndarray, y: np.ndarray, metrics: MetricSet | None = None,
                index: np.ndarray | None = None) -> np.ndarray:
    """A batch's statistics in the MetricSet's layout, without the count: the head, then (given
    `metrics`) its blocks. `loss_sum` is the framework's own loss summed over the batch; `index`
    holds the samples' positions in the validation split (ROC-AUC's score block)."""
    head = head_sums(loss, loss_sum, out, y)
    return head if metrics is None else np.concatenate([head, metrics.blocks(out, y, index)])


class MetricSet:
    """The evaluation of one run: which statistics each batch adds, and the values read from
    their global sums. Every rank builds the same one from the config and the data."""

    def __init__(self, loss: str, metrics: list[Metric], num_outputs: int, num_val: int,
                 center: np.ndarray | None = None) -> None:
        """The statistics `metrics` need, for this loss and data.

        Args:
            num_outputs: classes (cross_entropy), 1 (binary_cross_entropy) or targets (regression).
            num_val: validation samples (ROC-AUC places every sample's scores at its index).
            center: per-target reference subtracted before summing y and y^2 for R2, so that the
                total sum of squares does not cancel catastrophically for targets far from 0.
        """
        self.loss, self.metrics = loss, list(metrics)
        self.classes = 2 if loss == "binary_cross_entropy" else num_outputs if loss in CLASSIFICATION else 0
        self.targets = num_outputs if loss in REGRESSION else 0
        self.num_val = num_val
        self.center = np.zeros(self.targets) if center is None else np.asarray(center, np.float64)
        self.scores = 1 if self.classes == 2 else self.classes  # ROC-AUC columns kept per sample
        # The last evaluation's ROC rows on the rank that computed the AUC (rank 0): every
        # validation sample's scores and class id, in validation order (roc_auc only). The trainer
        # saves them for `hvtrain report`'s ROC curve.
        self.last_scores: tuple[np.ndarray, np.ndarray] | None = None
        names = {m.name for m in self.metrics}
        self.keeps_scores = "roc_auc" in names
        self._rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # this rank's, this evaluation
        self._auc: float | None = None  # reduce_scores' value, read by the next values()
        self.notes: list[str] = []  # said once at the start (rank 0): see `of`
        sizes = {"confusion": self.classes ** 2 if names & set(_CONFUSION) else 0,
                 "ranks": self.classes if "top_k_accuracy" in names else 0,
                 "log_loss": 1 if "log_loss" in names else 0,
                 "r2": 3 * self.targets if "r2" in names else 0}
        self._at: dict[str, slice] = {}
        at = HEAD
        for name, size in sizes.items():
            self._at[name] = slice(at, at + size)
            at += size
        self.size = at + 1  # + the sample count

    @classmethod
    def of(cls, cfg: Config, data: Dataset) -> MetricSet:
        """The run's set, with `notes` about the validation data: classes roc_auc cannot score
        (absent from the validation labels: NaN, as scikit-learn's), scores too many to gather
        lightly."""
        center = None
        if cfg.loss in REGRESSION and len(data.train):
            # the training targets' median: one outlier target cannot move it (a mean of 1e30 / n
            # put every validation target ~1e27 from the centre, and R2's SS_tot cancelled to 0)
            center = np.median(np.asarray(data.train.y, np.float64).reshape(len(data.train), -1), axis=0)
        ms = cls(cfg.loss, parse_metrics(cfg), data.num_outputs, len(data.val), center)
        if ms.keeps_scores and len(data.val):
            absent = sorted(set(range(ms.classes)) - set(np.unique(np.asarray(data.val.y, np.int64)).tolist()))
            if absent:
                ms.notes.append(f"roc_auc will be NaN: class id(s) {absent} never occur in the validation labels (the "
                                "AUC of a class needs positives and negatives of it; scikit-learn's "
                                "roc_auc_score with labels=range(classes) gives NaN too)")
            size = ms.num_val * ms.scores * 8
            if size > SCORES_NOTE_BYTES:
                ms.notes.append(f"roc_auc: rank 0 gathers every validation sample's class scores once per evaluation: "
                                f"{ms.num_val} x {ms.scores} float64 = {size / 2 ** 20:.0f} MiB (twice that while "
                                "placing them); drop roc_auc or validate on fewer samples if rank 0's memory is short")
        return ms

    def begin(self) -> None:
        """A new evaluation: forget the rows kept by an earlier one (cut short by an elastic reset)."""
        self._rows, self._auc = [], None

    def blocks(self, out: np.ndarray, y: np.ndarray, index: np.ndarray | None) -> np.ndarray:
        """This batch's part of every block after the head; with roc_auc, its (index, scores,
        label) rows are kept for reduce_scores."""
        stats = np.zeros(self.size - 1 - HEAD, np.float64)
        view = {name: stats[s.start - HEAD: s.stop - HEAD] for name, s in self._at.items()}
        n = len(y)
        if self.classes:
            y = np.asarray(y, np.int64)
            width = out.shape[1] if self.loss == "cross_entropy" else 2
            if width != self.classes:
                from hvtrain.errors import HvtrainError

                raise HvtrainError(f"metrics: the model outputs {width} class scores per sample, the data has "
                                   f"{self.classes} classes")
            if view["confusion"].size:
                view["confusion"][:] = np.bincount(y * self.classes + predicted_class(self.loss, out),
                                                   minlength=self.classes ** 2)
            if view["ranks"].size or view["log_loss"].size or self.keeps_scores:
                proba = probabilities(self.loss, out)
                if view["ranks"].size:  # scikit-learn's order: stable argsort, reversed (ties: higher id first)
                    order = np.argsort(proba, axis=1, kind="mergesort")[:, ::-1]
                    view["ranks"][:] = np.bincount(np.argmax(order == y[:, None], axis=1), minlength=self.classes)
                if view["log_loss"].size:
                    view["log_loss"][0] = -np.sum(np.log(np.clip(proba[np.arange(n), y], _EPS, 1 - _EPS)))
                if self.keeps_scores:
                    if index is None:
                        raise ValueError("roc_auc needs the samples' validation indices")
                    self._rows.append((np.asarray(index, np.int64).copy(),
                                       np.ascontiguousarray(proba[:, 1:] if self.classes == 2 else proba), y.copy()))
        if view["r2"].size:
            target = np.asarray(y, np.float64).reshape(n, -1)
            err = np.asarray(out, np.float64).reshape(n, -1) - target
            shifted = target - self.center
            view["r2"][:] = np.concatenate([shifted.sum(axis=0), (shifted ** 2).sum(axis=0), (err ** 2).sum(axis=0)])
        return stats

    def reduce_scores(self, runtime: Any) -> None:
        """After this rank's evaluation batches, on every rank (roc_auc only; else nothing): the
        ranks' kept rows gathered once on rank 0, placed by sample index, the AUC computed there
        and broadcast, for the next values()."""
        if not self.keeps_scores:
            return
        blobs = runtime.gather_bytes(self._pack(self._take()))
        auc = self._place([self._unpack(b) for b in blobs]) if blobs is not None else None
        if blobs is None:
            self.last_scores = None  # another rank holds this evaluation's
        self._auc = runtime.broadcast_object(auc)

    def _take(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        rows, self._rows = self._rows, []
        return rows

    def _pack(self, rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> bytes:
        """Rows as bytes: every index (int64), every label (int64), then the scores (float64)."""
        if not rows:
            return b""
        index, scores, labels = (np.concatenate(part) for part in zip(*rows, strict=True))
        return index.tobytes() + labels.astype(np.int64).tobytes() + scores.astype(np.float64).tobytes()

    def _unpack(self, blob: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = len(blob) // (16 + 8 * self.scores)
        flat = np.frombuffer(blob, np.uint8)
        return (flat[:8 * n].view(np.int64), flat[16 * n:].view(np.float64).reshape(n, self.scores),
                flat[8 * n: 16 * n].view(np.int64))

    def _place(self, shares: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> float:
        """(index, scores, labels) rows, from every rank, at their sample index -> last_scores and
        the AUC."""
        scores, labels = np.zeros((self.num_val, self.scores)), np.zeros(self.num_val, np.int64)
        for index, s, y in shares:
            scores[index], labels[index] = s, y
        self.last_scores = (scores, labels)
        return self._roc_auc(scores, labels)

    def values(self, total: np.ndarray) -> dict[str, Any]:
        """Global sums (this set's layout, count last) -> {"loss", each metric's values, "samples"}.
        Scalars are floats; per-class values are lists (class id order); the confusion matrix is
        rows = true class, columns = predicted class. roc_auc is reduce_scores' value; without a
        reduce_scores call (one process), the AUC of the rows this object kept."""
        total = np.asarray(total, np.float64)
        if len(total) != self.size:
            raise ValueError(f"expected {self.size} evaluation sums, got {len(total)}")
        count = total[-1]
        loss, correct, sq, ab = total[:HEAD]
        out: dict[str, Any] = {"loss": _ratio(loss, count)}
        block = {name: total[s] for name, s in self._at.items()}
        for m in self.metrics:
            if m.name == "accuracy":
                out["accuracy"] = _ratio(correct, count)
            elif m.name == "top_k_accuracy":
                out[m.key] = _ratio(block["ranks"][:m.k].sum(), count)
            elif m.name in ("precision", "recall", "f1"):
                out.update(_prf(m.name, block["confusion"].reshape(self.classes, self.classes)))
            elif m.name == "confusion_matrix":
                out["confusion_matrix"] = block["confusion"].reshape(self.classes, self.classes).astype(int).tolist()
            elif m.name == "roc_auc":
                out["roc_auc"] = self._auc if self._auc is not None else self._place(self._take())
            elif m.name == "log_loss":
                out["log_loss"] = _ratio(block["log_loss"][0], count)
            elif m.name == "mse":
                out["mse"] = _ratio(sq, count)
            elif m.name == "mae":
                out["mae"] = _ratio(ab, count)
            elif m.name == "r2":
                out["r2"] = self._r2(block["r2"].reshape(3, self.targets), count)
        out["samples"] = int(count)
        self._auc = None
        return out

    def _roc_auc(self, scores: np.ndarray, labels: np.ndarray) -> float:
        """Binary: AUC of P(class 1). Otherwise one-vs-rest, the macro mean over every class
        (scikit-learn's multi_class='ovr', average='macro', labels=range(classes)): NaN when a
        class never occurs in the validation labels, as scikit-learn's (it is undefined there)."""
        if self.classes == 2:
            return _auc(scores[:, 0], labels == 1)
        return float(np.mean([_auc(scores[:, c], labels == c) for c in range(self.classes)]))

    def _r2(self, sums: np.ndarray, count: float) -> float:
        """Mean over targets of 1 - SS_res / SS_tot (scikit-learn's uniform_average with
        force_finite=True: a constant target scores 1 if predicted exactly, else 0; NaN for fewer
        than two samples).

        SS_tot = s2 - s1^2/n cancels: for a target constant on the validation split but away from
        the centre it is rounding noise (~n eps s2) instead of 0. A SS_tot within that bound,
        n eps s2, counts as a constant target (its true spread is below what the sums resolve).
        """
        if count < 2:
            return float("nan")
        s1, s2, ss_res = sums
        ss_tot = s2 - s1 * s1 / count
        constant = ss_tot <= count * _EPS * s2
        scores = [(1.0 if res == 0 else 0.0) if const else 1.0 - res / tot
                  for res, tot, const in zip(ss_res, ss_tot, constant, strict=True)]
        return float(np.mean(scores))


def _ratio(num: float, den: float) -> float:
    return float(num / den) if den else float("nan")


def _divide(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, 0 where den is 0 (scikit-learn's zero_division default)."""
    return np.divide(num, den, out=np.zeros(len(num)), where=den != 0)


def _prf(name: str, cm: np.ndarray) -> dict[str, Any]:
    """Precision, recall or F1 from the global confusion matrix: per class (every class id), the
    macro mean over the classes that occur in the labels or the predictions (scikit-learn's
    default labels) and the mean weighted by support."""
    tp, pred, true = np.diag(cm), cm.sum(axis=0), cm.sum(axis=1)
    per_class = {"precision": lambda: _divide(tp, pred), "recall": lambda: _divide(tp, true),
                 "f1": lambda: _divide(2 * tp, true + pred)}[name]()
    present = (true + pred) > 0
    macro = float(np.mean(per_class[present])) if present.any() else float("nan")
    weighted = float(np.average(per_class, weights=true)) if true.sum() else float("nan")
    return {name: macro, f"{name}_weighted": weighted, f"{name}_per_class": per_class.tolist()}


def _auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Area under the ROC curve: the probability that a positive scores above a negative, ties
    counted half (Mann-Whitney U from average ranks); NaN without both classes."""
    n_pos = int(positive.sum())
    n_neg = len(scores) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranked = scores[order]
    first = np.r_[True, ranked[1:] != ranked[:-1]]
    starts = np.flatnonzero(first)
    counts = np.diff(np.r_[starts, len(ranked)])
    ranks = np.empty(len(scores))
    ranks[order] = (starts + (counts + 1) / 2.0)[np.cumsum(first) - 1]  # 1-based average rank of ties
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
