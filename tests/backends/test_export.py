"""`hvtrain export` (issue 12, item 5): real exports in every format from weights trained by each
backend (so torch weights become a SavedModel and TF weights TorchScript), run by onnxruntime or
reloaded here, independently of the exporter's own check, against `hvtrain predict`'s outputs on
raw rows; and the verification catching a real difference (other weights), leaving nothing."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

import hvtrain
from hvtrain.backends.registry import EXPORT_FORMATS
from hvtrain.cli import cli
from hvtrain.tools.export import ExportMismatch, export_model, onnx_runner, verify
from hvtrain.tools.predict import ArrayRows, load_model
from tests.support.deployed import reload

# every (format, exporting backend) the neutral table lists: a new backend or format is tested by default
EXPORTS = [(fmt, backend) for backend, formats in EXPORT_FORMATS.items() for fmt in formats]
TOL = 1e-4


def config(data: str, backend: str, seed: int = 4) -> dict:
    return {"name": "export", "backend": backend, "seed": seed,
            "data": {"dataset": data, "batch_size": 64, "normalize": "standard", "validation_split": 0.2},
            "model": {"input_shape": [8, 8, 1],  # raw rows are [64]: the reshape is part of the graph
                      "layers": [{"type": "conv2d", "filters": 4, "kernel_size": 3, "activation": "relu"},
                                 {"type": "flatten"}, {"type": "dense", "units": 10}]},
            "optimizer": {"name": "adam", "lr": 0.01}, "loss": "cross_entropy", "train": {"epochs": 1, "threads": 1}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Digits (raw pixels 0..16, standardised by the training split's statistics) trained one
    epoch by each backend, and by torch from another seed ("other": other weights, for the failure
    path; the two backends' weights agree to ~1e-5, as the same run in both frameworks should):
    {name: (config, weights path)}."""
    out = {}
    for name, backend, seed in (("torch", "torch", 4), ("tensorflow", "tensorflow", 4), ("other", "torch", 5)):
        d = tmp_path_factory.mktemp(f"run-{name}")
        cfg = config("sklearn:digits", backend, seed)
        hvtrain.train(cfg, output_dir=str(d), quiet=True)
        out[name] = (cfg, str(d / "final.safetensors"))
    return out


def raw_rows() -> np.ndarray:
    from sklearn.datasets import load_digits

    return load_digits().data[:150].astype(np.float32)  # as the dataset stores them, not normalised


@pytest.mark.parametrize("fmt,exporter", EXPORTS)
@pytest.mark.parametrize("trained_by", ["torch", "tensorflow"])
def test_export_predicts_what_hvtrain_predict_does(tmp_path, trained, trained_by, fmt, exporter):
    cfg, weights = trained[trained_by]
    path = tmp_path / f"model.{fmt}"
    result = export_model(cfg, weights, fmt, str(path), backend=exporter)
    assert result["backend"] == exporter and result["rows"] == 359 and result["max_difference"] <= TOL
    assert path.exists() and not list(tmp_path.glob(".*partial"))
    x = raw_rows()
    want = hvtrain.predict(cfg, weights, x)  # hvtrain predict's path: probabilities
    run = reload(fmt, str(path))
    for part in (slice(None), slice(0, 1), slice(7, 20)):  # any batch size
        got = run(np.ascontiguousarray(x[part]))
        assert got.shape == want[part].shape
        np.testing.assert_allclose(got, want[part], atol=TOL, rtol=0)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-5)  # probabilities, not logits


def test_binary_export_gives_predicts_sigmoid_column(tmp_path):
    from sklearn.datasets import load_breast_cancer

    cfg = {"name": "bin", "backend": "tensorflow", "seed": 2,
           "data": {"dataset": "sklearn:breast_cancer", "batch_size": 32, "normalize": "standard"},
           "model": {"input_shape": [30], "layers": [{"type": "dense", "units": 8, "activation": "relu"},
                                                     {"type": "dense", "units": 1}]},
           "optimizer": {"name": "adam", "lr": 0.01}, "loss": "binary_cross_entropy",
           "train": {"epochs": 1, "threads": 1}}
    hvtrain.train(cfg, output_dir=str(tmp_path / "run"), quiet=True)
    weights = str(tmp_path / "run" / "final.safetensors")
    export_model(cfg, weights, "onnx", str(tmp_path / "m.onnx"), backend="torch")
    x = load_breast_cancer().data.astype(np.float32)
    got = reload("onnx", str(tmp_path / "m.onnx"))(x)
    want = hvtrain.predict(cfg, weights, x)
    assert got.shape == want.shape == (len(x), 1)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_verification_catches_other_weights(tmp_path, trained):
    """The check itself, on a real artefact: one run's weights exported, another run's predictions expected."""
    cfg, weights = trained["torch"]
    export_model(cfg, weights, "onnx", str(tmp_path / "m.onnx"), backend="torch")
    x = raw_rows()
    other = hvtrain.predict(cfg, trained["other"][1], x)
    inputs = load_model(cfg, weights).inputs
    assert verify(onnx_runner(str(tmp_path / "m.onnx")), ArrayRows(x), inputs,
                  hvtrain.predict(cfg, weights, x)).max_difference <= TOL
    with pytest.raises(ExportMismatch, match=r"does not match the framework's predictions: row \d+ output \d+"):
        verify(onnx_runner(str(tmp_path / "m.onnx")), ArrayRows(x), inputs, other)


@pytest.mark.parametrize("fmt,exporter", [("onnx", "tensorflow"), ("torchscript", "torch")])
def test_a_wrong_artefact_fails_the_command_and_is_removed(tmp_path, trained, monkeypatch, fmt, exporter):
    """The artefact really holds other weights (the exporter is handed another run's weights after
    the reference predictions were made): the command fails, exit 2, and nothing is at PATH."""
    from hvtrain.backends.base import get_backend
    from hvtrain.model.weights import read_weights

    cfg, weights = trained["torch"]
    wrong = read_weights(trained["other"][1]).weights
    cls = type(get_backend(exporter))
    original = cls.export

    def export_other_weights(self, fmt, path, inputs):
        self.set_weights(wrong)
        original(self, fmt, path, inputs)

    monkeypatch.setattr(cls, "export", export_other_weights)
    path = tmp_path / "out" / "model"
    (path.parent).mkdir()
    (tmp_path / "cfg.yaml").write_text(_yaml(cfg))
    r = CliRunner().invoke(cli, ["export", str(tmp_path / "cfg.yaml"), "--weights", weights, "--format", fmt,
                                 "--backend", exporter, "-o", str(path)])
    assert r.exit_code == 2, r.output
    assert "does not match the framework's predictions" in r.output and "the artefact was removed" in r.output
    assert list(path.parent.iterdir()) == []  # neither PATH nor the temporary artefact


def test_without_the_data_it_verifies_on_input_rows(tmp_path):
    """Data gone: --input rows are verified on; without them, one line saying to give them."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    cfg = config(f"npz:{tmp_path / 'd.npz'}", "torch")
    hvtrain.train(cfg, output_dir=str(tmp_path / "run"), quiet=True)
    weights = str(tmp_path / "run" / "final.safetensors")
    (tmp_path / "d.npz").unlink()
    np.save(tmp_path / "rows.npy", x[:40])
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(_yaml(cfg))
    r = CliRunner().invoke(cli, ["export", str(cfg_file), "--weights", weights, "--format", "onnx",
                                 "-o", str(tmp_path / "m.onnx")])
    assert r.exit_code == 2 and "give --input" in r.output and len(r.output.splitlines()) == 1, r.output
    assert not (tmp_path / "m.onnx").exists()
    r = CliRunner().invoke(cli, ["export", str(cfg_file), "--weights", weights, "--format", "onnx",
                                 "-o", str(tmp_path / "m.onnx"), "--input", str(tmp_path / "rows.npy")])
    assert r.exit_code == 0, r.output
    assert f"verified on {tmp_path / 'rows.npy'}" in r.output
    got = reload("onnx", str(tmp_path / "m.onnx"))(x[:40].astype(np.float32))
    np.testing.assert_allclose(got, hvtrain.predict(cfg, weights, x[:40]), atol=TOL, rtol=0)


def _yaml(cfg: dict) -> str:
    import yaml

    return yaml.safe_dump(cfg)


# token ids (int64 input, an embedding) and a recurrent model: graphs the digits CNN does not have
SEQ_MODELS = {
    "embedding": ({"input_shape": [10], "layers": [{"type": "embedding", "input_dim": 50, "output_dim": 8},
                                                  {"type": "global_avgpool"}, {"type": "dense", "units": 3}]},
                  "none", lambda rng: rng.integers(0, 50, (240, 10))),
    "lstm": ({"input_shape": [12, 1], "layers": [{"type": "lstm", "units": 8}, {"type": "dense", "units": 3}]},
             "standard", lambda rng: rng.normal(size=(240, 12)).astype(np.float32)),
}


@pytest.fixture(scope="module")
def sequence_runs(tmp_path_factory):
    """Each sequence model trained one epoch by torch (weights are neutral: every backend exports them)."""
    out = {}
    for name, (model, normalize, make_x) in SEQ_MODELS.items():
        d = tmp_path_factory.mktemp(f"seq-{name}")
        rng = np.random.default_rng(1)
        x = make_x(rng)
        np.savez(d / "d.npz", x=x, y=rng.integers(0, 3, len(x)))
        cfg = {"name": name, "backend": "torch", "seed": 1,
               "data": {"dataset": f"npz:{d / 'd.npz'}", "batch_size": 32, "normalize": normalize,
                        "validation_split": 0.25},
               "model": model, "optimizer": {"name": "adam", "lr": 0.01}, "loss": "cross_entropy",
               "train": {"epochs": 1, "threads": 1}}
        hvtrain.train(cfg, output_dir=str(d / "run"), quiet=True)
        out[name] = (cfg, str(d / "run" / "final.safetensors"), x[:40])
    return out


@pytest.mark.parametrize("fmt,exporter", EXPORTS)
@pytest.mark.parametrize("model", list(SEQ_MODELS))
def test_embedding_and_lstm_export_predict_what_hvtrain_predict_does(tmp_path, sequence_runs, model, fmt,
                                                                      exporter):
    cfg, weights, x = sequence_runs[model]
    path = tmp_path / f"model.{fmt}"
    result = export_model(cfg, weights, fmt, str(path), backend=exporter)
    assert result["rows"] == 60 and result["max_difference"] <= TOL
    assert result["input"]["dtype"] == ("int64" if model == "embedding" else "float32")
    want = hvtrain.predict(cfg, weights, x)
    got = reload(fmt, str(path))(np.ascontiguousarray(x.astype(result["input"]["dtype"])))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    again = export_model(cfg, weights, fmt, str(path), backend=exporter)  # an artefact of its format is replaced
    assert again["max_difference"] <= TOL and path.exists()


@pytest.mark.parametrize("trained_by,fmt,exporter", [("torch", "onnx", "tensorflow"), ("tensorflow", "onnx", "torch")])
def test_a_forecaster_predicts_and_exports_in_the_series_units(tmp_path, trained_by, fmt, exporter):
    """A windowed series trains on normalised targets: predict and the exported graph both gave
    those normalised values (~0 +- 1 for sunspot counts of 0..190) until the targets' shift and
    scale travelled in the weights' inputs record. Now predict's MAE on the raw validation windows
    is the run's own val MAE in sunspot units, and the export outputs the same forecasts."""
    from hvtrain.config.load import load_config
    from hvtrain.data.dataset import load_dataset

    cfg = {"name": "forecast", "backend": trained_by, "seed": 3,
           "data": {"dataset": "statsmodels:sunspots", "window": 16, "horizon": 1, "validation_split": 0.2,
                    "batch_size": 16, "normalize": "standard"},
           "model": {"input_shape": [16, 1], "layers": [{"type": "lstm", "units": 8}, {"type": "dense", "units": 1}]},
           "loss": "mse", "metrics": ["mae"], "optimizer": {"name": "adam", "lr": 0.003},
           "train": {"epochs": 3, "threads": 1}}
    summary = hvtrain.train(cfg, output_dir=str(tmp_path / "run"), quiet=True)
    weights = str(tmp_path / "run" / "final.safetensors")
    d = load_dataset(load_config(cfg), (16, 1))
    facts = d.series
    x = d.val.source.features(d.val.rows)  # the raw windows, in sunspot units
    y = d.y_val * facts["scale"] + facts["shift"]
    assert x.shape == (46, 16) and 40 < float(y.mean()) < 120
    forecast = hvtrain.predict(cfg, weights, x)
    assert forecast.shape == (46, 1)
    mae = float(np.abs(forecast[:, 0] - y[:, 0]).mean())
    assert mae == pytest.approx(summary["series"]["val_mae"], rel=1e-4), (mae, summary["series"])
    assert np.abs(forecast.mean() - y.mean()) < 0.5 * y.std()  # sunspot counts, not ~0-centred values
    evaluated = hvtrain.evaluate(cfg, weights, output_dir=str(tmp_path / "eval"))["series"]  # evaluate says so too
    assert evaluated["val_mae"] == pytest.approx(mae, rel=1e-4) and evaluated["persistence_val_mae"] > 0
    path = tmp_path / f"model.{fmt}"
    result = export_model(cfg, weights, fmt, str(path), backend=exporter)
    assert result["rows"] == 46 and result["output"] == "outputs"
    got = onnx_runner(str(path))(np.ascontiguousarray(x, result["input"]["dtype"]))  # the series is float64
    np.testing.assert_allclose(got, forecast, rtol=TOL, atol=TOL)
