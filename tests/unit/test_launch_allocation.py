"""`hvtrain launch` and `hvtrain hosts` inside a scheduler allocation (issue 11), dry runs."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from tests.conftest import ROOT

SLURM = {"SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "77"}


def cli(*args: str, env_extra: dict[str, str] | None = None, path: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_", "LSB_"))}
    env.update(env_extra or {})
    if path:
        env["PATH"] = f"{path}:{env['PATH']}"
    return subprocess.run([sys.executable, "-m", "hvtrain", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def fake(tmp_path, name: str, script: str) -> str:
    p = tmp_path / name
    p.write_text("#!/bin/sh\n" + script)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(tmp_path)


def test_hosts_from_env_prints_each_format(tmp_path):
    path = fake(tmp_path, "scontrol", "exit 9\n")  # a broken scontrol must be reported, not ignored
    proc = cli("hosts", "from-env", env_extra=SLURM, path=path)
    assert proc.returncode == 2 and "scontrol show hostnames 'node[01-02]' failed" in proc.stderr
    proc = cli("hosts", "from-env", env_extra=SLURM)
    assert proc.returncode == 0 and proc.stdout == "node01 slots=2\nnode02 slots=2\n", proc.stderr
    assert cli("hosts", "from-env", "--format", "horovod", env_extra=SLURM).stdout == "node01:2,node02:2\n"
    assert cli("hosts", "from-env", "--format", "mpich", env_extra=SLURM).stdout == "node01:2\nnode02:2\n"
    outside = cli("hosts", "from-env")
    assert outside.returncode == 2 and "no scheduler allocation found" in outside.stderr


def test_hosts_check_reports_the_variables_it_read():
    proc = cli("hosts", "check", "-np", "4", env_extra=SLURM)
    assert proc.returncode == 0, proc.stderr
    assert "slurm allocation; read: SLURM_JOB_NODELIST=node[01-02], SLURM_TASKS_PER_NODE=2(x2)" in proc.stdout
    assert "total: 2 host(s), 4 slot(s)" in proc.stdout and "ok: -np 4 fits" in proc.stdout


def test_launch_inside_an_allocation_uses_it():
    proc = cli("launch", "--launcher", "mpirun", "--dry-run", "--", "train", "x.yaml", env_extra=SLURM)
    assert proc.returncode == 0, proc.stderr
    assert "-np 4 --hostfile '<hostfile>'" in proc.stdout
    assert "node01 slots=2\nnode02 slots=2\n" in proc.stdout
    hr = cli("launch", "-np", "3", "--dry-run", "--", "train", "x.yaml", env_extra=SLURM)
    assert "-np 3 -H node01:2,node02:2" in hr.stdout, hr.stdout + hr.stderr


def test_launch_with_srun_builds_its_argv(tmp_path):
    path = fake(tmp_path, "srun", "echo 'MPI plugin types are...'\necho none\necho pmix\necho pmix_v4\n")
    proc = cli("launch", "--launcher", "srun", "--dry-run", "--", "train", "x.yaml", env_extra=SLURM, path=path)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().splitlines()[0]
    assert line.startswith(f"{tmp_path}/srun --ntasks 4 --export=ALL --kill-on-bad-exit=1 --mpi=pmix ")
    assert line.endswith("-m hvtrain train x.yaml")
    bare = fake(tmp_path, "srun", "echo none\n")
    proc = cli("launch", "--launcher", "srun", "--dry-run", "--", "train", "x.yaml", env_extra=SLURM, path=bare)
    assert "--mpi" not in proc.stdout
    outside = cli("launch", "-np", "2", "--launcher", "srun", "--dry-run", "--", "train", "x.yaml", path=path)
    assert outside.returncode == 2 and "inside a Slurm allocation" in outside.stderr
