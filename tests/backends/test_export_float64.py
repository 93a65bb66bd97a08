"""Exports of float64 data (issue 21 review, numerics): a graph takes what the run's raw rows need
and no more. Features far from zero relative to their spread (1e8 + N(0, 1): Unix timestamps,
coordinates in metres) need float64 rows and float64 normalisation, which the graphs lacked (a
float32 input rounded the rows before the float64 ops: `row 119 output 1: 0.548 vs 1.2e-08`); every
other graph keeps float32 throughout, as before the statistics travelled in float64 (TensorRT,
TFLite and many accelerators run no float64 op)."""

from __future__ import annotations

import numpy as np
import pytest

import hvtrain
from hvtrain.backends.registry import EXPORT_FORMATS
from hvtrain.tools.export import export_model
from tests.support.deployed import reload

EXPORTS = [(fmt, backend) for backend, formats in EXPORT_FORMATS.items() for fmt in formats]
TOL = 1e-4
MODEL = {"input_shape": [2], "layers": [{"type": "dense", "units": 16, "activation": "relu"},
                                        {"type": "dense", "units": 2}]}


def run_config(dataset: str, epochs: int = 5) -> dict:
    sizes = {"samples": 300, "features": 2} if dataset.startswith("synthetic:") else {}
    return {"name": "f64", "backend": "torch", "seed": 1,
            "data": {"dataset": dataset, "batch_size": 32, "validation_split": 0.25, **sizes},
            "model": MODEL, "optimizer": {"name": "adam", "lr": 0.02}, "loss": "cross_entropy",
            "train": {"epochs": epochs, "threads": 1}}


@pytest.fixture(scope="module")
def offset_run(tmp_path_factory):
    """Two float64 features 1e8 + N(0, 1) (float32 holds 1e8 only to a multiple of 8), trained by
    torch (weights are neutral: every backend exports them)."""
    d = tmp_path_factory.mktemp("offset")
    rng = np.random.default_rng(0)
    noise = rng.standard_normal((400, 2))
    np.savez(d / "d.npz", x=1e8 + noise, y=(noise[:, 0] + noise[:, 1] > 0).astype(np.int64))
    cfg = run_config(f"npz:{d / 'd.npz'}")
    summary = hvtrain.train(cfg, output_dir=str(d / "run"), quiet=True)
    return cfg, str(d / "run" / "final.safetensors"), 1e8 + rng.standard_normal((50, 2)), summary


@pytest.mark.parametrize("fmt,exporter", EXPORTS)
def test_a_float64_run_far_from_zero_exports_and_verifies_in_every_format(tmp_path, offset_run, fmt, exporter):
    """Defect: both exporters normalised in float64 inside the graph but declared its input float32,
    so the raw rows were rounded to multiples of 8 before the float64 ops and the export of a model
    at val_accuracy 0.975 failed its own verification. Now the input is float64 (the raw dtype,
    recorded in the inputs record) and the artefact, loaded as a deployment would, predicts what
    hvtrain.predict does on new raw rows."""
    cfg, weights, new_rows, summary = offset_run
    assert summary["val_accuracy"] > 0.9  # the features' noise is the signal: float32 rows would erase it
    path = tmp_path / f"m.{fmt}"
    result = export_model(cfg, weights, fmt, str(path), backend=exporter)
    assert result["input"]["dtype"] == "float64" and result["max_difference"] <= TOL and path.exists()
    want = hvtrain.predict(cfg, weights, new_rows)
    got = reload(fmt, str(path))(np.ascontiguousarray(new_rows))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    assert np.abs(want - 0.5).max() > 0.4  # confident predictions, which rounded rows would scramble
    if fmt == "onnx":
        assert "value x" in double_parts(str(path))  # a float64 input, unlike an ordinary run's graph (below)


def double_parts(path: str) -> list[str]:
    """Everything float64 in an ONNX graph: inputs, outputs, initializers, Constant and Cast nodes,
    and every value's inferred type."""
    import onnx
    from onnx import TensorProto

    model = onnx.shape_inference.infer_shapes(onnx.load(path))
    g, double = model.graph, TensorProto.DOUBLE
    found = [f"value {v.name}" for v in (*g.input, *g.output, *g.value_info) if v.type.tensor_type.elem_type == double]
    found += [f"initializer {t.name}" for t in g.initializer if t.data_type == double]
    for node in g.node:
        for a in node.attribute:
            if (node.op_type == "Cast" and a.name == "to" and a.i == double) or (
                    a.type == onnx.AttributeProto.TENSOR and a.t.data_type == double):
                found.append(f"{node.op_type} {node.name}")
    return found


@pytest.mark.parametrize("exporter", [b for b, formats in EXPORT_FORMATS.items() if "onnx" in formats])
@pytest.mark.parametrize("dataset", ["synthetic:classification", "sklearn:iris"])
def test_an_ordinary_runs_onnx_graph_has_no_float64_op(tmp_path, dataset, exporter):
    """Defect: every normalised export carried float64 Cast/Sub/Div ops (and float64 constants),
    the catalogue's too, since the statistics travelled in float64. A float32 run (synthetic) and
    a float64 run of ordinary features (iris, |mean| < 16 std) keep the float32 graph: input,
    constants and every value float32, verified against predict's float64 normalisation."""
    cfg = run_config(dataset, epochs=1)
    if dataset == "sklearn:iris":
        cfg["model"] = {"input_shape": [4], "layers": [{"type": "dense", "units": 3}]}
    hvtrain.train(cfg, output_dir=str(tmp_path / "run"), quiet=True)
    result = export_model(cfg, str(tmp_path / "run" / "final.safetensors"), "onnx", str(tmp_path / "m.onnx"),
                          backend=exporter)
    assert result["input"]["dtype"] == "float32" and result["max_difference"] <= TOL
    assert double_parts(str(tmp_path / "m.onnx")) == []
