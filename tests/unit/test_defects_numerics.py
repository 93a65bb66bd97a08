"""Issue 21, numerics of the input path (no framework): float64 features far from zero, statistics
in float64 in the weights' inputs record, non-finite values in every source kind; and the pure
logic of resuming (LR warmup position after a world-size change, resume compatibility keys)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hvtrain.config.load import load_config
from hvtrain.data.dataset import load_dataset
from hvtrain.errors import DataError
from hvtrain.model.weights import describe_inputs, inputs_from
from tests.conftest import hvtrain, run
from tests.support.one_rank import fit_loop

MODEL = {"input_shape": [2], "layers": [{"type": "dense", "units": 2}]}


def offset_data(n: int = 400, offset: float = 1e8) -> tuple[np.ndarray, np.ndarray]:
    """Two float64 features 1e8 + N(0, 1): float32 holds 1e8 only to a multiple of 8."""
    rng = np.random.default_rng(0)
    noise = rng.standard_normal((n, 2))
    return offset + noise, (noise[:, 0] + noise[:, 1] > 0).astype(np.int64)


def standardised(raw: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """What standardising with the training rows' statistics gives, in float64."""
    train = raw[rows]
    return (raw - train.mean(0)) / train.std(0)


def test_defect_04_float64_features_far_from_zero_are_standardised_before_the_float32_cast():
    """Defect: features were cast to float32 before standardisation (Transform and the statistics
    pass), so x = 1e8 + N(0, 1) became multiples of 8 and the standardised feature was noise (a
    model trained to 0.445 accuracy instead of 0.985)."""
    x, y = offset_data()
    cfg = load_config({"name": "offset", "model": MODEL}, data=(x, y))
    d = load_dataset(cfg)
    assert d.x_train.dtype == np.float32
    want = standardised(x, d.train.rows)
    np.testing.assert_allclose(d.x_train, want[d.train.rows], atol=1e-5)
    np.testing.assert_allclose(d.x_val, want[d.val.rows], atol=1e-5)
    assert d.train.transform.shift.dtype == np.float64


def test_defect_04_the_inputs_record_keeps_the_float64_statistics_predict_applies(tmp_path):
    """The weights' inputs record held float32 statistics: predict and export normalised with
    rounded ones. Now float64 (`stats_dtype`), rebuilding training's transform bit for bit; a
    record written before (float32, no `stats_dtype`) still reads."""
    x, y = offset_data()
    cfg = load_config({"name": "offset", "model": MODEL}, data=(x, y))
    d = load_dataset(cfg)
    record = json.loads(json.dumps(describe_inputs(cfg, d)))  # as stored: JSON text
    inputs = inputs_from(record, "here")
    assert record["stats_dtype"] == "float64" and inputs.transform.shift.dtype == np.float64
    assert np.array_equal(inputs.transform.shift, d.train.transform.shift)
    assert np.array_equal(inputs.transform(x[d.val.rows]), d.x_val)  # what training fed the model
    import base64

    old = {**record, "shift": base64.b64encode(np.zeros(2, "<f4").tobytes()).decode(),
           "scale": base64.b64encode(np.ones(2, "<f4").tobytes()).decode()}
    old.pop("stats_dtype")
    assert inputs_from(old, "old").transform.scale.tolist() == [1.0, 1.0]


def test_defect_04_file_data_statistics_are_float64_and_their_cache_too(tmp_path):
    """npy:DIR float64 features: the chunked statistics pass read rows through float32 and cached
    float32 statistics; a second run (from the cache) must standardise exactly like the first."""
    x, y = offset_data()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    cfg = load_config({"name": "offset", "data": {"dataset": f"npy:{tmp_path}"}, "model": MODEL})
    first = load_dataset(cfg)
    assert list(tmp_path.glob(".hvtrain-norm-*.npy")), "the statistics are cached beside the data"
    again = load_dataset(cfg)
    want = standardised(x, first.train.rows)
    np.testing.assert_allclose(first.x_train, want[first.train.rows], atol=1e-5)
    assert np.array_equal(again.x_train, first.x_train)


def test_defect_04_a_windowed_series_far_from_zero_keeps_its_precision(tmp_path):
    """data.window: the windows were cast to float32 before the series' shift and scale."""
    t = np.arange(600, dtype=np.float64)
    series = 1e8 + np.sin(t / 5)
    np.savez(tmp_path / "s.npz", x=series)
    cfg = load_config({"name": "s", "loss": "mse", "data": {"dataset": f"npz:{tmp_path}/s.npz", "window": 8},
                       "model": {"input_shape": [8], "layers": [{"type": "dense", "units": 1}]}})
    d = load_dataset(cfg)
    shift, scale = d.series["shift"], d.series["scale"]
    raw = d.train.source.features(d.train.rows)
    np.testing.assert_allclose(d.x_train, (raw - shift) / scale, atol=1e-5)
    assert np.corrcoef(d.x_train[:, -1], d.y_train[:, 0])[0, 1] > 0.9  # the next value follows the last


# ----------------------------------------------------------------------------- non-finite values


def csv_config(tmp_path: Path, text: str, loss: str = "cross_entropy") -> Path:
    (tmp_path / "d.csv").write_text(text)
    p = tmp_path / "c.yaml"
    p.write_text(f"name: c\nloss: {loss}\ndata: {{dataset: 'csv:{tmp_path / 'd.csv'}'}}\n"
                 "model: {input_shape: [2], layers: [{type: dense, units: 2}]}\n")
    return p


@pytest.mark.parametrize("text,loss,where", [
    ("a,b,label\n1,2,0\n3,nan,1\n5,6,0\n7,8,1\n", "cross_entropy", r"d.csv:3: column 'b': nan"),
    ("a,b,label\n1,2,0\n3,4,1\n5,-inf,0\n7,8,1\n", "cross_entropy", r"d.csv:4: column 'b': -inf"),
    ("a,b,t\n1,2,0.5\n3,4,1.5\n5,6,Infinity\n7,8,1\n", "mse", r"d.csv:4: column 't': inf"),
])
def test_defect_22_csv_training_data_with_nan_or_inf_is_a_located_error(tmp_path, text, loss, where):
    """Defect: Python's float() reads nan, inf and Infinity, so a CSV with a missing value written
    as nan trained to val_loss nan with no file named. Now: file:line and the column's name."""
    with pytest.raises(DataError, match=where + r" is not a finite number \(1 such values in the file\)"):
        load_dataset(load_config(csv_config(tmp_path, text, loss)))


def test_defect_22_csv_nan_is_one_line_exit_2_before_training(tmp_path):
    cfg = csv_config(tmp_path, "a,b,label\n1,2,0\n3,nan,1\n5,6,0\n7,8,1\n")
    proc = run(hvtrain("train", str(cfg), "--output-dir", str(tmp_path / "out")), check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [f"hvtrain: error: {tmp_path / 'd.csv'}:3: column 'b': nan is not a "
                                               "finite number (1 such values in the file); hvtrain does not impute "
                                               "missing values: drop or fill them"]
    assert not (tmp_path / "out").exists()


def test_non_finite_values_in_every_other_source_kind_are_named(tmp_path):
    """The same class in NPZ, npy:DIR files (named in the statistics pass, which reads every
    training row), a user's arrays, regression targets and a windowed series."""
    x, y = np.ones((50, 2)), np.arange(50) % 2
    x[7, 1] = np.nan
    np.savez(tmp_path / "d.npz", x=x, y=y)
    with pytest.raises(DataError, match=r"d.npz: sample 7, feature 1: nan is not a finite number"):
        load_dataset(load_config({"name": "n", "data": {"dataset": f"npz:{tmp_path}/d.npz"}, "model": MODEL}))
    with pytest.raises(DataError, match=r"^data= \(hvtrain.train\): sample 7, feature 1: nan is not a finite number"):
        load_dataset(load_config({"name": "n", "model": MODEL}, data=(x, y)))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    npy = load_config({"name": "n", "data": {"dataset": f"npy:{tmp_path}", "validation_split": 0.0}, "model": MODEL})
    with pytest.raises(DataError, match=rf"npy:{tmp_path}: sample 7, feature 1: nan is not a finite number"):
        load_dataset(npy)
    targets = np.arange(50.0)
    targets[3] = np.inf
    with pytest.raises(DataError, match=r"^data=: sample 3, target 0: inf is not a finite number"):
        load_dataset(load_config({"name": "n", "loss": "mse", "model": {**MODEL, "layers": [
            {"type": "dense", "units": 1}]}}, data=(np.ones((50, 2)), targets)))
    series = np.sin(np.arange(200.0))
    series[150] = np.nan
    np.savez(tmp_path / "s.npz", x=series)
    with pytest.raises(DataError, match=r"data.dataset npz:.*s.npz: sample 150, value 0: nan is not a finite"):
        load_dataset(load_config({"name": "s", "loss": "mse", "data": {"dataset": f"npz:{tmp_path}/s.npz",
                                                                       "window": 8},
                                  "model": {"input_shape": [8], "layers": [{"type": "dense", "units": 1}]}}))


def test_defect_20_warmup_is_not_re_entered_after_resuming_on_fewer_ranks(tmp_path):
    """Confirmed: the LR schedule was indexed by the run's step counter, counted in the old world's
    steps, while warmup_steps came from the new world's steps per epoch. 4 ranks trained 2 epochs
    (warmup_epochs 1: 10 steps of 40 samples, then lr 0.1); resumed on 1 rank (40 steps an epoch)
    at step 20, the schedule saw step 20 of a 40-step warmup and lowered the lr to 0.0525. Now it
    follows the epoch position in this world's steps: the resumed epoch trains at the full lr, and
    a run that never changed world size sees exactly the lrs it did."""
    _, four = fit_loop(tmp_path, size=4)
    assert four.lrs[:10] == pytest.approx([0.01 * (k + 1) for k in range(10)]) and set(four.lrs[10:]) == {0.1}
    _, one = fit_loop(tmp_path, "train.epochs=3", resume="auto")
    assert len(one.lrs) == 40 and set(one.lrs) == {0.1}, one.lrs[:5]
    _, whole = fit_loop(tmp_path / "one", "train.epochs=1", "optimizer.warmup_epochs=0.5")
    assert whole.lrs == pytest.approx([0.1 * (k + 1) / 20 for k in range(20)] + [0.1] * 20)


def test_schedule_step_of_a_mid_epoch_position_on_another_world_size():
    """The schedule's step of a position: an epoch's worth of steps per epoch done, plus the steps
    the samples already consumed take in this world (a 4-rank checkpoint 120 samples into epoch 0
    of a 1-epoch warmup is 30% through it on any world size)."""
    from hvtrain.training.schedule import schedule_step

    assert schedule_step(0, 120, 40, 10) == 12 and schedule_step(0, 120, 10, 40) == 3  # 12/40 = 3/10
    assert schedule_step(2, 0, 40, 10) == 80 and schedule_step(1, 125, 40, 10) == 53  # a partial step rounds up


def test_defect_21_resume_refuses_another_gradient_compression_or_micro_batching():
    """Confirmed for both keys: train.compression (fp16 rounds every gradient before the
    allreduce) and parallel.pipeline.micro_batches (batchnorm's statistics are per micro-batch;
    tests/backends shows the update changes) were missing from MATH_KEYS, so a resume under
    another value continued silently on other math. Refuted for the schedule: gpipe and 1f1b give
    the same update (tests/backends/test_stage.py), so it may change."""
    from hvtrain.io.checkpoints import config_differences

    saved = {"train": {"compression": "none"}, "parallel": {"pipeline": {"micro_batches": 4, "schedule": "gpipe"}}}
    assert config_differences(saved, {**saved, "train": {"compression": "fp16"}}) == [
        "train.compression: checkpoint 'none', this run 'fp16'"]
    other = {**saved, "parallel": {"pipeline": {"micro_batches": 2, "schedule": "gpipe"}}}
    assert config_differences(saved, other) == ["parallel.pipeline.micro_batches: checkpoint 4, this run 2"]
    assert config_differences(saved, {**saved, "parallel": {"pipeline": {"micro_batches": 4, "schedule": "1f1b"}}}) \
        == []


# ----------------------------------------------------------------------------- re-running on a finished run


def outputs(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in ("summary.json", "final.safetensors", "metrics.jsonl")}


def test_defect_06_resume_auto_on_a_finished_run_keeps_its_results(tmp_path, capsys):
    """Defect: `--resume auto` on a finished run (every requeue script passes it) loaded the last
    checkpoint, trained nothing and rewrote summary.json with train_loss null and no val metrics
    (and deleted val_scores.npz); hvtrain.train's caller then met a KeyError. The run stays
    finished: nothing trained, every output byte kept, the summary returned, and it says so."""
    first, _ = fit_loop(tmp_path)
    before = outputs(tmp_path)
    again, steps = fit_loop(tmp_path, resume="auto")
    assert steps.lrs == [] and again == first and again["val_loss"] == 80.0  # 2 epochs x 40 updates
    assert outputs(tmp_path) == before
    assert "is the end of training (epoch 2 of train.epochs 2): the run is finished and its results in" \
        in capsys.readouterr().out
    fewer, _ = fit_loop(tmp_path, "train.epochs=1", resume="auto")  # epochs already reached: the same
    assert fewer == first and outputs(tmp_path) == before


def test_defect_06_resume_auto_on_a_finished_run_without_checkpoints_keeps_its_results(tmp_path, capsys):
    """A config that writes no checkpoints, re-run by a requeue script with `--resume auto` after it
    finished: there was nothing to resume, so it trained again from scratch over the finished
    results. Now the same config's finished outputs (summary.json's config_hash, final.safetensors)
    are kept, manifest.json too; another config (more epochs) trains anew, as without --resume."""
    first, _ = fit_loop(tmp_path, "train.checkpoint_every=0")
    manifest = tmp_path / "manifest.json"
    before = {**outputs(tmp_path), "manifest": manifest.read_bytes() if manifest.exists() else None}
    again, steps = fit_loop(tmp_path, "train.checkpoint_every=0", resume="auto")
    assert steps.lrs == [] and again == first
    assert {**outputs(tmp_path), "manifest": manifest.read_bytes()} == before
    assert "but the run there finished on this config" in capsys.readouterr().out
    more, steps = fit_loop(tmp_path, "train.checkpoint_every=0", "train.epochs=3", resume="auto")
    assert len(steps.lrs) == 120 and more["val_loss"] == 120.0 and more["config_hash"] != first["config_hash"]
    assert "starting from scratch" in capsys.readouterr().out


def test_defect_06_a_resume_whose_max_steps_is_reached_stays_finished(tmp_path):
    """train.max_steps=15 stops inside epoch 1 (a checkpoint at the stop); the resume with the same
    limit keeps everything, the cut epoch's partial metrics line too; a larger limit trains on."""
    first, _ = fit_loop(tmp_path, "train.max_steps=15")
    assert first["stopped_at_max_steps"] and first["steps"] == 15
    before = outputs(tmp_path)
    again, steps = fit_loop(tmp_path, "train.max_steps=15", resume="auto")
    assert steps.lrs == [] and again == first and outputs(tmp_path) == before
    more, steps = fit_loop(tmp_path, "train.max_steps=50", resume="auto")
    assert len(steps.lrs) == 35 and more["steps"] == 50 and more["val_loss"] == 50.0


def test_defect_06_a_run_killed_after_its_last_checkpoint_gets_its_outputs_from_it(tmp_path):
    """Killed between the last checkpoint and the final write: the resume at the end evaluates the
    checkpoint's weights and writes final.safetensors and summary.json (train loss and rate from
    that epoch's metrics.jsonl line), not a summary of nulls."""
    first, _ = fit_loop(tmp_path)
    (tmp_path / "summary.json").unlink()
    (tmp_path / "final.safetensors").unlink()
    again, steps = fit_loop(tmp_path, resume="auto")
    assert steps.lrs == [] and (tmp_path / "final.safetensors").is_file()
    kept = {k: again[k] for k in ("train_loss", "val_loss", "val_accuracy", "samples_per_sec", "steps", "run_id")}
    assert kept == {k: first[k] for k in kept}
    assert json.loads((tmp_path / "summary.json").read_text())["val_loss"] == 80.0


def test_defect_06_finishing_never_overwrites_another_runs_results(tmp_path):
    """The newest checkpoint is the end of run A, but a later run B (no checkpoints) wrote the
    directory's results: finishing A again would overwrite them, so the resume refuses, naming both."""
    from hvtrain.errors import HvtrainError

    fit_loop(tmp_path)
    second, _ = fit_loop(tmp_path, "train.checkpoint_every=0")
    before = outputs(tmp_path)
    with pytest.raises(HvtrainError, match=rf"is the end of run \w+ .*summary.json is run {second['run_id']}'s"):
        fit_loop(tmp_path, resume="auto")
    assert outputs(tmp_path) == before


# ----------------------------------------------------------------------------- evaluate's data (item 5's checks)


def test_evaluation_data_takes_the_records_normalisation_and_refuses_what_would_mislead(tmp_path):
    """hvtrain.model.weights.evaluation_data, without a framework: the record's statistics replace
    the config's (a note says so); other classes, another row shape or a series normalised
    otherwise are one located error; other data (another sample count) is a note; a record
    written before the split travelled is taken as it is."""
    from hvtrain.errors import ConfigError
    from hvtrain.model.weights import evaluation_data

    def record(mapping, **kw):
        cfg = load_config(mapping, **kw)
        d = load_dataset(cfg)
        return cfg, d, inputs_from(json.loads(json.dumps(describe_inputs(cfg, d))), "w.st")

    base = {"name": "e", "data": {"dataset": "synthetic:classification", "samples": 300, "features": 2},
            "model": MODEL}
    cfg, d, trained = record({**base, "data": {**base["data"], "normalize": "minmax"}})
    cfg, now, _ = record(base)
    fed, notes = evaluation_data(cfg, now, trained, "w.st")
    assert np.array_equal(fed.x_val, d.x_val) and not np.array_equal(now.x_val, d.x_val)
    assert notes == ["evaluate: inputs normalised as w.st was trained (minmax, the training split's statistics "
                     "from its inputs record), not by this config's data.normalize 'standard'"]
    assert evaluation_data(cfg, d, None, "w.st") == (d, [])  # an older file: nothing to compare
    other, _ = evaluation_data(cfg, now, trained.__class__(**{**trained.__dict__, "split": None}), "w.st")
    assert np.array_equal(other.x_val, d.x_val)
    cfg2, arrays, _ = record({"name": "e", "model": MODEL}, data=offset_data(400))
    _, notes = evaluation_data(cfg2, arrays, trained, "w.st")
    assert notes[0].startswith("evaluate: w.st was trained on 300 samples split by seed") and \
        notes[0].endswith("data= has 400: its validation split may hold samples the weights were trained on")
    y3 = np.arange(300) % 3
    cfg3, three, _ = record({"name": "e", "model": {**MODEL, "layers": [{"type": "dense", "units": 3}]}},
                            data=(np.ones((300, 2)) + np.arange(300)[:, None], y3))
    with pytest.raises(ConfigError, match=r"data: w.st was trained on the classes \[0, 1\], data= has \[0, 1, 2\]"):
        evaluation_data(cfg3, three, trained, "w.st")
    with pytest.raises(DataError, match=r"w.st: trained on rows of shape \[2\], data= has \[3\]"):
        evaluation_data(cfg3, load_dataset(load_config({"name": "e", "model": MODEL}, data=(np.ones((300, 3)), y3))),
                        trained, "w.st")
    series = {"name": "s", "loss": "mse", "data": {"dataset": "statsmodels:sunspots", "window": 8},
              "model": {"input_shape": [8], "layers": [{"type": "dense", "units": 1}]}}
    scfg, _, strained = record({**series, "data": {**series["data"], "normalize": "minmax"}})
    scfg, snow, _ = record(series)
    with pytest.raises(ConfigError, match=r"data.normalize: w.st was trained on the series normalised with 'minmax'"):
        evaluation_data(scfg, snow, strained, "w.st")


def test_defect_06_a_fresh_run_killed_after_its_last_checkpoint_replaces_an_earlier_runs_results(tmp_path):
    """Run B was started fresh in run A's directory and killed after its last checkpoint: the
    summary.json there is A's, older than B's checkpoint, so the resume completes B's outputs
    (it is not another run's result written later, which would be refused)."""
    import os

    first, _ = fit_loop(tmp_path)
    old = (tmp_path / "summary.json").read_bytes()
    second, _ = fit_loop(tmp_path)
    assert second["run_id"] != first["run_id"]
    (tmp_path / "final.safetensors").unlink()
    (tmp_path / "summary.json").write_bytes(old)
    os.utime(tmp_path / "summary.json", (1e9, 1e9))  # written before B's checkpoints
    again, steps = fit_loop(tmp_path, resume="auto")
    assert steps.lrs == [] and again["run_id"] == second["run_id"] and (tmp_path / "final.safetensors").is_file()
    assert (again["train_loss"], again["val_loss"]) == (second["train_loss"], second["val_loss"])
    assert json.loads((tmp_path / "summary.json").read_text())["run_id"] == second["run_id"]
