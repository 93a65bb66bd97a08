"""Which MPI is installed: flavour and version from `mpirun --version`."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class MPIInfo:
    flavour: str  # openmpi | mpich | intel | unknown | missing
    version: str
    path: str


def parse_version_output(text: str) -> tuple[str, str]:
    """`mpirun --version` text -> (flavour, version)."""
    patterns = [
        ("openmpi", r"Open MPI\)?\s+v?([\d.]+\w*)"),
        ("intel", r"Intel\(R\) MPI Library[^\d]*([\d.]+(?: Update \d+)?)"),
        ("mpich", r"(?:HYDRA|MPICH).*?[Vv]ersion:?\s*([\d.]+\w*)"),
    ]
    for flavour, pattern in patterns:
        m = re.search(pattern, text, re.S)
        if m:
            return flavour, m.group(1)
    if "Open MPI" in text or "Open RTE" in text:
        return "openmpi", "?"
    if "HYDRA" in text or "MPICH" in text:
        return "mpich", "?"
    return "unknown", "?"


def detect(mpirun: str | None = None) -> MPIInfo:
    path = mpirun or shutil.which("mpirun") or ""
    if not path:
        return MPIInfo("missing", "", "")
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return MPIInfo("unknown", "?", path)
    flavour, version = parse_version_output(proc.stdout + proc.stderr)
    return MPIInfo(flavour, version, path)
