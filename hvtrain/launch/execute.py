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


def run(p: Plan) -> int:
    """Run the planned launcher; return its exit code. A SIGTERM or SIGUSR1 sent to this process (a
    scheduler's pre-emption notice), from its start on, reaches the ranks as SIGUSR1 once they can
    take it (hvtrain.launch.notice), so they stop at a common step with a checkpoint, exit 75.

    The launcher starts with SIGTERM blocked (inherited; mpirun's ranks get it unblocked, and
    `hvtrain train` unblocks it): a SIGTERM sent to the whole job at once (Slurm's pre-emption)
    then reaches the ranks and this process, but not mpirun or horovodrun, which would kill the
    ranks before they can checkpoint (mpirun SIGKILLs them 2 s later and exits 1; horovodrun
    --gloo 5 s later). srun passes a SIGTERM on to its tasks itself, so it keeps it."""
    from hvtrain.launch.horovodrun import runner_patch
    from hvtrain.launch.notice import Notice

    if p.argv[1:3] == ["-m", HOROVODRUN_MODULE] and not (patch := runner_patch()).startswith("present"):
        print(f"hvtrain launch: warning: Horovod's launcher lacks hvtrain's patch ({patch}): a pre-emption may end "
              "this job with 143 or 1 instead of 75 and a checkpoint (`hvtrain doctor`)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="hvtrain-launch-") as tmp, Notice() as notice:
        argv = list(p.argv)
        if p.hostfile_text is not None:
            path = Path(tmp) / "hostfile"
            path.write_text(p.hostfile_text)
            argv = [str(path) if a == HOSTFILE_PLACEHOLDER else a for a in argv]
        blocked = set() if Path(argv[0]).name == "srun" else {signal.SIGTERM}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            proc = subprocess.Popen(argv, env=p.env)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        try:
            code = notice.serve(proc)
        except KeyboardInterrupt:
            proc.wait()
            return 130
        return 128 - code if code < 0 else code  # killed by signal N: the shell's 128+N
