"""The metrics suite's math (hvtrain.metrics.suite), no framework: statistics summed over uneven
"ranks" and arbitrary batches must give scikit-learn's value on the same predictions, and config
errors name the metric's file:line. The real 2-rank runs are tests/parallel/test_metrics.py."""

import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from scipy.special import expit, softmax
from sklearn import metrics as skm

from hvtrain.config.load import load_config
from hvtrain.config.validate import parse_metrics
from hvtrain.errors import ConfigError
from hvtrain.metrics.names import Metric
from hvtrain.metrics.suite import HEAD, MetricSet, batch_stats, check_metrics, head_sums

CLASSIFY = [Metric("accuracy"), Metric("top_k_accuracy", 3), Metric("precision"), Metric("recall"), Metric("f1"),
            Metric("confusion_matrix"), Metric("roc_auc"), Metric("log_loss")]


from tests.support.configs import BASE  # noqa: E402


def reduce(ms: MetricSet, out: np.ndarray, y: np.ndarray, ranks: int = 2, batch: int = 37,
           loss_sums: np.ndarray | None = None) -> dict:
    """What the trainer does: each rank sums its share (every `ranks`-th sample) batch by batch,
    the shares are added (the allreduce), the values are read from the global sums."""
    total = np.zeros(ms.size)
    for r in range(ranks):
        idx = np.arange(r, len(y), ranks)
        mine = np.zeros(ms.size - 1)
        for start in range(0, len(idx), batch):
            chunk = idx[start: start + batch]
            loss = 0.0 if loss_sums is None else float(loss_sums[chunk].sum())
            mine += batch_stats(ms.loss, loss, out[chunk], y[chunk], ms, chunk)
        total += np.concatenate([mine, [len(idx)]])
    return ms.values(total)


def check_prf(got: dict, y: np.ndarray, pred: np.ndarray, classes: int) -> None:
    for name, fn in [("precision", skm.precision_score), ("recall", skm.recall_score), ("f1", skm.f1_score)]:
        assert got[name] == pytest.approx(fn(y, pred, average="macro", zero_division=0), rel=1e-12, abs=1e-15)
        assert got[f"{name}_weighted"] == pytest.approx(fn(y, pred, average="weighted", zero_division=0), rel=1e-12)
        np.testing.assert_allclose(got[f"{name}_per_class"],
                                   fn(y, pred, average=None, labels=range(classes), zero_division=0), rtol=1e-12)


def test_multiclass_metrics_equal_sklearn_from_sums_over_uneven_ranks():
    rng = np.random.default_rng(0)
    n, c = 301, 7  # 151 and 150 samples on the two ranks
    out = (rng.standard_normal((n, c)) * 2).astype(np.float32)
    y = rng.integers(0, c, n)
    got = reduce(MetricSet("cross_entropy", CLASSIFY, c, n), out, y)
    proba, pred = softmax(out.astype(np.float64), axis=1), out.argmax(axis=1)
    assert got["samples"] == n
    assert got["accuracy"] == skm.accuracy_score(y, pred)
    assert got["top_3_accuracy"] == skm.top_k_accuracy_score(y, proba, k=3, labels=range(c))
    check_prf(got, y, pred, c)
    assert got["confusion_matrix"] == skm.confusion_matrix(y, pred, labels=range(c)).tolist()
    assert got["roc_auc"] == pytest.approx(skm.roc_auc_score(y, proba, multi_class="ovr", labels=range(c)),
                                           rel=1e-12)
    assert got["log_loss"] == pytest.approx(skm.log_loss(y, proba, labels=range(c)), rel=1e-12)


def test_ratios_come_from_global_counts_not_from_averaged_rank_ratios():
    """Rank 0 holds 2 samples (both right), rank 1 holds 1 (wrong): the mean of the ranks'
    accuracies would be 0.5; the accuracy of the 3 samples is 2/3. Precision likewise."""
    out = np.array([[5, 0], [0, 5], [5, 0]], np.float32)
    y = np.array([0, 1, 1])
    ms = MetricSet("cross_entropy", [Metric("accuracy"), Metric("precision")], 2, 3)
    rank0 = np.concatenate([batch_stats("cross_entropy", 0.0, out[:2], y[:2], ms, np.arange(2)), [2]])
    rank1 = np.concatenate([batch_stats("cross_entropy", 0.0, out[2:], y[2:], ms, np.arange(2, 3)), [1]])
    got = ms.values(rank0 + rank1)
    assert got["accuracy"] == pytest.approx(2 / 3) and got["accuracy"] != 0.5
    assert got["precision"] == pytest.approx(skm.precision_score(y, out.argmax(1), average="macro"))


def test_binary_metrics_equal_sklearn_with_saturated_and_tied_scores():
    """Sigmoid outputs: logits of +-40 saturate to probabilities 1 and 0 (clipped for log loss as
    sklearn clips), and repeated logits are ties for ROC-AUC (counted half)."""
    rng = np.random.default_rng(1)
    n = 119
    z = rng.standard_normal(n).astype(np.float32) * 3
    z[:6] = [40, -40, 40, -40, 0.5, 0.5]
    z[6:30] = np.round(z[6:30])  # ties
    y = (rng.random(n) < expit(z)).astype(np.int64)
    y[:4] = [0, 1, 1, 0]  # two confidently wrong: log loss hits the clipping
    out = z[:, None]
    metrics = [m for m in CLASSIFY if m.name != "top_k_accuracy"]
    got = reduce(MetricSet("binary_cross_entropy", metrics, 1, n), out, y, ranks=2, batch=16)
    p = expit(z.astype(np.float64))
    pred = (z > 0).astype(np.int64)
    assert got["accuracy"] == skm.accuracy_score(y, pred)
    check_prf(got, y, pred, 2)
    assert got["confusion_matrix"] == skm.confusion_matrix(y, pred).tolist()
    assert got["roc_auc"] == pytest.approx(skm.roc_auc_score(y, p), rel=1e-12)
    assert got["log_loss"] == pytest.approx(skm.log_loss(y, p), rel=1e-12)
    exact = np.mean(np.logaddexp(0, np.where(y == 1, -z, z).astype(np.float64)))  # from logits, unclipped
    assert got["log_loss"] < exact - 0.05  # the clipping really happened (-log(eps) = 36 < 40, twice)


def test_class_missing_from_labels_and_predictions():
    """sklearn's macro mean runs over the classes seen in labels or predictions; per-class lists
    keep every class id (0 for an unseen one)."""
    rng = np.random.default_rng(2)
    n, c = 60, 5
    y = rng.integers(0, 4, n)  # class 4 never occurs...
    out = rng.standard_normal((n, c)).astype(np.float32)
    out[:, 4] = -10  # ...and is never predicted
    got = reduce(MetricSet("cross_entropy", [Metric("precision"), Metric("recall"), Metric("f1")], c, n), out, y)
    check_prf(got, y, out.argmax(1), c)
    assert got["f1_per_class"][4] == 0.0


def test_regression_metrics_equal_sklearn_for_targets_far_from_zero():
    """Two targets around 1e6 with spread ~1: sums of y and y^2 would cancel; the training mean
    subtracted first keeps R2 exact."""
    rng = np.random.default_rng(3)
    n = 199
    y = (1e6 + rng.standard_normal((n, 2))).astype(np.float32)
    out = (y + 0.5 * rng.standard_normal((n, 2))).astype(np.float32)
    ms = MetricSet("mse", [Metric("mse"), Metric("mae"), Metric("r2")], 2, n, center=y.mean(axis=0) + 0.25)
    got = reduce(ms, out, y)
    y64, o64 = y.astype(np.float64), out.astype(np.float64)
    assert got["mse"] == pytest.approx(skm.mean_squared_error(y64, o64), rel=1e-12)
    assert got["mae"] == pytest.approx(skm.mean_absolute_error(y64, o64), rel=1e-12)
    assert got["r2"] == pytest.approx(skm.r2_score(y64, o64), rel=1e-9)
    uncentred = reduce(MetricSet("mse", [Metric("r2")], 2, n), out, y)["r2"]
    assert abs(uncentred - skm.r2_score(y64, o64)) > 1e-6  # the defect the centre removes


def test_r2_of_a_constant_target_follows_sklearn():
    y = np.ones((10, 1), np.float32)
    ms = MetricSet("mse", [Metric("r2")], 1, 10)
    assert reduce(ms, y.copy(), y)["r2"] == skm.r2_score(y, y) == 1.0
    assert reduce(ms, y + 1, y)["r2"] == skm.r2_score(y, y + 1) == 0.0


def test_loss_is_the_frameworks_sum_and_empty_validation_is_nan():
    ms = MetricSet("cross_entropy", [Metric("accuracy"), Metric("f1")], 3, 0)
    got = ms.values(np.zeros(ms.size))
    assert got["samples"] == 0 and np.isnan(got["loss"]) and np.isnan(got["accuracy"]) and np.isnan(got["f1"])
    out = np.eye(3, dtype=np.float32)
    losses = np.array([0.5, 1.0, 2.0])
    assert reduce(MetricSet("cross_entropy", [], 3, 3), out, np.arange(3), loss_sums=losses)["loss"] == 3.5 / 3


def test_head_alone_is_the_layout_of_accuracy():
    """Accuracy, mse and mae come from the head: 4 values per batch and the count (size 5)."""
    ms = MetricSet("cross_entropy", [Metric("accuracy")], 3, 10)
    assert ms.size == HEAD + 1 == 5
    out, y = np.eye(3, dtype=np.float32), np.array([0, 2, 2])
    assert batch_stats("cross_entropy", 1.0, out, y).tolist() == [1.0, 2.0, 0.0, 0.0]
    assert head_sums("mse", 0.0, np.zeros((2, 2), np.float32), np.array([[1, 3], [0, 0]], np.float32)).tolist() \
        == [0.0, 0.0, 5.0, 2.0]  # per sample: the mean over outputs


def test_outputs_that_do_not_match_the_classes_are_named():
    ms = MetricSet("cross_entropy", [Metric("f1")], 4, 3)
    with pytest.raises(Exception, match="model outputs 3 class scores per sample, the data has 4 classes"):
        batch_stats("cross_entropy", 0.0, np.zeros((3, 3), np.float32), np.zeros(3, np.int64), ms, np.arange(3))


# ----------------------------------------------------------------------------- config



def load(tmp_path: Path, text: str):
    p = tmp_path / "exp.yaml"
    p.write_text(BASE + text)
    return load_config(p), p


def test_metric_names_and_top_k_forms(tmp_path):
    cfg, _ = load(tmp_path, "metrics: [accuracy, top_k_accuracy, {top_k_accuracy: {k: 3}}, f1, roc_auc]\n")
    ms = MetricSet("cross_entropy", parse_metrics(cfg), 10, 5)
    assert [m.key for m in ms.metrics] == ["accuracy", "top_5_accuracy", "top_3_accuracy", "f1", "roc_auc"]
    cfg, _ = load(tmp_path, "loss: mse\nmetrics: [r2]\n")
    assert cfg.metrics == ["r2"]


@pytest.mark.parametrize("text,line,message", [
    ("metrics: [accuracy, f2]\n", 8, "metrics[1]: unknown metric 'f2'; expected one of accuracy, top_k_accuracy"),
    ("metrics:\n  - accuracy\n  - r2\n", 10, "metrics[1]: r2 needs a regression loss (mse or mae), got "
                                            "loss='cross_entropy'"),
    ("loss: mse\nmetrics: [mae, roc_auc]\n", 9, "metrics[1]: roc_auc needs class probabilities (loss "
                                               "cross_entropy: softmax, or binary_cross_entropy: sigmoid), got loss='mse'"),
    ("loss: mse\nmetrics: [f1]\n", 9, "metrics[0]: f1 needs a classification loss"),
    ("loss: binary_cross_entropy\nmetrics: [top_k_accuracy]\n", 9, "metrics[0]: top_k_accuracy ranks the scores"),
    ("metrics:\n  - {top_k_accuracy: {k: 0}}\n", 9, "metrics[0].top_k_accuracy: expected {k: N} with an integer N >= 1"),
    ("metrics:\n  - {top_k_accuracy: 3}\n", 9, "metrics[0].top_k_accuracy: expected {k: N}"),
    ("metrics:\n  - {f1: {k: 3}}\n", 9, "metrics[0]: expected a metric name or {top_k_accuracy: {k: N}}"),
    ("metrics: [f1, accuracy, f1]\n", 8, "metrics[2]: f1 is listed twice"),
])
def test_metric_errors_are_located(tmp_path, text, line, message):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, text)
    assert str(e.value).startswith(f"{tmp_path / 'exp.yaml'}:{line}: {message}"), str(e.value)


def test_top_k_needs_more_classes_than_k(tmp_path):
    cfg, p = load(tmp_path, "metrics:\n  - accuracy\n  - {top_k_accuracy: {k: 10}}\n")
    check_metrics(cfg, 11)
    with pytest.raises(ConfigError) as e:
        check_metrics(cfg, 10)
    assert str(e.value).startswith(f"{p}:10: metrics[1]: top_k_accuracy with k=10 needs more than 10 classes")


class Ranks:
    """`n` in-process ranks (threads) whose gather_bytes / broadcast_object meet at a barrier:
    the collectives MetricSet.reduce_scores uses, as hvtrain.runtime.horovod.Runtime has them."""

    def __init__(self, n: int) -> None:
        self.n, self.barrier, self.slots = n, threading.Barrier(n), [None] * n

    def runtime(self, rank: int) -> SimpleNamespace:
        def exchange(value):
            self.slots[rank] = value
            self.barrier.wait()
            got = list(self.slots)
            self.barrier.wait()
            return got

        def gather_bytes(blob: bytes) -> list[bytes] | None:
            got = exchange(blob)
            return got if rank == 0 else None

        return SimpleNamespace(gather_bytes=gather_bytes, broadcast_object=lambda obj: exchange(obj)[0])


class Labels:
    """A split as MetricSet.of reads it: its labels and its length."""

    def __init__(self, y: np.ndarray) -> None:
        self.y = y

    def __len__(self) -> int:
        return len(self.y)


def evaluate_on_ranks(make, out: np.ndarray, y: np.ndarray, ranks: int = 3, batch: int = 7):
    """Each rank its own MetricSet (`make()`), its share batch by batch, the vectors summed (the
    allreduce), then reduce_scores on every rank at once (threads) and values()."""
    sets = [make() for _ in range(ranks)]
    total = np.zeros(sets[0].size)
    for r, ms in enumerate(sets):
        ms.begin()
        idx = np.arange(r, len(y), ranks)
        mine = np.zeros(ms.size - 1)
        for start in range(0, len(idx), batch):
            chunk = idx[start: start + batch]
            mine += batch_stats(ms.loss, 0.0, out[chunk], y[chunk], ms, chunk)
        total += np.concatenate([mine, [len(idx)]])
    world = Ranks(ranks)
    threads = [threading.Thread(target=ms.reduce_scores, args=(world.runtime(r),)) for r, ms in enumerate(sets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sets, [ms.values(total) for ms in sets]


def test_roc_scores_are_gathered_once_per_evaluation_not_summed_in_every_batch():
    """Defect: the ROC-AUC scores were a num_val x (classes + 1) block of the evaluation vector,
    allocated and added on every evaluation batch (0.4 GB per rank and batch at 50k x 1000).
    The vector is now independent of the validation size; the rows are gathered on rank 0 once
    and every rank gets scikit-learn's value."""
    assert MetricSet("cross_entropy", [Metric("roc_auc")], 1000, 50_000).size == HEAD + 1
    rng = np.random.default_rng(5)
    n, c = 103, 6
    out = (rng.standard_normal((n, c)) * 2).astype(np.float32)
    out[:20] = np.round(out[:20])  # ties
    y = rng.integers(0, c, n)
    sets, got = evaluate_on_ranks(lambda: MetricSet("cross_entropy", [Metric("roc_auc"), Metric("f1")], c, n), out, y)
    proba = softmax(out.astype(np.float64), axis=1)
    expect = skm.roc_auc_score(y, proba, multi_class="ovr", labels=range(c))
    assert [g["roc_auc"] for g in got] == pytest.approx([expect] * 3, rel=1e-12)
    np.testing.assert_array_equal(sets[0].last_scores[0], proba)  # rank 0 holds every row, in order
    np.testing.assert_array_equal(sets[0].last_scores[1], y)
    assert sets[1].last_scores is None and sets[2].last_scores is None
    z = out[:, 0]  # binary: one score column
    yb = (z > 0.3).astype(np.int64) ^ (rng.random(n) < 0.2)
    _, got = evaluate_on_ranks(lambda: MetricSet("binary_cross_entropy", [Metric("roc_auc")], 1, n), z[:, None], yb)
    assert got[2]["roc_auc"] == pytest.approx(skm.roc_auc_score(yb, expit(z.astype(np.float64))), rel=1e-12)
    # a second evaluation of the same sets starts from nothing (begin): the same value again
    ms = MetricSet("cross_entropy", [Metric("roc_auc")], c, n)
    first = reduce(ms, out, y)["roc_auc"]
    assert reduce(ms, out, y)["roc_auc"] == first


def test_multiclass_roc_auc_with_a_class_absent_from_validation_is_nan_as_sklearn():
    """Defect: the macro mean ran over the classes present in the labels, a value scikit-learn
    never gives (it raises without labels=, and gives NaN with labels=range(classes)). Now NaN,
    with a note at the start naming the absent classes."""
    rng = np.random.default_rng(0)
    n, c = 41, 4
    out = rng.standard_normal((n, c)).astype(np.float32)
    y = rng.choice([0, 1, 3], size=n)  # class 2 never occurs
    got = reduce(MetricSet("cross_entropy", [Metric("roc_auc")], c, n), out, y)
    with pytest.warns(UserWarning):
        expect = skm.roc_auc_score(y, softmax(out.astype(np.float64), axis=1), multi_class="ovr", labels=range(c))
    assert np.isnan(expect) and np.isnan(got["roc_auc"])
    cfg = load_config({"name": "t", "data": {"dataset": "sklearn:digits"}, "metrics": ["roc_auc"],
                       "model": {"input_shape": [64], "layers": [{"type": "dense", "units": c}]}})
    data = SimpleNamespace(num_outputs=c, val=Labels(y), train=Labels(y[:0]))
    assert MetricSet.of(cfg, data).notes == [
        "roc_auc will be NaN: class id(s) [2] never occur in the validation labels (the AUC of a class needs "
        "positives and negatives of it; scikit-learn's roc_auc_score with labels=range(classes) gives NaN too)"]


@pytest.mark.parametrize("n,const,center", [(359, 5.0, 4.3), (1000, 0.1, 0.0), (359, 3.7, 1.0)])
def test_r2_of_a_target_constant_in_validation_but_off_centre(n, const, center):
    """Defect: for a target constant on the validation split, SS_tot = s2 - s1^2/n cancelled to
    rounding noise (~1e-12) instead of 0, and R2 came out as 1.65e12. scikit-learn (force_finite,
    its default) scores a constant target 0 when not predicted exactly; where its own mean is
    exact (5.0 x 359) it gives that, where its mean rounds it gives noise too (-2.6e27 for
    0.1 x 1000), so the reference is its value of the other target averaged with 0."""
    rng = np.random.default_rng(1)
    y = np.full((n, 2), const)
    y[:, 0] = rng.normal(size=n)
    out = y + rng.normal(scale=0.1, size=y.shape)
    got = reduce(MetricSet("mse", [Metric("r2")], 2, n, center=np.array([0.0, center])), out, y)
    assert got["r2"] == pytest.approx((skm.r2_score(y[:, 0], out[:, 0]) + 0.0) / 2, rel=1e-9)
    if (n, const) == (359, 5.0):
        assert got["r2"] == pytest.approx(skm.r2_score(y, out), rel=1e-9)
    exact = y.copy()
    assert reduce(MetricSet("mse", [Metric("r2")], 2, n, center=np.array([0.0, center])), exact, y)["r2"] == 1.0


def test_r2_of_one_validation_sample_is_nan_as_sklearn():
    """Defect: one sample gave 0.0; scikit-learn's r2_score is undefined (NaN) below two."""
    y, out = np.array([[1.0, 2.0]]), np.array([[1.5, 2.5]])
    with pytest.warns(UserWarning):
        assert np.isnan(skm.r2_score(y, out))
    assert np.isnan(reduce(MetricSet("mse", [Metric("r2")], 2, 1), out, y, ranks=1)["r2"])
