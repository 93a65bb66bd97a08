"""The one module that starts launchers: resolve executables, prepare hostfiles, run argv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hvtrain.errors import LaunchError
from hvtrain.launch import mpi
from hvtrain.launch.builders import LaunchRequest, build_horovodrun, build_mpirun
from hvtrain.launch.hostfile import HostSlots, parse_hostfile, parse_hosts, render_hostfile


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


def plan(np: int, args: Sequence[str], launcher: str, hostfile: str | None, hosts: str | None,
         gloo: bool = False, extra: Sequence[str] = ()) -> Plan:
    """Everything about a launch except running it (what --dry-run prints)."""
    if hostfile and hosts:
        raise LaunchError("give --hostfile or -H, not both")
    records: list[HostSlots] = (parse_hostfile(hostfile) if hostfile else
                                parse_hosts(hosts) if hosts else [HostSlots("localhost", np, None, "default")])
    command = worker_command(args)
    env = dict(os.environ)
    if launcher == "horovodrun":
        req = LaunchRequest(np, command, records, launcher_path=find_executable("horovodrun"), gloo=gloo,
                            extra=tuple(extra))
        argv, env = build_horovodrun(req, env)
        return Plan(argv, env, None)
    info = mpi.detect(find_executable("mpirun"))
    text = render_hostfile(records, info.flavour) if hostfile else None
    req = LaunchRequest(np, command, records, hostfile=HOSTFILE_PLACEHOLDER if text else None,
                        launcher_path=info.path, gloo=gloo, as_root=os.geteuid() == 0, extra=tuple(extra))
    argv, env = build_mpirun(req, info.flavour, env)
    return Plan(argv, env, text)


def run(p: Plan) -> int:
    """Run the planned launcher; return its exit code."""
    with tempfile.TemporaryDirectory(prefix="hvtrain-launch-") as tmp:
        argv = list(p.argv)
        if p.hostfile_text is not None:
            path = Path(tmp) / "hostfile"
            path.write_text(p.hostfile_text)
            argv = [str(path) if a == HOSTFILE_PLACEHOLDER else a for a in argv]
        try:
            return subprocess.run(argv, env=p.env, check=False).returncode
        except KeyboardInterrupt:
            return 130
