"""TensorBoard event files through the Reporter (rank 0 only), read back with tensorboard's own
EventAccumulator; no framework. The real training run: tests/parallel/test_metrics.py."""

import subprocess
import sys

import numpy as np
import pytest

from hvtrain.config.load import load_config
from hvtrain.errors import ConfigError
from hvtrain.io import tensorboard as tbevents
from hvtrain.io.reporter import Reporter
from hvtrain.launch.process import ProcessInfo
from tests.conftest import ROOT
from tests.conftest import tensorboard_scalars as scalars


def record(epoch: int, loss: float) -> dict:
    return {"epoch": epoch, "train_loss": loss, "val_loss": loss / 3, "val_accuracy": 0.5 + epoch / 100,
            "val_f1_per_class": [0.1, 0.2], "val_confusion_matrix": [[1, 2], [3, 4]], "val_samples": 359,
            "samples_per_sec": 1234.5, "lr": 0.05, "data_wait_s": 0.012, "world_size": 2, "partial": True}


def test_records_become_scalars_at_their_epoch(tmp_path):
    rep = Reporter(ProcessInfo(0, 2), tmp_path, quiet=True, tensorboard=True)
    for epoch in (1, 2):
        rep.append_metrics(record(epoch, 1.0 / epoch))
    rep.close()
    got = scalars(tmp_path / "tensorboard")
    assert sorted(got) == ["train/data_wait_s", "train/loss", "train/lr", "train/samples_per_sec",
                           "train/world_size", "val/accuracy", "val/loss", "val/samples"]  # no lists, flags, epoch
    for epoch in (1, 2):
        r = record(epoch, 1.0 / epoch)
        for key in ("train_loss", "val_loss", "val_accuracy", "samples_per_sec", "lr", "data_wait_s", "world_size"):
            assert got[tbevents.tag(key)][epoch - 1] == (epoch, np.float32(r[key])), key


def test_only_rank_0_writes_and_only_when_switched_on(tmp_path):
    rep = Reporter(ProcessInfo(1, 2), tmp_path, tensorboard=True)
    rep.append_metrics(record(1, 1.0))
    assert not (tmp_path / "tensorboard").exists()
    rep = Reporter(ProcessInfo(0, 2), tmp_path, quiet=True, tensorboard=False)  # output.tensorboard: false
    rep.append_metrics(record(1, 1.0))
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()


@pytest.mark.parametrize("files_before", [0, 9])
def test_fresh_run_drops_old_events_and_resume_rewrites_from_its_checkpoint(tmp_path, monkeypatch, files_before):
    """files_before 9: the resumed run's file is this process's 11th (a counter of 9 and 10 in the
    same second: unpadded, "10" sorted before "9" and TensorBoard read the resume first)."""
    import itertools

    monkeypatch.setattr(tbevents, "_files", itertools.count(files_before))
    first = Reporter(ProcessInfo(0, 1), tmp_path, quiet=True, tensorboard=True)
    for epoch in (1, 2, 3):
        first.append_metrics(record(epoch, 10.0 + epoch))
    first.close()
    # resumed from a checkpoint after epoch 1: epochs 2.. are written again, in a second file
    resumed = Reporter(ProcessInfo(0, 1), tmp_path, quiet=True, keep_metrics=True, tensorboard=True)
    resumed.truncate_metrics(1)
    for epoch in (2, 3, 4):
        resumed.append_metrics(record(epoch, 20.0 + epoch))
    resumed.close()
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 11.0), (2, 22.0), (3, 23.0), (4, 24.0)]
    # a new (not resumed) run starts from nothing, as metrics.jsonl does
    fresh = Reporter(ProcessInfo(0, 1), tmp_path, quiet=True, tensorboard=True)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*")) == []
    fresh.append_metrics(record(1, 5.0))
    fresh.close()
    assert scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 5.0)]


def test_writing_events_imports_no_framework(tmp_path):
    """tensorboard's EventFileWriter opens its file through tf.io.gfile, which imports TensorFlow
    (installed here) into a torch run; hvtrain's writer must not."""
    code = f"""
import sys
from hvtrain.launch.process import ProcessInfo
from hvtrain.io.reporter import Reporter
rep = Reporter(ProcessInfo(0, 1), {str(tmp_path)!r}, quiet=True, tensorboard=True)
rep.append_metrics({{"epoch": 1, "train_loss": 0.5}})
rep.close()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "tensorflow", "keras", "horovod"))
assert not heavy, heavy[:5]
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 0.5)]


def test_missing_package_is_an_error_only_when_asked_for(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tbevents, "available", lambda: False)
    base = (ROOT / "examples/digits_mlp.yaml").read_text()
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(base + "output:\n  tensorboard: true\n")
    with pytest.raises(ConfigError) as e:
        tbevents.check(load_config(cfg))
    line = base.count("\n") + 2
    assert str(e.value) == (f"{cfg}:{line}: output.tensorboard: the tensorboard package is not installed: pip install "
                            "'hvtrain[tensorboard]' (make setup installs it), or set output.tensorboard: false")
    tbevents.check(load_config(ROOT / "examples/digits_mlp.yaml"))  # the default: no error...
    rep = Reporter(ProcessInfo(0, 1), tmp_path / "out", tensorboard=True)
    rep.append_metrics(record(1, 1.0))
    rep.append_metrics(record(2, 1.0))
    assert capsys.readouterr().out.count("no TensorBoard event files: the tensorboard package is not installed") == 1
    assert not (tmp_path / "out" / "tensorboard").exists()  # ...and a notice, once
    cfg.write_text(base + "output:\n  tensorboard: false\n")
    tbevents.check(load_config(cfg))


def test_elastic_reset_on_a_staying_rank_0_restarts_its_open_event_log(tmp_path):
    """Defect: an elastic reset rolls back on a process that stays rank 0; truncate_metrics set
    the restart step but the event file already open never got the restart marker, so the re-run
    epochs were duplicate points in TensorBoard."""
    rep = Reporter(ProcessInfo(0, 2), tmp_path, quiet=True, tensorboard=True)
    for epoch in (1, 2, 3):
        rep.append_metrics(record(epoch, float(epoch)))
    rep.truncate_metrics(1)  # rollback to the commit after epoch 1 (elastic.attempt), same Reporter
    for epoch in (2, 3):
        rep.append_metrics(record(epoch, 10.0 * epoch))
    rep.close()
    assert scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 1.0), (2, 20.0), (3, 30.0)]
