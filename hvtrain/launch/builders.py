"""Pure launcher builders: (request) -> (argv, env). Nothing here runs or writes anything.

Every value is a separate argv element, so no host name, path or option from a config or
hostfile is ever interpreted by a shell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hvtrain.errors import LaunchError
from hvtrain.launch.hostfile import HostSlots, render_host_list, total_slots

# Variables forwarded to every rank by mpirun (by prefix, and by exact name).
FORWARD_PREFIXES = ("HVTRAIN_", "HOROVOD_", "OMP_", "OPENBLAS_", "MKL_", "TF_", "CUDA_", "NCCL_")
FORWARD_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "HOME")


@dataclass(frozen=True)
class LaunchRequest:
    np: int
    command: Sequence[str]  # the worker command, e.g. [python, -m, hvtrain, train, cfg.yaml]
    hosts: Sequence[HostSlots]
    hostfile: str | None = None  # a file already in the launcher's syntax (mpirun only)
    launcher_path: str = ""  # horovodrun or mpirun executable
    gloo: bool = False  # horovodrun only: Gloo controller instead of MPI
    as_root: bool = False  # OpenMPI refuses root without --allow-run-as-root
    extra: Sequence[str] = field(default_factory=tuple)  # passed through to the launcher


# mpirun's daemons on other hosts talk to it over TCP (OOB): with keepalive on, a host that
# vanishes (no reset: a cut link, a dead node) ends the job in 15-25 s with "ORTE has lost
# communication with a remote daemon ... on node H" instead of hanging until TCP gives up (hours).
# OpenMPI 4 reads OMPI_MCA_*, OpenMPI 5's PRRTE reads PRTE_MCA_*; a value the user set wins.
OOB_KEEPALIVE = {"oob_tcp_keepalive_time": "10", "oob_tcp_keepalive_intvl": "5", "oob_tcp_keepalive_probes": "3"}


def with_keepalive(env: Mapping[str, str]) -> dict[str, str]:
    out = dict(env)
    for prefix in ("OMPI_MCA_", "PRTE_MCA_"):
        for name, value in OOB_KEEPALIVE.items():
            out.setdefault(prefix + name, value)
    return out


def check_slots(np: int, hosts: Sequence[HostSlots]) -> None:
    """Refuse to start more ranks than the hosts have slots."""
    if np < 1:
        raise LaunchError(f"-np must be >= 1, got {np}")
    slots = total_slots(list(hosts))
    if np > slots:
        listing = ", ".join(f"{h.host}:{h.slots}" for h in hosts)
        raise LaunchError(f"-np {np} asks for more ranks than the {slots} slot(s) available ({listing})")


def forwarded_names(env: Mapping[str, str]) -> list[str]:
    return sorted(k for k in env if k in FORWARD_NAMES or k.startswith(FORWARD_PREFIXES))


def build_horovodrun(req: LaunchRequest, env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """horovodrun forwards the whole environment itself; hosts always go as `-H h:n,...`."""
    check_slots(req.np, req.hosts)
    argv = [req.launcher_path or "horovodrun", "-np", str(req.np), "-H", render_host_list(list(req.hosts))]
    argv += ["--gloo"] if req.gloo else ["--mpi"]
    argv += list(req.extra) + list(req.command)
    return argv, dict(env) if req.gloo else with_keepalive(env)


def build_mpirun(req: LaunchRequest, flavour: str, env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """mpirun for the detected MPI flavour: openmpi, mpich or intel."""
    check_slots(req.np, req.hosts)
    if req.gloo:
        raise LaunchError("--gloo is a horovodrun option; use --launcher horovodrun --gloo")
    names = forwarded_names(env)
    exe = req.launcher_path or "mpirun"
    if flavour == "openmpi":
        argv = [exe, "-np", str(req.np)]
        argv += ["--hostfile", req.hostfile] if req.hostfile else ["-H", render_host_list(list(req.hosts))]
        argv += ["--bind-to", "none", "--map-by", "slot"]
        if req.as_root:
            argv.append("--allow-run-as-root")
        for name in names:
            argv += ["-x", name]
    elif flavour in ("mpich", "intel"):
        argv = [exe, "-n", str(req.np)]
        argv += ["-f", req.hostfile] if req.hostfile else ["-hosts", render_host_list(list(req.hosts))]
        for name in names:
            argv += ["-genv", name, env[name]]
    else:
        raise LaunchError(f"unsupported MPI flavour {flavour!r}; expected openmpi, mpich or intel "
                          "(see `hvtrain doctor`)")
    argv += list(req.extra) + list(req.command)
    return argv, with_keepalive(env) if flavour == "openmpi" else dict(env)


def build_srun(req: LaunchRequest, env: Mapping[str, str],
               mpi_types: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """srun inside a Slurm allocation (sites where mpirun is not allowed): Slurm places the tasks
    on the allocation's nodes itself; `--mpi=pmix` when this Slurm offers it (`mpi_types`, from
    `srun --mpi=list`), so OpenMPI's ranks find each other through PMIx."""
    check_slots(req.np, req.hosts)
    if req.gloo:
        raise LaunchError("--gloo is a horovodrun option; srun starts MPI ranks")
    argv = [req.launcher_path or "srun", "--ntasks", str(req.np), "--export=ALL", "--kill-on-bad-exit=1"]
    if env.get("SLURM_CPUS_PER_TASK"):  # srun no longer inherits it from sbatch (Slurm >= 22.05)
        argv.append(f"--cpus-per-task={env['SLURM_CPUS_PER_TASK']}")
    pmix = [t for t in mpi_types if t.startswith("pmix")]
    if pmix:
        argv.append("--mpi=pmix")
    argv += list(req.extra) + list(req.command)
    return argv, dict(env)
