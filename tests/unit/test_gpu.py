"""The GPU path's logic, on the CPU: what doctor says of a GPU host (device selection is in
test_dist.py, precision in tests/backends). scripts/gpu_check.sh proves the path on a GPU machine."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from hvtrain.cli import cli
from hvtrain.tools import doctor

GPU_HOST = {"gpus": "2", "cuda:0": "NVIDIA H100 80GB HBM3, 79 GiB, sm_90", "torch CUDA": "13.0",
            "NCCL (torch)": "2.30.7", "TensorFlow CUDA": "12.5.1", "TensorFlow GPUs": "2", "driver": "580.82.07",
            "nvidia-smi GPUs": "2"}


@pytest.mark.parametrize("nccl", ["no", "yes"])
def test_doctor_fails_a_gpu_host_whose_horovod_cannot_reduce_gpu_tensors(monkeypatch, nccl):
    """A CPU build of Horovod (no CUDA) on a host with GPUs: every step's allreduce of a GPU
    tensor would fail; doctor says so and what to run. With NCCL built, the same host is fine."""
    monkeypatch.setattr(doctor, "_horovod_build", lambda module: (f"mpi=yes, gloo=yes, nccl={nccl}", []))
    monkeypatch.setattr(doctor, "gpu_facts", lambda frameworks: dict(GPU_HOST))
    monkeypatch.setattr(doctor, "_version", lambda *names: "1.0")
    monkeypatch.setattr(doctor, "runner_patch", lambda: "present (2)")
    monkeypatch.setattr(doctor, "keras3_patch", lambda: "present (2)")
    result = CliRunner().invoke(cli, ["doctor"])
    assert "cuda:0                 NVIDIA H100 80GB HBM3, 79 GiB, sm_90" in result.output
    if nccl == "no":
        assert result.exit_code == 1, result.output
        assert ("problem: 2 GPU(s) visible but Horovod was built without NCCL (a CPU build): run `make setup GPU=1`"
                in result.output)
    else:
        assert result.exit_code == 0 and "problem" not in result.output, result.output


def test_doctor_warns_where_a_framework_does_not_see_the_gpus_nvidia_smi_lists():
    """The CPU venv on a GPU node, or CUDA 13 torch under an R570 driver: torch sees no GPU and
    every rank would train on the CPU; doctor says which and why (a warning: slower, not wrong)."""
    cpu_venv = dict(GPU_HOST, gpus="0", **{"torch CUDA": "none (a CPU build of torch)", "TensorFlow GPUs": "0",
                                          "TensorFlow CUDA": "none (a CPU build of TensorFlow)"})
    assert doctor.unseen_gpus(cpu_venv) == [
        "nvidia-smi lists 2 GPU(s) but torch sees none (a CPU build: run `make setup GPU=1`); it trains on the CPU",
        "nvidia-smi lists 2 GPU(s) but TensorFlow sees none (a CPU build: run `make setup GPU=1`); it trains on the CPU"]
    old_driver = dict(GPU_HOST, gpus="0", driver="570.86.15")
    assert doctor.unseen_gpus(old_driver) == [
        "nvidia-smi lists 2 GPU(s) but torch sees none (its CUDA 13.0 needs driver R580 or newer, this host has "
        "570.86.15); it trains on the CPU"]
    unloaded = dict(GPU_HOST, **{"TensorFlow GPUs": "0"})  # a new enough driver: the libraries, not the driver
    assert doctor.unseen_gpus(unloaded) == [
        "nvidia-smi lists 2 GPU(s) but TensorFlow sees none (its CUDA 12.5.1 libraries did not load: "
        "TF_CPP_MIN_LOG_LEVEL=0 shows TensorFlow's reasons); it trains on the CPU"]
    assert doctor.unseen_gpus(cpu_venv, visible="") == []  # hidden on purpose (make test, a CPU run)
    assert doctor.unseen_gpus(GPU_HOST) == [] and doctor.unseen_gpus(dict(GPU_HOST, **{"nvidia-smi GPUs": "0"})) == []


def test_doctor_reads_the_driver_and_gpu_count_from_nvidia_smi(monkeypatch):
    import subprocess

    monkeypatch.setattr(doctor.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(doctor.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a[0], 0, "580.82.07\n580.82.07\n", ""))
    assert doctor._nvidia_smi() == ("580.82.07", "2")
    monkeypatch.setattr(doctor.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a[0], 9, "", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"))
    assert doctor._nvidia_smi() == ("unknown (nvidia-smi exited 9)", "unknown")
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    assert doctor._nvidia_smi() == ("none (no nvidia-smi)", "0")
