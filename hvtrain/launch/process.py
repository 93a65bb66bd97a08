"""Process facts, computed once: the ProcessInfo of this rank, what its launcher told it before MPI
starts (rank and size for `rank r of N:` messages, Gloo or elastic launches), its CPUs and thread
count, the GPU of its local rank; and the one place that reads HVTRAIN_* settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvtrain.errors import ConfigError, LaunchError

# Environment variables that hvtrain reads, and the CLI option each one stands for.
ENV_SETTINGS = {"HVTRAIN_BACKEND": "--backend", "HVTRAIN_OUTPUT_DIR": "--output-dir"}


@dataclass(frozen=True)
class ProcessInfo:
    """Who this process is in the job. Built once by the backend right after hvd.init()."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    controller: str = "none"  # mpi | gloo | none (one process)
    cpus: tuple[int, ...] = ()  # the cores this rank bound itself to (train.cpu_binding); () = not bound

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setting(cli_value: str | None, env_name: str) -> str | None:
    """A setting given by CLI option or HVTRAIN_* variable; both and different is an error.

    Workers started by horovodrun/mpirun see the same argv and the forwarded environment,
    so a value reaches every rank the same way.
    """
    env_value = os.environ.get(env_name) or None
    if cli_value is not None and env_value is not None and cli_value != env_value:
        raise ConfigError(f"{ENV_SETTINGS[env_name]} {cli_value!r} conflicts with {env_name}={env_value!r}; "
                          "unset one of them")
    return cli_value if cli_value is not None else env_value


# (rank, size) variables of each launcher, before MPI starts. srun's last: a task of `srun
# --mpi=pmix` has PMIX_RANK but no size variable (PMIx hands the size out only once MPI asks), so
# srun's own pair speaks for it; SLURM_STEP_NUM_TASKS, not SLURM_NTASKS, which an sbatch script's
# plain processes (and every rank a launcher inside it starts) inherit with the job's task count.
LAUNCH_VARS = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
               ("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", "PMIX_SIZE"), ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"))


def launch_rank() -> tuple[int, int] | None:
    """(rank, size) as the launcher told this process, before Horovod starts (None: run alone)."""
    for rank_var, size_var in LAUNCH_VARS:
        rank, size = os.environ.get(rank_var, ""), os.environ.get(size_var, "")
        if rank.isdigit() and size.isdigit():
            return int(rank), int(size)
    return None


def elastic_launch() -> bool:
    """Started by `horovodrun --min-np/--max-np/--host-discovery-script` (Horovod elastic)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def launcher_rank() -> int | None:
    """This process's rank as its launcher set it, before MPI starts (None: run alone): launch_rank's,
    the one reader of LAUNCH_VARS (a bare SLURM_PROCID, which every process of an sbatch script
    inherits, names no rank)."""
    where = launch_rank()
    return where[0] if where else None


def launched_with_gloo() -> bool:
    return "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ


def default_threads(info: ProcessInfo) -> int:
    """Intra-op threads per rank: the CPUs it bound itself to, else the CPUs it may use shared by
    its host's ranks (a launcher that bound each rank to its own CPUs leaves it fewer: set
    train.threads then)."""
    if info.cpus:
        return len(info.cpus)
    cores = len(affinity()) or os.cpu_count() or 1
    return max(1, cores // max(1, info.local_size))


def affinity() -> tuple[int, ...]:
    """The CPUs this thread may run on (Linux); () where the OS does not say."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return ()


def topology_key(cpu: int) -> tuple[int, int, int]:
    """(socket, physical core, cpu) from sysfs: sorting by it keeps a core's hyperthreads and a
    socket's cores next to each other, so a contiguous share is whole cores of one socket."""
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return int((base / "physical_package_id").read_text()), int((base / "core_id").read_text()), cpu
    except (OSError, ValueError):
        return 0, cpu, cpu


def cpu_share(local_rank: int, local_size: int, mask: tuple[int, ...], host_cpus: int,
              key: Any = None) -> tuple[int, ...]:
    """The CPUs a rank binds itself to under `train.cpu_binding: auto`: its 1/local_size of the
    host's CPUs in topology order (`key`; the remainder spread one each over the first ranks),
    when the rank may run on every CPU of the host (`mask` has all `host_cpus`): nobody, launcher,
    scheduler or container, bound or confined it. () otherwise, and for one rank on the host or
    fewer CPUs than ranks. Measured with OpenMPI spinning (2 ranks on 2 cores, batch 128): unbound
    3.7k-10.9k samples/s (bimodal), bound 10.4-10.6k; with MPI yielding (bench levers, batch 512)
    binding is within the noise."""
    if local_size <= 1 or len(mask) != host_cpus or len(mask) < local_size:
        return ()
    cpus = sorted(mask, key=key)
    lo, hi = local_rank * len(cpus) // local_size, (local_rank + 1) * len(cpus) // local_size
    return tuple(sorted(cpus[lo:hi]))


def local_gpu(local_rank: int, local_size: int, gpu_count: int) -> int | None:
    """The GPU this rank pins (Horovod's local-rank pinning), or None to run on the CPU.

    Every rank on a host decides from the same (local_size, gpu_count), so either all of them
    pin a GPU or all of them fail alike: a host with more ranks than GPUs is refused rather than
    letting two ranks share a device (and deadlock or run out of memory in NCCL/cuDNN).

    Args:
        local_rank: this process's rank on its host (0 <= local_rank < local_size).
        local_size: ranks on this host.
        gpu_count: GPUs the framework sees on this host (0 = none, train on the CPU).

    Returns:
        `local_rank` as the device index, or None when there is no GPU.

    Raises:
        LaunchError: more ranks on this host than GPUs.
        ValueError: local_rank outside [0, local_size) (a bug in the caller, not user input).
    """
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local_rank must be in [0, {local_size}), got {local_rank}")
    if gpu_count <= 0:
        return None
    if local_size > gpu_count:
        raise LaunchError(f"{local_size} ranks on this host but {gpu_count} GPU(s): start at most {gpu_count} "
                          f"rank(s) per host (slots={gpu_count} in the hostfile), or hide the GPUs "
                          "(CUDA_VISIBLE_DEVICES=) to train on the CPU. Under Slurm, let every rank see the node's "
                          "GPUs (--gpus-per-node=N --gpu-bind=none, not --gpus-per-task=1): hvtrain pins one per local "
                          "rank, and NCCL keeps peer-to-peer between them")
    return local_rank
