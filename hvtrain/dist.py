"""Process and launch facts, computed once; the one place that reads HVTRAIN_* settings."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hvtrain.errors import ConfigError

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


def local_size_from_env() -> int:
    """Ranks on this host, from whichever launcher started us (1 when run alone)."""
    for name in ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def elastic_launch() -> bool:
    """Started by `horovodrun --min-np/--max-np/--host-discovery-script` (Horovod elastic)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def launched_with_gloo() -> bool:
    return "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ


def default_threads(local_size: int) -> int:
    """Intra-op threads per rank: this host's usable cores shared by its ranks."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_size))


def horovod_env(cycle_time_ms: float, fusion_threshold_mb: float) -> dict[str, str]:
    """Horovod knobs from the config; a HOROVOD_* variable already set by the user wins.

    Under Horovod elastic the fusion threshold is left to Horovod: measured with 0.28.1, a
    survivor segfaults in hvd.init() on the reset after a peer dies when
    HOROVOD_FUSION_THRESHOLD is set explicitly (HOROVOD_CYCLE_TIME alone is fine)."""
    wanted = {"HOROVOD_CYCLE_TIME": f"{cycle_time_ms:g}"}
    if not elastic_launch():
        wanted["HOROVOD_FUSION_THRESHOLD"] = str(int(fusion_threshold_mb * 1024 * 1024))
    return {k: v for k, v in wanted.items() if k not in os.environ}


def abort_job(info: ProcessInfo, code: int) -> None:
    """End every rank now. MPI: MPI_Abort (the launcher kills the job). Gloo: exit this process
    without running exit handlers (a Horovod shutdown would wait for the other ranks)."""
    import sys

    sys.stderr.flush()
    sys.stdout.flush()
    if info.controller == "mpi":
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    os._exit(code)
