"""manifest.json's subprocess facts (mpirun --version, git) are taken before MPI starts, on the
process that will be rank 0 only: a fork after MPI_Init is unsafe under verbs/InfiniBand."""

from __future__ import annotations

import pytest

from hvtrain.launch.process import LAUNCH_VARS
from hvtrain.runtime import manifest


@pytest.fixture
def clean(monkeypatch):
    for name in (name for pair in LAUNCH_VARS for name in pair):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(manifest, "_BEFORE_MPI", {})
    calls: list[str] = []
    monkeypatch.setattr("hvtrain.launch.mpi.detect", lambda: calls.append("mpirun --version") or "mpi-info")
    monkeypatch.setattr(manifest, "git_commit", lambda path: calls.append("git") or {"commit": "c"})
    return calls


@pytest.mark.parametrize("env, runs", [({}, True), ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}, True),
                                       ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}, False),
                                       ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}, False),
                                       ({"PMI_RANK": "0", "PMI_SIZE": "2"}, True),
                                       ({"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4"}, False),
                                       # horovodrun inside sbatch: every rank inherits SLURM_PROCID=0
                                       ({"SLURM_PROCID": "0", "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"}, False)])
def test_only_the_future_rank_0_runs_subprocesses_before_mpi(clean, monkeypatch, env, runs):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    manifest.collect_before_mpi()
    assert clean == (["mpirun --version", "git"] if runs else [])
    manifest.collect_before_mpi()  # once per process
    assert len(clean) == (2 if runs else 0)
