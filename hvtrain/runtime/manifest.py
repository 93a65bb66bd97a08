"""manifest.json: what a cluster user needs to reproduce a run or file a bug.

Versions (hvtrain, Horovod and whether it carries hvtrain's launcher patch, the framework, MPI,
Python), the launcher and its argv, hosts and slots (every rank says where it runs), world size,
the Horovod knobs in effect, the scheduler job, the config hash and the git commit of the working
directory when there is one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from hvtrain.config.schema import Config
from hvtrain.launch.horovodrun import MODULE as HOROVODRUN_MODULE
from hvtrain.launch.horovodrun import runner_patch
from hvtrain.launch.process import elastic_launch, launched_with_gloo, launcher_rank
from hvtrain.version import __version__

LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun", "horovodrun", "srun", "jsrun", "aprun")
JOB_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "PBS_JOBID", "LSB_JOBID")


def config_hash(cfg: Config, without: tuple[str, ...] = ()) -> str:
    """The config's hash; `without` leaves top-level keys out (output_dir: the same run named by a
    relative or an absolute path)."""
    from hvtrain.config.validate import experiment_record

    data = {k: v for k, v in experiment_record(cfg).items() if k not in without}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def training_hash(cfg: Config) -> str:
    """What summary.json records of the config that trained it (config_hash without output_dir)."""
    return config_hash(cfg, without=("output_dir",))


def launcher() -> dict[str, Any]:
    """The launcher this rank descends from (its command line when it runs on this host), else how
    the environment says it was started."""
    kind = ("horovodrun --gloo (elastic)" if elastic_launch() else "horovodrun --gloo" if launched_with_gloo()
            else "mpirun" if "OMPI_COMM_WORLD_SIZE" in os.environ
            else "srun" if "SLURM_STEP_ID" in os.environ else "pmi" if "PMI_RANK" in os.environ else "none")
    try:
        import psutil

        for parent in psutil.Process().parents():
            argv = parent.cmdline()
            names = {parent.name()} | {os.path.basename(a) for a in argv[:2]}
            if argv[1:3] == ["-m", HOROVODRUN_MODULE]:  # hvtrain launch's horovodrun
                names.add("horovodrun")
            hit = next((n for n in LAUNCHERS if n in names), None)
            if hit:
                return {"kind": kind, "name": hit, "argv": argv}
    except Exception:  # noqa: BLE001 - best effort: another user's process, a vanished parent
        pass
    return {"kind": kind, "name": None, "argv": None}


def git_commit(path: str = ".") -> dict[str, Any] | None:
    try:
        head = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.TimeoutExpired):
        return None


# Facts that need a subprocess (mpirun --version, git), taken before MPI starts: forking after
# MPI_Init is unsafe with some interconnects (OpenMPI warns about fork() under verbs/InfiniBand).
_BEFORE_MPI: dict[str, Any] = {}
def collect_before_mpi() -> None:
    """On the process that will be rank 0 (by its launcher's variables), run the subprocesses now."""
    from hvtrain.launch.mpi import detect

    if launcher_rank() in (None, 0) and _BEFORE_MPI.get("cwd") != os.getcwd():  # a later session elsewhere
        _BEFORE_MPI.update(mpi=detect(), git=git_commit(os.getcwd()), cwd=os.getcwd())


def versions(backend: str) -> dict[str, str | None]:
    """Horovod's and the framework's versions (both imported by now)."""
    framework = {"torch": "torch", "tensorflow": "tensorflow"}.get(backend, backend)
    return {"backend": backend,
            "framework_version": getattr(sys.modules.get(framework), "__version__", None),
            "horovod": getattr(sys.modules.get("horovod"), "__version__", None)}


# OpenMPI's own wiring of this job (daemon URIs, session dirs, transport keys): not settings
LAUNCHER_INTERNAL = ("OMPI_MCA_orte_", "OMPI_MCA_ess", "OMPI_MCA_pmix", "OMPI_MCA_initial_wdir", "OMPI_MCA_shmem_",
                     "OMPI_MCA_mpi_oversubscribe")


def build(cfg: Config, hosts: list[str], world_size: int, cpus: list[list[int]] | None = None) -> dict[str, Any]:
    """The manifest (rank 0), given every rank's host name (and cores it may run on) in rank order."""
    from hvtrain.launch.mpi import detect

    mpi = _BEFORE_MPI.get("mpi") or detect()  # after MPI_Init only if rank 0 was not known before
    counts = Counter(hosts)
    return {
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "hvtrain": __version__, "python": platform.python_version(), "platform": platform.platform(),
        **versions(cfg.backend),
        "horovod_runner_patch": runner_patch(),  # present (N): docs/hpc.md's horovodrun pre-emption rows hold
        "mpi": {"flavour": mpi.flavour, "version": mpi.version, "mpirun": mpi.path},
        "launcher": launcher(), "argv": sys.argv,
        "world_size": world_size,
        "hosts": [{"host": h, "slots": n} for h, n in counts.items()],
        "rank_hosts": hosts,
        "rank_cpus": cpus,
        "cpu_binding": cfg.train.cpu_binding,
        "horovod_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("HOROVOD_")},
        "mpi_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("OMPI_MCA_", "PRTE_MCA_"))
                    and not k.startswith(LAUNCHER_INTERNAL)},
        "scheduler": {k: os.environ[k] for k in JOB_VARS if k in os.environ},
        "config_hash": config_hash(cfg),
        "git": _BEFORE_MPI["git"] if _BEFORE_MPI.get("cwd") == os.getcwd() else git_commit(os.getcwd()),
        "host": socket.gethostname(),
    }
