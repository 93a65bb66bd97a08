"""CLI behaviour without any framework: error lines, dry-run argv, import hygiene."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hvtrain.cli import cli
from tests.support.configs import LIGHT

ROOT = Path(__file__).resolve().parents[2]


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_hosts_check_prints_hosts_and_total():
    r = invoke("hosts", "check", str(ROOT / "hostfiles/example-cluster"))
    assert r.exit_code == 0
    assert "gpu-node02  slots=4 max_slots=4" in r.output and r.output.rstrip().endswith("total: 4 host(s), 16 slot(s)")


def test_hosts_check_error_is_one_line(tmp_path):
    p = tmp_path / "h"
    p.write_text("good:2\nbad slots=\n")
    r = invoke("hosts", "check", str(p))
    assert r.exit_code == 2
    assert r.output == f"hvtrain: error: {p}:2: expected 'host slots=N', 'host:N' or 'host', got 'bad slots='\n"


def test_launch_dry_run_horovodrun_exact_argv():
    r = invoke("launch", "-np", "2", "--hostfile", str(ROOT / "hostfiles/localhost"), "--dry-run", "--",
               "train", "examples/digits_mlp.yaml", "--set", "train.epochs=1")
    assert r.exit_code == 0, r.output
    argv = shlex.split(r.output.splitlines()[0])
    assert argv[:3] == [sys.executable, "-m", "hvtrain.launch.horovodrun"]  # Horovod's launcher, check cached
    assert argv[3:] == ["-np", "2", "-H", "localhost:2", "--mpi", sys.executable, "-m", "hvtrain", "train",
                        "examples/digits_mlp.yaml", "--set", "train.epochs=1"]


def test_launch_dry_run_mpirun_renders_hostfile(tmp_path):
    p = tmp_path / "h"
    p.write_text("# mixed syntax\nlocalhost:2\n")
    r = invoke("launch", "-np", "2", "--launcher", "mpirun", "--hostfile", str(p), "--dry-run", "--", "train", "x.yaml")
    assert r.exit_code == 0, r.output
    argv = shlex.split(r.output.splitlines()[0])
    assert argv[1:6] == ["-np", "2", "--hostfile", "<hostfile>", "--bind-to"]
    assert "localhost slots=2" in r.output  # rendered in OpenMPI syntax


def test_launch_refuses_more_ranks_than_slots():
    r = invoke("launch", "-np", "3", "--hostfile", str(ROOT / "hostfiles/localhost"), "--", "train", "x.yaml")
    assert r.exit_code == 2
    assert "-np 3 asks for more ranks than the 2 slot(s) available" in r.output


@pytest.mark.parametrize("yaml_text,message", [
    ("name: x\ndata: {dataset: sklearn:digits}\nmodel: {input_shape: [64], layers: [{type: dense, units: 10}]}\n"
     "trian: {epochs: 1}\n", "bad.yaml:4: trian: unknown key"),
    ("name: x\ndata: {dataset: sklearn:digits}\nmodel: {input_shape: [64], layers: [{type: dense, units: 10}]}\n"
     "train: {epochs: two}\n", "bad.yaml:4: train.epochs: expected an integer, got a string 'two'"),
    ("name: x\ndata: {dataset: sklearn:digits}\nmodel:\n  input_shape: [64]\n  layers:\n    - {type: densse}\n",
     "bad.yaml:6: model.layers[0].type: unknown layer type 'densse'"),
    ("name: x\ndata: {dataset: 'csv:nowhere.csv'}\nmodel: {input_shape: [3], layers: [{type: dense, units: 2}]}\n",
     "bad.yaml:2: data.dataset: dataset file not found"),
    ("name: x\ndata: {dataset: sklearn:digits}\nmodel: {input_shape: [60], layers: [{type: dense, units: 10}]}\n",
     "bad.yaml:3: model.input_shape: expected 64 values per sample"),
    ("name: x\ndata: {dataset: sklearn:digits}\nmodel:\n  input_shape: [64]\n  layers:\n    - {type: dense, units: 9}\n",
     "bad.yaml:6: model.layers[0]: model output shape [9] does not match the data: expected [10]"),
])
def test_train_bad_input_one_line_exit_2(tmp_path, yaml_text, message):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml_text)
    r = invoke("train", str(p))
    assert r.exit_code == 2
    lines = r.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hvtrain: error: ") and message in lines[0], r.output


def test_backend_flag_conflicting_with_env(monkeypatch):
    monkeypatch.setenv("HVTRAIN_BACKEND", "tensorflow")
    r = invoke("train", str(ROOT / "examples/digits_mlp.yaml"), "--backend", "torch")
    assert r.exit_code == 2 and "--backend 'torch' conflicts with HVTRAIN_BACKEND='tensorflow'" in r.output


@pytest.mark.parametrize("args", [
    ["hosts", "check", "hostfiles/example-cluster"],
    ["launch", "-np", "2", "--dry-run", "--", "train", "examples/digits_mlp.yaml"],
    ["launch", "-np", "2", "--launcher", "mpirun", "--hostfile", "hostfiles/localhost", "--dry-run", "--", "train", "x"],
])
def test_login_node_commands_import_no_framework(args):
    proc = subprocess.run([sys.executable, "-c", LIGHT, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_evaluate_rejects_mismatched_weights_in_one_line(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    w = tmp_path / "w.safetensors"
    save_file({"layers.0.kernel": np.zeros((3, 3), np.float32)}, str(w))
    r = invoke("evaluate", str(ROOT / "examples/digits_mlp.yaml"), "--weights", str(w))
    assert r.exit_code == 2
    assert r.output == (f"hvtrain: error: {w}: weight 'layers.0.kernel' has shape [3, 3], the config's model "
                        "needs [64, 128]\n")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 20)
    r = invoke("evaluate", str(ROOT / "examples/digits_mlp.yaml"), "--weights", str(tmp_path / "junk.safetensors"))
    assert r.exit_code == 2 and "not a readable safetensors file" in r.output and len(r.output.splitlines()) == 1
