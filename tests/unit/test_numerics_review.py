"""Issue 21, a cold review of the numerics, export and resume fixes (no framework): what an export's
graph takes (the raw dtype in the inputs record), non-finite values in every row a run reads,
`--resume auto` keeping a finished run's results only for the same data and model, and evaluate
reading its weights once."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hvtrain.config.load import load_config
from hvtrain.data.dataset import load_dataset, split_rows
from hvtrain.errors import DataError
from hvtrain.model.weights import describe_inputs, inputs_from
from tests.support.one_rank import LOOP, fit_loop

MODEL = {"input_shape": [2], "layers": [{"type": "dense", "units": 2}]}


def record_of(x: np.ndarray, normalize: str = "standard") -> dict:
    """The inputs record (as stored: JSON) of a run on the Python API's arrays `x`."""
    cfg = load_config({"name": "r", "data": {"normalize": normalize}, "model": MODEL},
                      data=(x, np.arange(len(x)) % 2))
    return json.loads(json.dumps(describe_inputs(cfg, load_dataset(cfg))))


def test_the_inputs_record_names_the_raw_dtype_and_an_export_takes_float64_only_where_float32_loses():
    """The record held only the model's input dtype (float32), so both exporters declared float32
    rows and rounded 1e8 + N(0, 1) before normalising in float64; and every normalised graph had
    float64 ops. Now `raw_dtype` travels and export_dtypes gives float64 only to features far from
    zero relative to their spread: float64 rows where float32 cannot hold the raw dtype."""
    from hvtrain.model.weights import export_dtypes

    noise = np.random.default_rng(0).standard_normal((200, 2))
    offset = record_of(1e8 + noise)
    assert offset["raw_dtype"] == "float64"
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    assert export_dtypes(inputs_from(offset, "w")) == (f64, f64)
    assert export_dtypes(inputs_from(record_of((1e8 + noise).astype(np.float32)), "w")) == (f32, f64)
    assert export_dtypes(inputs_from(record_of(5 + 3 * noise), "w")) == (f32, f32)  # float64, ordinary
    assert export_dtypes(inputs_from(record_of(1e8 + noise, "none"), "w")) == (f32, None)  # cast, as training
    older = {k: v for k, v in offset.items() if k != "raw_dtype"}  # written before the key: loses nothing
    assert export_dtypes(inputs_from(older, "w")) == (f64, f64)
    with pytest.raises(DataError, match=r"w: unreadable 'inputs' metadata \(ValueError: raw_dtype: expected a numeric"):
        inputs_from({**offset, "raw_dtype": "object"}, "w")


# ----------------------------------------------------------------------------- non-finite file rows


def npy_dir(tmp_path, x: np.ndarray, val: np.ndarray | None = None):
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.arange(len(x)) % 2)
    if val is not None:
        np.save(tmp_path / "x_val.npy", val)
        np.save(tmp_path / "y_val.npy", np.arange(len(val)) % 2)
    return tmp_path


def npy_config(directory, normalize: str = "standard"):
    return load_config({"name": "n", "data": {"dataset": f"npy:{directory}", "normalize": normalize},
                        "model": MODEL})


@pytest.mark.parametrize("normalize", ["standard", "none"])
def test_a_nan_in_the_validation_rows_of_file_data_is_named_before_training(tmp_path, normalize):
    """Defect: only the training rows of npy:/shards: data were checked, in the statistics pass, so
    a NaN in a validation row ended in val_loss nan, exit 0, no file named. Now the pass reads the
    held-out rows too, whatever data.normalize."""
    x = np.random.default_rng(1).standard_normal((100, 2))
    cfg = npy_config(tmp_path, normalize)
    bad = int(split_rows(cfg, 100)[1][3])  # a validation sample
    x[bad, 1] = np.nan
    npy_dir(tmp_path, x)
    with pytest.raises(DataError, match=rf"^npy:{tmp_path}: sample {bad}, feature 1: nan is not a finite number"):
        load_dataset(cfg)


def test_a_nan_anywhere_in_file_data_under_normalize_none_is_named_before_training(tmp_path):
    """Defect: under data.normalize: none no pass ran, so neither training nor validation rows of
    file data were checked. Now the same pass runs for the check alone (once: its mark is cached
    beside the data like the statistics), and separate validation files are read too."""
    for d in "abc":
        (tmp_path / d).mkdir()
    x = np.random.default_rng(2).standard_normal((100, 2))
    cfg = npy_config(tmp_path / "a", "none")
    bad = int(split_rows(cfg, 100)[0][5])  # a training sample
    x[bad, 0] = np.inf
    npy_dir(tmp_path / "a", x)
    with pytest.raises(DataError, match=rf"^npy:{tmp_path / 'a'}: sample {bad}, feature 0: inf is not a finite"):
        load_dataset(cfg)
    val = np.zeros((30, 2))
    val[7, 1] = np.nan
    npy_dir(tmp_path / "b", np.ones((100, 2)), val)
    with pytest.raises(DataError, match=r"npy:.*/b \(validation files\): sample 7, feature 1: nan is not a finite"):
        load_dataset(npy_config(tmp_path / "b", "none"))
    npy_dir(tmp_path / "c", np.ones((100, 2)), np.zeros((30, 2)))
    clean = load_dataset(npy_config(tmp_path / "c", "none"))
    assert clean.train.transform.shift is None and list((tmp_path / "c").glob(".hvtrain-norm-*.npy"))


def test_a_float64_value_beyond_float32s_range_is_named_before_training(tmp_path):
    """Defect: 1e300 is finite in a float64 file, so it passed the check, and became inf in the
    float32 batch (normalize: none) or an inf variance (standard): a non-finite loss with no file
    named. Raw features beyond float32 are refused like a NaN, file and sample named; normalised
    ones only beyond what float64 statistics hold (1e39 standardises exactly in float64)."""
    x = np.random.default_rng(3).standard_normal((100, 2))
    for normalize, value, trains in (("none", 1e39, False), ("none", -1e300, False), ("standard", 1e39, True),
                                     ("minmax", 1e39, True), ("standard", -1e300, False)):
        d = tmp_path / f"{normalize}{value:g}"
        d.mkdir()
        cfg = npy_config(d, normalize)
        bad = int(split_rows(cfg, 100)[0][3])
        x2 = x.copy()
        x2[bad, 1] = value
        npy_dir(d, x2)
        if trains:
            data = load_dataset(cfg)
            assert np.isfinite(data.train.transform.scale).all() and np.isfinite(data.train.features(np.arange(5))).all()
            continue
        why = "overflows float32" if normalize == "none" else "is too large for float64 statistics"
        with pytest.raises(DataError, match=rf"^npy:{d}: sample {bad}, feature 1: {value:.6g} {why}".replace("+", r"\+")):
            load_dataset(cfg)


# ----------------------------------------------------------------------------- --resume auto, no checkpoints


def arrays(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((500, 4))
    return x, (x[:, 0] > 0).astype(np.int64)


def test_resume_auto_without_checkpoints_keeps_results_only_for_the_same_arrays(tmp_path, capsys):
    """Defect: the config's hash (summary.json's config_hash) left out the Python API's data=, so
    `hvtrain.train(cfg, data=(x_new, y_new), output_dir=same, resume="auto")` with no checkpoints
    returned the previous arrays' finished results without training. Now summary.json records the
    data's content hash too: the same arrays keep the results, other arrays (even one value in
    one row, under normalize none) train anew."""
    x, y = arrays(0)
    first, _ = fit_loop(tmp_path, "train.checkpoint_every=0", data=(x, y))
    again, steps = fit_loop(tmp_path, "train.checkpoint_every=0", data=(x.copy(), y.copy()), resume="auto")
    assert steps.lrs == [] and again == first
    assert "but the run there finished on this config" in capsys.readouterr().out
    other, steps = fit_loop(tmp_path, "train.checkpoint_every=0", data=arrays(1), resume="auto")
    assert len(steps.lrs) == 80 and other["run_id"] != first["run_id"] and other["data_hash"] != first["data_hash"]
    x2, y2 = arrays(1)
    x2[123, 2] += 1.0
    one, steps = fit_loop(tmp_path, "train.checkpoint_every=0", "data.normalize=none", data=arrays(1),
                          resume="auto")
    changed, steps = fit_loop(tmp_path, "train.checkpoint_every=0", "data.normalize=none", data=(x2, y2),
                              resume="auto")
    assert len(steps.lrs) == 80 and changed["data_hash"] != one["data_hash"]


def test_resume_auto_without_checkpoints_never_keeps_a_model_factorys_results(tmp_path, capsys):
    """Defect: a model= factory was identified by its qualname only (every lambda is
    `python:<lambda>`), so another factory got the previous model's results back. It is never kept:
    it trains anew, and says why."""
    fit_loop(tmp_path, "train.checkpoint_every=0", model=lambda: "model a")
    capsys.readouterr()
    _, steps = fit_loop(tmp_path, "train.checkpoint_every=0", model=lambda: "model b", resume="auto")
    assert len(steps.lrs) == 80
    assert "a model= factory is known only by its name (python:" in capsys.readouterr().out


def test_resume_from_a_checkpoint_of_other_arrays_is_refused_in_one_line(tmp_path):
    """The same with checkpoints: their match compares config keys, which say nothing of data=, so a
    finished run's results were kept for other arrays (0 steps trained) and a run cut at step 40
    continued on other arrays. Checkpoints now record the content of data the config cannot name
    (`data.content`); another one is a different experiment: one ConfigError naming the key. The
    same arrays resume as before."""
    from hvtrain.errors import ConfigError

    first, _ = fit_loop(tmp_path / "a", data=arrays(0))
    with pytest.raises(ConfigError, match=r"^--resume auto: no checkpoint in .* was made with this experiment; the "
                                          r"newest, ckpt-\w+-s00000080.safetensors, differs in data.content: "):
        fit_loop(tmp_path / "a", data=arrays(1), resume="auto")
    again, steps = fit_loop(tmp_path / "a", data=arrays(0), resume="auto")
    assert steps.lrs == [] and again == first
    fit_loop(tmp_path / "b", "train.max_steps=40", data=arrays(0))
    with pytest.raises(ConfigError, match=r"differs in data.content: checkpoint '\w+', this run '\w+'"):
        fit_loop(tmp_path / "b", data=arrays(1), resume="auto")
    _, steps = fit_loop(tmp_path / "b", data=arrays(0), resume="auto")
    assert len(steps.lrs) == 40


# ----------------------------------------------------------------------------- evaluate


def test_evaluate_reads_and_verifies_a_checkpoint_once(tmp_path, monkeypatch):
    """evaluate read the weights file twice (read_inputs, then read_weights): a checkpoint was
    loaded and its checksum verified twice. Now once, up to the framework's start."""
    import hvtrain.model.weights as weights
    import hvtrain.training.entry as entry
    from hvtrain.io.checkpoints import list_checkpoints

    fit_loop(tmp_path / "run")
    checkpoint = str(list_checkpoints(tmp_path / "run")[0])
    loads = []
    real = weights.load_checkpoint
    monkeypatch.setattr(weights, "load_checkpoint", lambda path: loads.append(path) or real(path))
    monkeypatch.setattr(entry, "check_weights", lambda *a: None)

    class Started(Exception):
        pass

    def framework(*args, **kwargs):
        raise Started

    monkeypatch.setattr(entry, "loaded_model", framework)
    with pytest.raises(Started):
        entry.evaluate({**LOOP, "output_dir": str(tmp_path / "eval")}, checkpoint)
    assert loads == [checkpoint]
