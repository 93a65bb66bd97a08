"""The one module that starts launchers: resolve executables, prepare hostfiles, run argv."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hvtrain.errors import LaunchError
from hvtrain.launch import mpi
from hvtrain.launch.builders import LaunchRequest, build_horovodrun, build_mpirun, build_srun
from hvtrain.launch.horovodrun import MODULE as HOROVODRUN_MODULE
from hvtrain.launch.hostfile import HostSlots, parse_hostfile, parse_hosts, render_hostfile
from hvtrain.launch.scheduler import detect


@dataclass(frozen=True)
class Plan:
    argv: list[str]
    env: dict[str, str]
    hostfile_text: str | None  # written to a temp file for the run (mpirun + --hostfile)


HOSTFILE_PLACEHOLDER = "<hostfile>"


def worker_command(args: Sequence[str]) -> list[str]:
    """The command each rank runs: this Python, this hvtrain."""
    return [sys.executable, "-m", "hvtrain", *args]


def find_executable(name: str) -> str:
    """Prefer the launcher next to this Python (the venv), then PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if not found:
        raise LaunchError(f"{name} not found next to {sys.executable} or on PATH (run `make setup`)")
    return found


def plan(np: int | None, args: Sequence[str], launcher: str, hostfile: str | None, hosts: str | None,
         gloo: bool = False, extra: Sequence[str] = ()) -> Plan:
    """Everything about a launch except running it (what --dry-run prints). Hosts: --hostfile, -H,
    else the Slurm/PBS/LSF allocation this runs in, else localhost; -np defaults to all their slots."""
    if hostfile and hosts:
        raise LaunchError("give --hostfile or -H, not both")
    if launcher == "srun" and (hostfile or hosts):  # srun places its tasks on the allocation itself
        given = f"--hostfile {hostfile}" if hostfile else f"-H {hosts}"
        raise LaunchError(f"{given}: --launcher srun starts the tasks on the Slurm allocation's nodes itself and takes "
                          "no host list; drop it (and give -np), or use --launcher mpirun/horovodrun with it")
    alloc = None if hostfile or hosts else detect()
    if alloc is not None:
        records: list[HostSlots] = alloc.hosts
    elif hostfile or hosts:
        records = parse_hostfile(hostfile) if hostfile else parse_hosts(hosts)
    else:
        if np is None:
            raise LaunchError("-np is required outside a scheduler allocation without --hostfile or -H")
        records = [HostSlots("localhost", np, None, "default")]
    np = sum(r.slots for r in records) if np is None else np
    command = worker_command(args)
    env = dict(os.environ)
    if launcher == "srun":
        if alloc is None or alloc.scheduler != "slurm":
            raise LaunchError("--launcher srun runs inside a Slurm allocation (salloc/sbatch); none found")
        srun = find_executable("srun")
        listed = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True, timeout=30)
        req = LaunchRequest(np, command, records, launcher_path=srun, extra=tuple(extra))
        argv, env = build_srun(req, env, (listed.stdout + listed.stderr).split())
        return Plan(argv, env, None)
    if launcher == "horovodrun":
        if importlib.util.find_spec("horovod") is None:
            raise LaunchError(f"Horovod is not installed for {sys.executable} (run `make setup`)")
        req = LaunchRequest(np, command, records, gloo=gloo, extra=tuple(extra))
        argv, env = build_horovodrun(req, env)
        # Horovod's launcher itself, in this Python, with its per-launch build check cached
        return Plan([sys.executable, "-m", HOROVODRUN_MODULE, *argv[1:]], env, None)
    info = mpi.detect(find_executable("mpirun"))
    text = render_hostfile(records, info.flavour) if hostfile or alloc is not None else None
    req = LaunchRequest(np, command, records, hostfile=HOSTFILE_PLACEHOLDER if text else None,
                        launcher_path=info.path, gloo=gloo, as_root=os.geteuid() == 0, extra=tuple(extra))
    argv, env = build_mpirun(req, info.flavour, env)
    return Plan(argv, env, text)


MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun")


def run(p: Plan) -> int:
    """Run the planned launcher; return its exit code. SIGTERM or SIGUSR1 sent to this process (a
    scheduler's pre-emption notice) reaches the ranks as SIGUSR1 (see pass_on_signal), so they stop
    at a common step with a checkpoint instead of being killed by the launcher."""
    with tempfile.TemporaryDirectory(prefix="hvtrain-launch-") as tmp:
        argv = list(p.argv)
        if p.hostfile_text is not None:
            path = Path(tmp) / "hostfile"
            path.write_text(p.hostfile_text)
            argv = [str(path) if a == HOSTFILE_PLACEHOLDER else a for a in argv]
        proc = subprocess.Popen(argv, env=p.env)
        previous = {sig: signal.signal(sig, lambda signum, frame: pass_on_signal(proc.pid))
                    for sig in (signal.SIGTERM, signal.SIGUSR1)}
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            proc.wait()
            return 130
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 128 - code if code < 0 else code  # killed by signal N: the shell's 128+N


def pass_on_signal(launcher_pid: int) -> list[int]:
    """SIGUSR1 to the MPI launcher below `launcher_pid` (mpirun forwards it to every rank, on every
    host), else to every local process below it (horovodrun --gloo starts local ranks itself).
    Not SIGTERM: horovodrun ends its ranks on SIGTERM before they can react. Returns the pids."""
    import psutil

    try:
        below = [psutil.Process(launcher_pid), *psutil.Process(launcher_pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    mpi = [c for c in below if _name(c) in MPI_LAUNCHERS]
    # srun (no mpirun, no local rank below it) passes a SIGUSR1 it receives on to its tasks itself
    targets = mpi or [c for c in below if _is_rank(c)] or [c for c in below[:1] if _name(c) == "srun"]
    if not targets:  # horovodrun --gloo with no rank on this host: SIGUSR1 would just kill horovodrun
        print(f"hvtrain launch: cannot pass the signal on: no mpirun and no rank below pid {launcher_pid} on "
              "this host (horovodrun --gloo starts remote ranks over ssh); signal the ranks themselves",
              file=sys.stderr, flush=True)
    sent = []
    for c in targets:
        try:
            c.send_signal(signal.SIGUSR1)
            sent.append(c.pid)
        except psutil.NoSuchProcess:
            pass
    return sent


def _is_rank(process) -> bool:
    try:
        argv = process.cmdline()
    except Exception:  # noqa: BLE001 - a process that just ended
        return False
    return argv[1:3] == ["-m", "hvtrain"]


def _name(process) -> str:
    try:
        return process.name()
    except Exception:  # noqa: BLE001 - a process that just ended
        return ""
