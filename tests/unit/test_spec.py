from pathlib import Path

import numpy as np
import pytest

from hvtrain.config.load import load_config
from hvtrain.errors import ConfigError, DataError
from hvtrain.model.spec import build_spec, check_against_data, check_weights

ROOT = Path(__file__).resolve().parents[2]


def cfg_with(tmp_path, layers: str, input_shape="[8, 8, 1]", extra=""):
    p = tmp_path / "m.yaml"
    p.write_text(f"name: m\ndata: {{dataset: sklearn:digits}}\nmodel:\n  input_shape: {input_shape}\n"
                 f"  layers:\n{layers}{extra}")
    return load_config(p)


def test_cnn_shapes_and_weight_layout():
    cfg = load_config(ROOT / "examples/digits_cnn.yaml")
    spec = build_spec(cfg)
    assert [layer.output_shape for layer in spec.layers] == [
        (8, 8, 16), (8, 8, 32), (4, 4, 32), (512,), (64,), (10,)]
    shapes = {w.name: w.shape for w in spec.weight_specs()}
    assert shapes["layers.0.kernel"] == (3, 3, 1, 16)
    assert shapes["layers.4.kernel"] == (512, 64)
    assert spec.param_count == 16 * 10 + (9 * 16 * 32 + 32) + (512 * 64 + 64) + (64 * 10 + 10)


def test_recurrent_layouts(tmp_path):
    cfg = cfg_with(tmp_path, "    - {type: lstm, units: 5, return_sequences: true}\n"
                             "    - {type: gru, units: 4}\n    - {type: dense, units: 3}\n", "[6, 7]")
    spec = build_spec(cfg)
    shapes = {w.name: w.shape for w in spec.weight_specs()}
    assert shapes["layers.0.kernel"] == (7, 20) and shapes["layers.0.recurrent_kernel"] == (5, 20)
    assert shapes["layers.0.bias"] == (20,)
    assert shapes["layers.1.bias"] == (2, 12) and spec.layers[1].output_shape == (4,)
    w = spec.init_weights(3)
    np.testing.assert_array_equal(w["layers.0.bias"][5:10], 1.0)  # forget gate
    rk = w["layers.1.recurrent_kernel"]  # orthogonal rows
    np.testing.assert_allclose(rk @ rk.T, np.eye(4), atol=1e-5)


def test_init_is_deterministic_and_seeded():
    spec = build_spec(load_config(ROOT / "examples/digits_mlp.yaml"))
    a, b, c = spec.init_weights(1), spec.init_weights(1), spec.init_weights(2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["layers.0.kernel"], c["layers.0.kernel"])
    limit = np.sqrt(6 / (64 + 128))
    assert np.abs(a["layers.0.kernel"]).max() <= limit and a["layers.0.kernel"].std() > limit / 3
    assert a["layers.0.bias"].dtype == np.float32 and not a["layers.0.bias"].any()


@pytest.mark.parametrize("layers,message", [
    ("    - {type: dens, units: 3}\n", r"model.layers\[0\].type: unknown layer type 'dens'"),
    ("    - {type: dense}\n", r"model.layers\[0\]: dense needs option 'units'"),
    ("    - {type: dense, units: 0}\n", r"model.layers\[0\].units: expected a positive integer, got 0"),
    ("    - {type: dense, units: 3, act: relu}\n", r"model.layers\[0\].act: unknown option for dense"),
    ("    - {type: dropout, rate: 1.5}\n", r"model.layers\[0\].rate: expected a number in \[0, 1\)"),
    ("    - {type: lstm, units: 3}\n", r"model.layers\[0\].type: lstm expects \(T, F\) sequence input"),
    ("    - {type: conv2d, filters: 2, kernel_size: 9}\n", r"model.layers\[0\]: window \[9, 9\] does not fit"),
    ("    - {type: conv2d, filters: 2, strides: 2, padding: same}\n", r"model.layers\[0\].padding: padding 'same' needs strides 1"),
    ("    - {type: reshape, shape: [10]}\n", r"model.layers\[0\].shape: cannot reshape \[8, 8, 1\] \(64 values\) to \[10\]"),
])
def test_layer_errors_are_located(tmp_path, layers, message):
    with pytest.raises(ConfigError, match=r"m.yaml:6: " + message):
        build_spec(cfg_with(tmp_path, layers))


def test_data_mismatch_errors(tmp_path):
    cfg = cfg_with(tmp_path, "    - {type: flatten}\n    - {type: dense, units: 10}\n", "[8, 8, 2]")
    spec = build_spec(cfg)
    with pytest.raises(ConfigError, match=r"m.yaml:4: model.input_shape: expected 64 values per sample"):
        check_against_data(cfg, spec, (64,), 10)
    cfg = cfg_with(tmp_path, "    - {type: flatten}\n    - {type: dense, units: 7}\n")
    with pytest.raises(ConfigError, match=r"m.yaml:7: model.layers\[1\]: model output shape \[7\] does not "
                                          r"match the data: expected \[10\] \(10 classes"):
        check_against_data(cfg, build_spec(cfg), (64,), 10)


def test_check_weights_names_the_key():
    spec = build_spec(load_config(ROOT / "examples/digits_mlp.yaml"))
    w = spec.init_weights(0)
    check_weights(spec, w, "f")
    bad = dict(w, **{"layers.0.kernel": np.zeros((3, 3), np.float32)})
    with pytest.raises(DataError, match=r"f: weight 'layers.0.kernel' has shape \[3, 3\], the config's model needs \[64, 128\]"):
        check_weights(spec, bad, "f")
    with pytest.raises(DataError, match="missing weight 'layers.2.bias'"):
        check_weights(spec, {k: v for k, v in w.items() if k != "layers.2.bias"}, "f")
