"""`hvtrain export -o PATH`: what PATH may replace (issue 12 review), checked before any framework
or data is touched. -o once overwrote the trained weights themselves; a failed export once left
the -o directory behind; a directory at -o for ONNX was called "not a SavedModel export"."""

from __future__ import annotations

import zipfile

import yaml
from click.testing import CliRunner

from hvtrain.cli import cli

CFG = {"name": "t", "backend": "torch", "data": {"dataset": "sklearn:digits"},
       "model": {"input_shape": [64], "layers": [{"type": "dense", "units": 10}]}, "loss": "cross_entropy"}


def _setup(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    weights = tmp_path / "run" / "final.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"trained weights")
    return cfg, weights


def _export(cfg, weights, out, fmt="torchscript", *extra):
    return CliRunner().invoke(cli, ["export", str(cfg), "--weights", str(weights), "--format", fmt,
                                    "--backend", "torch", "-o", str(out), *extra])


def test_export_refuses_to_overwrite_the_weights_config_or_input(tmp_path):
    cfg, weights = _setup(tmp_path)
    rows = tmp_path / "rows.npy"
    rows.write_bytes(b"rows")
    for out, what in ((weights, "--weights"), (tmp_path / "run" / ".." / "cfg.yaml", "the config"),
                      (rows, "--input")):
        r = _export(cfg, weights, out, "torchscript", "--input", str(rows))
        assert r.exit_code == 2 and len(r.output.splitlines()) == 1, r.output
        assert f"is {what}" in r.output and "overwrite" in r.output, r.output
    assert weights.read_bytes() == b"trained weights" and rows.read_bytes() == b"rows"
    assert yaml.safe_load(cfg.read_text()) == CFG


def test_export_replaces_only_an_artefact_of_the_same_format(tmp_path):
    cfg, weights = _setup(tmp_path)
    other = tmp_path / "notes.pt"
    other.write_bytes(b"not a model")
    r = _export(cfg, weights, other)
    assert r.exit_code == 2 and "not a TorchScript archive" in r.output and len(r.output.splitlines()) == 1
    assert other.read_bytes() == b"not a model"
    torch_save = tmp_path / "state.pt"  # a zip, but torch.save's, not torch.jit.save's
    with zipfile.ZipFile(torch_save, "w") as z:
        z.writestr("state/data.pkl", b"x")
    assert "not a TorchScript archive" in _export(cfg, weights, torch_save).output
    script = tmp_path / "old.pt"  # an earlier TorchScript export may be replaced: the checks go on to the weights
    with zipfile.ZipFile(script, "w") as z:
        z.writestr("old/constants.pkl", b"x")
        z.writestr("old/code/__torch__.py", b"x")
    r = _export(cfg, weights, script)
    assert r.exit_code == 2 and "not a readable safetensors file" in r.output, r.output


def test_export_onnx_over_a_directory_says_directory_not_savedmodel(tmp_path):
    cfg, weights = _setup(tmp_path)
    (tmp_path / "d").mkdir()
    r = _export(cfg, weights, tmp_path / "d", "onnx")
    assert r.exit_code == 2 and "got a directory" in r.output and "SavedModel" not in r.output, r.output


def test_failed_export_leaves_no_output_directory(tmp_path):
    cfg, weights = _setup(tmp_path)
    r = _export(cfg, weights, tmp_path / "new" / "deeper" / "m.pt")  # the weights are unreadable
    assert r.exit_code == 2 and "not a readable safetensors file" in r.output, r.output
    assert not (tmp_path / "new").exists()


def test_export_argument_errors_are_one_line_exit_2_before_any_framework(tmp_path):
    """`hvtrain export` on a login node: every argument error comes before torch/TensorFlow/Horovod
    (each is a module that fails when imported here), in one line, exit 2. The last case is new: an
    -o under a file failed only when the framework wrote the artefact."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.support.configs import NO_FRAMEWORK

    root = Path(__file__).resolve().parents[2]
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    for name in ("torch", "tensorflow", "horovod", "keras", "tf2onnx", "onnxruntime"):
        (blocker / f"{name}.py").write_text(NO_FRAMEWORK)
    cfg, weights = _setup(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    cases = [
        (["--format", "savedmodel", "--backend", "torch", "-o", "m"], "savedmodel"),
        (["--format", "onnx", "-o", str(tmp_path / "notes.txt")], "notes.txt: expected a new path or an ONNX file"),
        (["--format", "onnx", "-o", str(tmp_path / "notes.txt" / "m.onnx")], "is not a writable directory"),
        (["--format", "onnx", "-o", "m.onnx"], "final.safetensors: not a readable safetensors file"),
    ]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{blocker}:{root}"}
    for args, expect in cases:
        proc = subprocess.run([sys.executable, "-m", "hvtrain", "export", str(cfg), "--weights", str(weights), *args],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and expect in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
