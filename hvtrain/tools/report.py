"""`hvtrain report RUN_DIR`: pictures of a finished (or running) training run, and report.md.

Everything is read from files the run wrote; no framework is imported and nothing is recomputed
by a model:
  - metrics.jsonl: per epoch train_loss, val_loss, every scalar metric, world_size -> loss.png,
    metrics.png, world_size.png (only when the world size changed or the run was elastic);
  - the last record's `val_confusion_matrix` (metric confusion_matrix), or else the argmax of the
    saved validation scores -> confusion_matrix.png;
  - val_scores.npz: the last evaluation's scores of every validation sample, which the trainer
    saves when `roc_auc` is among the metrics (the evaluation allreduce already gave rank 0 all of
    them) -> roc.png (binary, or one-vs-rest per class);
  - summary.json, manifest.json and final.safetensors' `inputs` metadata (class labels) for titles.
A picture whose data the run did not record is left out, and report.md says which metric to add.
Plotting uses matplotlib's object API with the Agg canvas (no display, no pyplot state).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hvtrain.errors import DataError, HvtrainError
from hvtrain.io.reporter import METRICS_FILE, SCORES_FILE, file_in_the_way, metrics_lines

# Scores in [0, 1] that share one axis; any other scalar metric gets its own panel.
UNIT_SCORES = ("accuracy", "precision", "recall", "f1")  # roc_auc (near 1) gets its own panel
DPI = 110
MAX_ANNOTATED = 20  # classes beyond which confusion-matrix cells are not annotated
MAX_ROC_LEGEND = 10  # classes beyond which one-vs-rest curves are drawn thin without a legend entry


@dataclass
class Run:
    """What a run directory holds, as read from its files."""

    path: Path
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    manifest: dict[str, Any]
    classes: list[str] | None  # display names of class ids 0..C-1 (final.safetensors' inputs record)
    scores: np.ndarray | None = None  # [n, 1] P(class 1) or [n, C]
    labels: np.ndarray | None = None  # class ids
    scores_epoch: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        name = self.summary.get("name") or self.path.name
        backend = self.summary.get("backend") or self.manifest.get("backend")
        sizes = sorted({r.get("world_size") for r in self.records if r.get("world_size")})
        ranks = "-".join(str(s) for s in (sizes[:1] + sizes[-1:] if len(sizes) > 1 else sizes))
        return f"{name}" + (f" ({backend}, {ranks} rank{'s' if ranks != '1' else ''})" if backend and ranks else "")


def read_run(run_dir: str | Path) -> Run:
    """The run's records and facts.

    Raises:
        DataError: not a run directory (no metrics.jsonl with at least one epoch record).
    """
    path = Path(run_dir)
    metrics = path / METRICS_FILE
    if not path.is_dir():
        raise DataError(f"{path}: expected a run directory (a training run's output_dir), got "
                        + ("a file" if path.exists() else "nothing: no such directory"))
    if not metrics.is_file():
        raise DataError(f"{path}: expected a run directory holding {METRICS_FILE} (a training run's output_dir), "
                        "got a directory without one")
    records = [record for _, record in metrics_lines(metrics) if isinstance(record.get("epoch"), int)]
    if not records:
        raise DataError(f"{metrics}: expected one JSON record per epoch, got none (has the run finished an epoch?)")
    run = Run(path, records, _json(path / "summary.json"), _json(path / "manifest.json"),
              _class_names(path / "final.safetensors"))
    scores = path / SCORES_FILE
    if scores.is_file():
        _read_scores(run, scores)
    return run


def _read_scores(run: Run, path: Path) -> None:
    """val_scores.npz into `run`, checked: [n, 1] or [n, C] finite-or-NaN scores, n class ids in
    0..C-1 (binary: 0..1), an epoch no later than the last record's (else it is another run's).

    Raises:
        DataError: an unreadable or inconsistent file (one line; deleting it reports without it).
    """
    import zipfile

    fix = "delete it to report without the ROC curve"
    try:
        with np.load(path, allow_pickle=False) as z:
            scores, labels, epoch = np.asarray(z["scores"]), np.asarray(z["labels"]), np.asarray(z["epoch"])
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: expected the trainer's validation scores (scores, labels, epoch), got an "
                        f"unreadable file ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                        f"{fix}") from None
    c = 2 if scores.ndim == 2 and scores.shape[1] == 1 else (scores.shape[1] if scores.ndim == 2 else 0)
    problem = None
    if scores.ndim != 2 or scores.shape[1] == 0 or not np.issubdtype(scores.dtype, np.number):
        problem = f"scores of shape {list(scores.shape)} ({scores.dtype}), expected [n, 1] or [n, classes]"
    elif labels.ndim != 1 or len(labels) != len(scores) or not np.issubdtype(labels.dtype, np.integer):
        problem = f"labels of shape {list(labels.shape)} ({labels.dtype}) for {len(scores)} score rows"
    elif len(labels) and (labels.min() < 0 or labels.max() >= c):
        problem = f"class ids {int(labels.min())}..{int(labels.max())} for {c} classes"
    elif epoch.shape != () or not np.issubdtype(epoch.dtype, np.integer):
        problem = f"epoch {epoch.tolist()!r}, expected one integer"
    if problem:
        raise DataError(f"{path}: inconsistent validation scores: {problem}; {fix}")
    last = run.records[-1]["epoch"]
    if int(epoch) > last:
        run.notes.append(f"no ROC curve: {SCORES_FILE} is from epoch {int(epoch)}, after metrics.jsonl's last "
                         f"epoch {last} (another run's scores)")
        return
    run.scores, run.labels, run.scores_epoch = scores.astype(np.float64), labels.astype(np.int64), int(epoch)


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Every picture the run's files allow, and report.md embedding them, in `out_dir` (default
    RUN_DIR/report). Returns {"report": path of report.md, "figures": {name: path}, "missing": [...]}.

    Raises:
        DataError: not a run directory.
        HvtrainError: matplotlib is not installed.
    """
    run = read_run(run_dir)
    try:
        from matplotlib.figure import Figure  # noqa: F401 - availability check before any work
    except ImportError:
        raise HvtrainError("hvtrain report needs matplotlib: pip install 'hvtrain[report]'") from None
    out = Path(out_dir) if out_dir is not None else run.path / "report"
    blocked = file_in_the_way(out)
    if blocked is not None:
        raise DataError(f"{out}: expected a directory for the report, got {blocked}")
    try:
        return _draw(run, out)
    except OSError as exc:  # a colleague's read-only run directory, a full disk
        raise DataError(f"{out}: cannot write the report ({exc.strerror or exc}); give another directory with "
                        "-o DIR") from None


def _draw(run: Run, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Path] = {}
    captions: dict[str, str] = {}
    missing: list[str] = []
    for name, plot in (("loss", plot_loss), ("metrics", plot_metrics), ("confusion_matrix", plot_confusion),
                       ("roc", plot_roc), ("world_size", plot_world_size)):
        made = plot(run)
        if isinstance(made, str):
            missing.append(made)
            continue
        if made is None:
            continue
        fig, caption = made
        target = out / f"{name}.png"
        fig.savefig(target, dpi=DPI)
        figures[name], captions[name] = target, caption
    missing = [*run.notes, *missing]  # notes from reading the files and from drawing (metrics NaN throughout)
    report = out / "report.md"
    report.write_text(markdown(run, figures, captions, missing, out))
    return {"report": str(report), "figures": {k: str(v) for k, v in figures.items()}, "missing": missing}


# ----------------------------------------------------------------------------- pictures


def _figure(width: float = 7.0, height: float = 4.2):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _epochs_axis(ax, epochs: list[int]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(epochs) == 1:
        ax.set_xlim(epochs[0] - 1, epochs[0] + 1)
    ax.grid(True, alpha=0.3)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["epoch"], float(r[key])) for r in records
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
    return [e for e, _ in pts], [v for _, v in pts]


def plot_loss(run: Run):
    fig = _figure()
    ax = fig.add_subplot()
    values = []
    for key, label, style in (("train_loss", "train", "o-"), ("val_loss", "validation", "s-")):
        x, y = _series(run.records, key)
        if x:
            ax.plot(x, y, style, label=f"{label} (last {y[-1]:.4g})", markersize=4)
            values += y
    if not values:
        return "no loss curve: metrics.jsonl has no train_loss or val_loss values"
    positive = [v for v in values if v > 0]
    log = len(positive) == len(values) and max(values) / min(positive) > 20
    if log:
        ax.set_yscale("log")
    ax.set_ylabel("loss" + (" (log scale)" if log else ""))
    ax.set_title(f"Loss per epoch: {run.title}")
    ax.legend()
    _epochs_axis(ax, [r["epoch"] for r in run.records])
    return fig, "Training loss (mean over the epoch's steps) and validation loss (after the epoch), per epoch."


def scalar_metrics(records: list[dict[str, Any]]) -> list[str]:
    """The validation metrics recorded as numbers (not loss, samples or per-class lists), in order."""
    keys: list[str] = []
    for r in records:
        for k, v in r.items():
            if (k.startswith("val_") and k not in ("val_loss", "val_samples") and k not in keys
                    and isinstance(v, (int, float)) and not isinstance(v, bool)):
                keys.append(k)
    return keys


def _unit_score(key: str) -> bool:
    name = key[len("val_"):]
    return name.split("_weighted")[0] in UNIT_SCORES or (name.startswith("top_") and name.endswith("_accuracy"))


def plot_metrics(run: Run):
    keys = scalar_metrics(run.records)
    empty = [k for k in keys if not _series(run.records, k)[0]]
    run.notes.extend(f"no {k[4:]} curve: {k} is NaN (or missing) in every epoch" for k in empty)
    keys = [k for k in keys if k not in empty]
    if not keys:
        return None if empty else "no metric curves: metrics.jsonl has no validation metrics besides the loss"
    unit = [k for k in keys if _unit_score(k)]
    panels = ([unit] if unit else []) + [[k] for k in keys if k not in unit]
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = _figure(7.0 if cols == 1 else 11.0, 4.2 if rows == 1 else 3.4 * rows)
    epochs = [r["epoch"] for r in run.records]
    for i, group in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        for key in group:
            x, y = _series(run.records, key)
            if x:
                ax.plot(x, y, "o-", markersize=3.5, label=f"{key[4:]} (last {y[-1]:.4f})")
        ax.set_ylabel("score" if group is unit else group[0][4:])
        ax.set_title("validation scores" if group is unit else f"validation {group[0][4:]}")
        if group is unit:
            ax.legend(loc="lower right", fontsize="small")
        _epochs_axis(ax, epochs)
    fig.suptitle(f"Validation metrics per epoch: {run.title}")
    return fig, "Validation metrics after each epoch (scores in [0, 1] share the first panel)."


def confusion(run: Run) -> tuple[np.ndarray, str] | str:
    """The last evaluation's confusion matrix and where it came from."""
    for r in reversed(run.records):
        cm = r.get("val_confusion_matrix")
        if isinstance(cm, list) and cm:
            return np.asarray(cm, np.int64), f"epoch {r['epoch']} (metrics.jsonl)"
    if run.scores is not None:
        c = 2 if run.scores.shape[1] == 1 else run.scores.shape[1]
        pred = (run.scores[:, 0] > 0.5).astype(np.int64) if c == 2 else run.scores.argmax(axis=1)
        cm = np.bincount(run.labels * c + pred, minlength=c * c).reshape(c, c)
        return cm, f"epoch {run.scores_epoch} ({SCORES_FILE})"
    return ("no confusion matrix: the run recorded neither the confusion_matrix metric nor validation scores; "
            "add confusion_matrix (or roc_auc) to metrics:")


def _names(run: Run, c: int) -> list[str]:
    if run.classes is not None and len(run.classes) == c:
        return run.classes
    return [str(i) for i in range(c)]


def plot_confusion(run: Run):
    if not _classification(run):
        return None
    got = confusion(run)
    if isinstance(got, str):
        return got
    cm, where = got
    c = len(cm)
    names = _names(run, c)
    rows = cm.sum(axis=1, keepdims=True)
    frac = np.divide(cm, rows, out=np.zeros(cm.shape), where=rows > 0)
    side = min(11.0, max(5.0, 0.5 * c + 2.5))
    fig = _figure(side + 1.2, side)
    ax = fig.add_subplot()
    image = ax.imshow(frac, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, shrink=0.8, label="fraction of the true class")
    if c <= MAX_ANNOTATED:
        for i in range(c):
            for j in range(c):
                if cm[i, j] or i == j:
                    ax.text(j, i, str(cm[i, j]), ha="center", va="center", fontsize=9 if c <= 12 else 7,
                            color="white" if frac[i, j] > 0.5 else "black")
    step = max(1, math.ceil(c / 30))
    ticks = list(range(0, c, step))
    ax.set_xticks(ticks, [names[t] for t in ticks], rotation=45 if max(len(n) for n in names) > 3 else 0,
                  ha="right" if max(len(n) for n in names) > 3 else "center")
    ax.set_yticks(ticks, [names[t] for t in ticks])
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    total, correct = int(cm.sum()), int(np.trace(cm))
    ax.set_title(f"Confusion matrix, {where.split(' (')[0]}: {correct}/{total} correct "
                 f"({correct / max(total, 1):.1%})\n{run.title}", fontsize=11)
    return fig, (f"Confusion matrix of the validation set at {where}: rows are the true class, columns the "
                 "predicted class; cells show counts, colour the fraction of the row.")


def roc_curve(scores: np.ndarray, positive: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """False and true positive rates at every distinct score threshold (from (0, 0) to (1, 1)),
    scikit-learn's roc_curve without dropping collinear points."""
    order = np.argsort(-scores, kind="mergesort")
    s, p = scores[order], positive[order].astype(np.float64)
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # the last index of each distinct score
    tps, fps = np.cumsum(p)[last], (last + 1) - np.cumsum(p)[last]
    return np.r_[0.0, fps / max(fps[-1], 1)], np.r_[0.0, tps / max(tps[-1], 1)]


def auc(fpr: np.ndarray, tpr: np.ndarray) -> float:
    return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2.0))


def plot_roc(run: Run):
    if not _classification(run):
        return None
    if run.scores is None:
        if any(n.startswith("no ROC curve") for n in run.notes):
            return None  # already said why (the scores are another run's)
        return ("no ROC curve: the run saved no validation scores; list roc_auc in metrics: and the trainer "
                f"writes the last evaluation's scores to {SCORES_FILE}")
    fig = _figure(6.4, 5.6)
    ax = fig.add_subplot()
    binary = run.scores.shape[1] == 1
    c = 2 if binary else run.scores.shape[1]
    names = _names(run, c)
    aucs = []
    if binary:
        fpr, tpr = roc_curve(run.scores[:, 0], run.labels == 1)
        aucs.append(auc(fpr, tpr))
        ax.plot(fpr, tpr, lw=2, label=f"{names[1]} vs {names[0]} (AUC {aucs[0]:.4f})")
    else:
        present = [k for k in range(c) if 0 < np.sum(run.labels == k) < len(run.labels)]
        colours = _colours(len(present))
        for i, k in enumerate(present):
            fpr, tpr = roc_curve(run.scores[:, k], run.labels == k)
            aucs.append(auc(fpr, tpr))
            legend = len(present) <= MAX_ROC_LEGEND
            ax.plot(fpr, tpr, lw=1.6 if legend else 0.8, alpha=0.9 if legend else 0.5, color=colours[i],
                    label=f"{names[k]} (AUC {aucs[-1]:.4f})" if legend else None)
    ax.plot([0, 1], [0, 1], "--", color="grey", lw=1, label="chance (AUC 0.5)")
    ax.set_xlim(-0.01, 1.01)
    ax.set_ylim(-0.01, 1.01)
    ax.set_aspect("equal")
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.grid(True, alpha=0.3)
    over = "" if binary or len(present) == c else f" over {len(present)} of {c} classes"
    kind = "binary" if binary else f"one-vs-rest, macro AUC{over} {np.mean(aucs):.4f}"
    ax.set_title(f"ROC curve, epoch {run.scores_epoch} ({kind})\n{run.title}", fontsize=11)
    ax.legend(loc="lower right", fontsize="small" if len(aucs) <= 5 else "x-small", ncol=1 if len(aucs) <= 5 else 2)
    if not binary and len(present) > 4:  # the interesting part is the top-left corner: an inset zooms in
        inset = ax.inset_axes([0.42, 0.38, 0.3, 0.3])
        for i, k in enumerate(present):
            fpr, tpr = roc_curve(run.scores[:, k], run.labels == k)
            inset.plot(fpr, tpr, lw=1, color=colours[i])
        inset.set_xlim(0, 0.1)
        inset.set_ylim(0.85, 1.0)
        inset.set_title("zoom: FPR < 0.1", fontsize=7)
        inset.tick_params(labelsize=6)
        inset.grid(True, alpha=0.3)
    what = "P(class 1)" if binary else "each class's probability against all other classes"
    absent = "" if not over else (f" Classes absent from the validation set (or its only class) have no "
                                  f"curve: the macro AUC is{over}, and metrics.jsonl's roc_auc is NaN.")
    return fig, (f"ROC curve of the validation set at epoch {run.scores_epoch} from {SCORES_FILE} ({what}); "
                 f"AUC from the curve: {np.mean(aucs):.4f}.{absent}")


def plot_world_size(run: Run):
    x, sizes = _series(run.records, "world_size")
    elastic = bool(run.summary.get("elastic"))
    if not x or (len(set(sizes)) == 1 and not elastic):
        return None
    fig = _figure(7.0, 3.8)
    ax = fig.add_subplot()
    ax.step(x, sizes, where="mid", color="tab:blue", lw=2, label="world size (ranks)")
    ax.plot(x, sizes, "o", color="tab:blue", markersize=4)
    ax.set_ylabel("ranks", color="tab:blue")
    ax.set_ylim(0, max(sizes) * 1.3 + 0.5)
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    handles = ax.get_legend_handles_labels()
    xs, rate = _series(run.records, "samples_per_sec")
    if xs:
        twin = ax.twinx()
        twin.plot(xs, rate, "s--", color="tab:orange", markersize=3.5, label="training samples/s")
        twin.set_ylabel("training samples/s", color="tab:orange")
        twin.set_ylim(0, max(rate) * 1.3)
        more = twin.get_legend_handles_labels()
        handles = (handles[0] + more[0], handles[1] + more[1])
    ax.legend(*handles, loc="upper left", fontsize="small")
    kind = "elastic run" if elastic else "the world size changed between resumes"
    ax.set_title(f"World size per epoch ({kind})\n{run.title}", fontsize=11)
    _epochs_axis(ax, x)
    return fig, ("Ranks training each epoch (metrics.jsonl `world_size`: the size at the epoch's end) and the "
                 "epoch's training throughput.")


def _colours(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "turbo"]
    return [cmap(i if n <= 10 else i / max(n - 1, 1)) for i in range(n)]


def _classification(run: Run) -> bool:
    return run.scores is not None or any("val_accuracy" in r or "val_confusion_matrix" in r for r in run.records)


# ----------------------------------------------------------------------------- report.md


def markdown(run: Run, figures: dict[str, Path], captions: dict[str, str], missing: list[str], out: Path) -> str:
    last = run.records[-1]
    lines = [f"# Run report: {run.title}", "", f"Run directory: `{run.path}`", ""]
    facts = [("backend", run.summary.get("backend") or run.manifest.get("backend")),
             ("world size", last.get("world_size")), ("epochs recorded", len(run.records)),
             ("elastic", run.summary.get("elastic")), ("total time (s)", _fmt(run.summary.get("total_seconds"))),
             ("hvtrain", run.summary.get("hvtrain_version") or run.manifest.get("hvtrain"))]
    lines += ["| fact | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in facts if v is not None] + [""]
    lines += [f"## Last epoch ({last['epoch']})", "", "| metric | value |", "|---|---|"]
    for k, v in last.items():
        if k in ("train_loss", "val_loss", "samples_per_sec", "lr") or k in scalar_metrics([last]):
            lines.append(f"| {k} | {_fmt(v)} |")
    lines.append("")
    titles = {"loss": "Loss", "metrics": "Metrics", "confusion_matrix": "Confusion matrix", "roc": "ROC curve",
              "world_size": "World size"}
    for name, path in figures.items():
        rel = path.relative_to(out) if path.is_relative_to(out) else path
        lines += [f"## {titles[name]}", "", f"![{titles[name]}]({rel})", "", captions[name], ""]
    if missing:
        lines += ["## Not shown", ""] + [f"- {m}" for m in missing] + [""]
    return "\n".join(lines)


def _fmt(v: Any) -> Any:
    return f"{v:.4g}" if isinstance(v, float) else v


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _class_names(weights: Path) -> list[str] | None:
    """The class labels of final.safetensors' inputs record (header metadata only: no tensor is read)."""
    if not weights.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(weights), framework="numpy") as fh:
            record = json.loads((fh.metadata() or {}).get("inputs", "null"))
    except Exception:  # noqa: BLE001 - a foreign or damaged file only costs the class names
        return None
    classes = record.get("classes") if isinstance(record, dict) else None
    return [str(c) for c in classes] if isinstance(classes, list) else None
