"""`hvtrain report` (issue 12, item 4) on run directories written here by hand (no framework):
the pictures exist, open, are of a sensible size and not blank, report.md embeds them, the ROC
math equals scikit-learn's, and a directory that is not a run is one error line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from hvtrain.cli import cli
from hvtrain.tools.report import auc, confusion, read_run, roc_curve, write_report

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ["cat", "dog", "eel"]


def make_run(path: Path, *, sizes=(2, 2, 2, 2), confusion_metric=True, scores=True, classes=CLASSES,
             binary=False, seed=0) -> Path:
    """A run directory as the trainer writes it: metrics.jsonl, summary.json, val_scores.npz and
    final.safetensors (header metadata only matters: the inputs record's classes)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    c = 2 if binary else len(classes)
    path.mkdir(parents=True)
    n = 90
    labels = np.arange(n) % c
    logits = rng.normal(size=(n, c)) + 2.0 * np.eye(c)[labels]
    proba = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    cm = np.bincount(labels * c + proba.argmax(axis=1), minlength=c * c).reshape(c, c)
    with (path / "metrics.jsonl").open("w") as fh:
        for e, size in enumerate(sizes, start=1):
            record = {"epoch": e, "train_loss": 1.0 / e, "val_loss": 1.2 / e ** 0.5, "val_accuracy": 0.5 + 0.1 * e,
                      "val_f1": 0.45 + 0.1 * e, "val_f1_per_class": [0.5] * c, "val_log_loss": 1.1 / e,
                      "val_samples": n, "samples_per_sec": 1000.0 * size, "lr": 0.1, "world_size": size}
            if confusion_metric:
                record["val_confusion_matrix"] = cm.tolist()
            fh.write(json.dumps(record) + "\n")
        fh.write('{"epoch": 5, "train_lo')  # a line cut short by a kill: skipped
    (path / "summary.json").write_text(json.dumps({"name": "toy", "backend": "torch", "elastic": False,
                                                   "total_seconds": 3.5}))
    if scores:
        s = proba[:, 1:] if binary else proba
        np.savez(path / "val_scores.npz", scores=s, labels=labels, epoch=np.array(len(sizes)))
    record = {"version": 1, "classes": classes if not binary else classes[:2]}
    save_file({"layers.0.kernel": np.zeros((2, 2), np.float32)}, str(path / "final.safetensors"),
              metadata={"inputs": json.dumps(record)})
    return path


def looks_like_a_picture(png: Path) -> tuple[int, int]:
    with Image.open(png) as im:
        assert im.format == "PNG"
        w, h = im.size
        pixels = np.asarray(im.convert("L"), np.float64)
    assert 500 <= w <= 2000 and 350 <= h <= 2000, (png.name, w, h)
    assert pixels.std() > 10, (png.name, pixels.std())  # not blank: a plain white image has std 0
    assert (pixels < 100).mean() > 0.002, png.name  # some dark ink: text, lines
    return w, h


def test_report_writes_every_picture_and_embeds_them(tmp_path):
    run = make_run(tmp_path / "run", sizes=(2, 2, 4, 4))
    r = CliRunner().invoke(cli, ["report", str(run)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = run / "report"
    names = ["loss", "metrics", "confusion_matrix", "roc", "world_size"]
    assert sorted(p.stem for p in out.glob("*.png")) == sorted(names)
    for name in names:
        looks_like_a_picture(out / f"{name}.png")
    md = (out / "report.md").read_text()
    for name in names:
        assert f"]({name}.png)" in md
    assert "| val_accuracy | 0.9 |" in md and "Not shown" not in md
    assert r.output.startswith(f"report: {out / 'report.md'}")


def test_pictures_open_in_matplotlib_too(tmp_path):
    import matplotlib.image as mpimg

    run = make_run(tmp_path / "run")
    write_report(run, tmp_path / "out")
    img = mpimg.imread(tmp_path / "out" / "confusion_matrix.png")
    assert img.ndim == 3 and img.shape[0] > 300 and img[..., :3].std() > 0.05


def test_world_size_only_when_it_changed(tmp_path):
    result = write_report(make_run(tmp_path / "run", sizes=(2, 2, 2)))
    assert "world_size" not in result["figures"] and "roc" in result["figures"]


def test_missing_data_is_said_not_drawn(tmp_path):
    result = write_report(make_run(tmp_path / "run", confusion_metric=False, scores=False))
    assert set(result["figures"]) == {"loss", "metrics"}
    md = Path(result["report"]).read_text()
    assert "no ROC curve" in md and "roc_auc" in md and "no confusion matrix" in md


def test_confusion_from_scores_when_the_metric_was_not_listed(tmp_path):
    from sklearn.metrics import confusion_matrix

    run = read_run(make_run(tmp_path / "run", confusion_metric=False))
    cm, where = confusion(run)
    assert "val_scores.npz" in where
    assert cm.tolist() == confusion_matrix(run.labels, run.scores.argmax(axis=1)).tolist()
    binary = read_run(make_run(tmp_path / "bin", confusion_metric=False, binary=True))
    cm, _ = confusion(binary)
    assert cm.tolist() == confusion_matrix(binary.labels, binary.scores[:, 0] > 0.5).tolist()


def test_class_names_come_from_the_weights_inputs_record(tmp_path):
    assert read_run(make_run(tmp_path / "run")).classes == CLASSES


@pytest.mark.parametrize("ties", [False, True])
def test_roc_curve_and_auc_equal_scikit_learn(ties):
    from sklearn.metrics import roc_auc_score
    from sklearn.metrics import roc_curve as sk_roc

    rng = np.random.default_rng(3)
    scores = rng.random(500)
    if ties:
        scores = np.round(scores, 1)  # many equal scores
    positive = rng.random(500) < scores
    fpr, tpr = roc_curve(scores, positive)
    assert auc(fpr, tpr) == pytest.approx(roc_auc_score(positive, scores), abs=1e-12)
    sk_fpr, sk_tpr, _ = sk_roc(positive, scores, drop_intermediate=False)
    np.testing.assert_allclose(fpr, sk_fpr, atol=1e-12)
    np.testing.assert_allclose(tpr, sk_tpr, atol=1e-12)


def test_roc_caption_auc_is_the_ovr_macro_auc(tmp_path):
    from sklearn.metrics import roc_auc_score

    run = make_run(tmp_path / "run")
    result = write_report(run)
    z = np.load(run / "val_scores.npz")
    want = roc_auc_score(z["labels"], z["scores"], multi_class="ovr")
    assert f"AUC from the curve: {want:.4f}" in Path(result["report"]).read_text()


@pytest.mark.parametrize("make,expected", [
    (lambda p: p, "no such directory"),
    (lambda p: (p.mkdir(), p)[1], "got a directory without one"),
    (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_text("garbage\n"), p)[2], "got none"),
    (lambda p: (p.write_text("x"), p)[1], "got a file"),
])
def test_not_a_run_dir_is_one_line_exit_2(tmp_path, make, expected):
    target = make(tmp_path / "nope")
    r = CliRunner().invoke(cli, ["report", str(target)])
    assert r.exit_code == 2
    lines = r.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hvtrain: error: ") and expected in lines[0], r.output
    assert "expected" in lines[0]


def test_report_imports_no_framework(tmp_path):
    from tests.support.configs import LIGHT

    run = make_run(tmp_path / "run")
    proc = subprocess.run([sys.executable, "-c", LIGHT, "report", str(run)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (run / "report" / "roc.png").is_file()


# ----------------------------------------------------------------------------- issue 12 review


def _report_cli(*args):
    r = CliRunner().invoke(cli, ["report", *map(str, args)])
    return r, r.output.splitlines()


@pytest.mark.parametrize("damage,expected", [
    (lambda p: p.write_bytes(b"PK\x03\x04 cut short"), "unreadable file (BadZipFile"),
    (lambda p: p.write_bytes(b""), "unreadable file"),
    (lambda p: np.savez(p, scores=np.ones((5, 3)), labels=np.arange(4), epoch=np.array(1)), "labels of shape [4]"),
    (lambda p: np.savez(p, scores=np.ones((5, 3)), labels=np.arange(5), epoch=np.array(1)), "class ids 0..4 for 3"),
    (lambda p: np.savez(p, scores=np.ones(5), labels=np.zeros(5, int), epoch=np.array(1)), "scores of shape [5]"),
])
def test_corrupt_or_inconsistent_scores_are_one_line_exit_2(tmp_path, damage, expected):
    """Once a traceback (BadZipFile, IndexError in bincount); now one located line naming the fix."""
    run = make_run(tmp_path / "run", confusion_metric=False)
    damage(run / "val_scores.npz")
    r, lines = _report_cli(run)
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "val_scores.npz" in lines[0] and expected in lines[0] and "delete it" in lines[0], r.output


def test_output_path_that_is_a_file_is_one_line_exit_2(tmp_path):
    """Once FileExistsError's traceback."""
    run = make_run(tmp_path / "run")
    (tmp_path / "taken").write_text("x")
    for out in (tmp_path / "taken", tmp_path / "taken" / "sub"):
        r, lines = _report_cli(run, "-o", out)
        assert r.exit_code == 2 and len(lines) == 1 and "expected a directory for the report" in lines[0], r.output
    assert (tmp_path / "taken").read_text() == "x"


def test_scores_of_a_later_epoch_than_the_records_are_another_runs(tmp_path):
    """A stale val_scores.npz (written after metrics.jsonl's last epoch) is not drawn, said once."""
    run = make_run(tmp_path / "run", confusion_metric=False)
    z = dict(np.load(run / "val_scores.npz"))
    np.savez(run / "val_scores.npz", **{**z, "epoch": np.array(9)})
    result = write_report(run)
    assert "roc" not in result["figures"]
    notes = [m for m in result["missing"] if m.startswith("no ROC curve")]
    assert len(notes) == 1 and "another run's scores" in notes[0], result["missing"]


def test_a_metric_nan_in_every_epoch_gets_a_note_not_an_empty_panel(tmp_path):
    run = make_run(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(ln) for ln in lines[:-1]]
    (run / "metrics.jsonl").write_text("".join(json.dumps({**r, "val_roc_auc": float("nan")}) + "\n"
                                               for r in records))
    from hvtrain.tools.report import plot_metrics

    loaded = read_run(run)
    fig, _ = plot_metrics(loaded)
    titles = [ax.get_title() for ax in fig.axes]
    assert not any("roc_auc" in t for t in titles), titles
    assert any("roc_auc is NaN" in n for n in loaded.notes)
    md = Path(write_report(run)["report"]).read_text()
    assert "no roc_auc curve: val_roc_auc is NaN (or missing) in every epoch" in md


def test_roc_title_says_macro_over_the_classes_present(tmp_path):
    """A class absent from the validation set: metrics.jsonl's roc_auc is NaN, the picture's macro
    AUC is over the classes present, and its title must say so."""
    from hvtrain.tools.report import plot_roc

    run = read_run(make_run(tmp_path / "run", classes=["a", "b", "c", "d"]))
    keep = run.labels != 3
    run.scores, run.labels = run.scores[keep], run.labels[keep]
    fig, caption = plot_roc(run)
    assert "macro AUC over 3 of 4 classes" in fig.axes[0].get_title()
    assert "over 3 of 4 classes" in caption
    full, _ = plot_roc(read_run(make_run(tmp_path / "all")))
    assert "over" not in full.axes[0].get_title().split("\n")[0]


def test_a_new_run_removes_the_old_runs_scores(tmp_path):
    """A fresh run cleared metrics.jsonl but left val_scores.npz: a report mid-run mixed the old
    run's ROC with the new curves. A resumed run keeps both."""
    from hvtrain.io.reporter import Reporter
    from hvtrain.launch.process import ProcessInfo

    run = make_run(tmp_path / "run")
    Reporter(ProcessInfo(0, 1), run, keep_metrics=True).close()
    assert (run / "val_scores.npz").is_file() and (run / "metrics.jsonl").is_file()
    Reporter(ProcessInfo(0, 1), run).close()
    assert not (run / "val_scores.npz").exists() and not (run / "metrics.jsonl").exists()


def test_a_report_directory_that_cannot_be_written_is_one_line_exit_2():
    """A colleague's read-only run directory gave PermissionError's traceback. (Tests run as root,
    which writes anywhere a mode allows: sysfs refuses any new directory, to root too.)"""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run = make_run(Path(tmp) / "run")
        r, lines = _report_cli(run, "-o", "/sys/hvtrain-report")
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0].startswith("hvtrain: error: /sys/hvtrain-report: cannot write the report (") and \
        lines[0].endswith("give another directory with -o DIR"), r.output
