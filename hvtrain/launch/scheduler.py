"""Hosts and slots from the batch scheduler's allocation: Slurm, PBS/Torque, LSF.

Read from the environment a job step sees; nothing is guessed from host names. Slurm node lists
are expanded by `scontrol show hostnames` when it is on PATH (the scheduler's own answer), else
by python-hostlist (a maintained parser of the same syntax: `node[01-04,07]`, `a[1-2]-ib[3-4]`,
comma lists). Every host goes through hostfile.validate_host before it reaches a launcher argv.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hvtrain.errors import HostfileError
from hvtrain.launch.hostfile import HostSlots, validate_host

SLURM_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
PBS_VARS = ("PBS_NODEFILE",)
LSF_VARS = ("LSB_DJOB_HOSTFILE", "LSB_MCPU_HOSTS")


@dataclass(frozen=True)
class Allocation:
    scheduler: str  # slurm | pbs | lsf
    hosts: list[HostSlots]
    variables: dict[str, str] = field(default_factory=dict)  # what was read, for `hosts check`
    notes: tuple[str, ...] = ()  # decisions worth telling (a dropped launch node, the expander used)

    @property
    def slots(self) -> int:
        return sum(h.slots for h in self.hosts)


def detect(env: Mapping[str, str] | None = None, scontrol: str | None = None) -> Allocation | None:
    """The allocation this process runs in, or None outside any (Slurm first, then PBS, then LSF).

    Raises:
        HostfileError: a scheduler variable is present but malformed (names the variable).
    """
    env = os.environ if env is None else env
    if any(env.get(v) for v in SLURM_VARS):
        return _slurm(env, shutil.which("scontrol") if scontrol is None else scontrol)
    if env.get("PBS_NODEFILE"):
        return _pbs(env)
    if env.get("LSB_DJOB_HOSTFILE") or env.get("LSB_MCPU_HOSTS"):
        return _lsf(env)
    return None


def require(env: Mapping[str, str] | None = None) -> Allocation:
    found = detect(env)
    if found is None:
        names = ", ".join(SLURM_VARS + PBS_VARS + LSF_VARS)
        raise HostfileError(f"no scheduler allocation found in the environment (looked for {names}); "
                            "give --hostfile or -H, or run inside a Slurm, PBS or LSF job")
    return found


# ----------------------------------------------------------------------------- Slurm


# SLURM_STEP_ID of salloc's shell under LaunchParameters=use_interactive_step (SLURM_INTERACTIVE_STEP,
# 0xfffffffa in slurm.h): a step of one task on the first node that holds no resources of its own
INTERACTIVE_STEP = str(0xFFFFFFFA)


def _slurm(env: Mapping[str, str], scontrol: str | None) -> Allocation:
    """Inside a job step (`srun --pty bash`) the step's node list and task counts go together
    (srun rewrites SLURM_TASKS_PER_NODE for the step); else the job's. salloc's interactive step
    (the shell salloc starts on the first node) is the job's: it holds no resources, and its one
    node and task are not what the job was given (srun's --preserve-env, in Slurm's default
    InteractiveStepOptions, keeps the job's task counts). Slots: tasks per node, else CPUs per node
    / SLURM_CPUS_PER_TASK, else one per node."""
    if env.get("SLURM_HET_SIZE"):
        raise HostfileError("SLURM_HET_SIZE is set: heterogeneous Slurm jobs are not supported; write a hostfile "
                            "(hvtrain launch --hostfile) for the components to run on")
    interactive = env.get("SLURM_STEP_ID") == INTERACTIVE_STEP and any(env.get(v) for v in SLURM_VARS[1:])
    step = bool(env.get("SLURM_STEP_NODELIST")) and not interactive
    var = "SLURM_STEP_NODELIST" if step else next(v for v in SLURM_VARS[1:] if env.get(v))
    nodes = expand_nodelist(env[var], scontrol, var)
    how = "scontrol show hostnames" if scontrol else "python-hostlist"
    read = {var: env[var]}
    if interactive:
        read["SLURM_STEP_ID"] = env["SLURM_STEP_ID"]
    candidates = ("SLURM_STEP_TASKS_PER_NODE",) if step else ("SLURM_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE")
    slots_var = next((v for v in candidates if env.get(v)), None)
    if slots_var is None:
        counts = [1] * len(nodes)
    else:
        read[slots_var] = env[slots_var]
        counts = expand_counts(env[slots_var], slots_var)
        if slots_var == "SLURM_JOB_CPUS_PER_NODE" and env.get("SLURM_CPUS_PER_TASK", "").isdigit():
            read["SLURM_CPUS_PER_TASK"] = env["SLURM_CPUS_PER_TASK"]
            counts = [max(1, c // int(env["SLURM_CPUS_PER_TASK"])) for c in counts]
        if len(counts) != len(nodes):
            raise HostfileError(f"{slots_var}={env[slots_var]!r} gives {len(counts)} node(s) but {var} lists "
                                f"{len(nodes)}")
    for extra in ("SLURM_JOB_ID", "SLURM_NTASKS"):
        if env.get(extra):
            read[extra] = env[extra]
    hosts = [HostSlots(validate_host(n, var), c, None, var) for n, c in zip(nodes, counts, strict=True)]
    notes = (f"node list expanded by {how}", f"slots from {slots_var or 'one per node (no task count set)'}")
    if interactive:
        notes += ("salloc's interactive step: the job's allocation, not the step's one node",)
    return Allocation("slurm", hosts, read, notes)


def expand_nodelist(text: str, scontrol: str | None = None, var: str = "SLURM_JOB_NODELIST") -> list[str]:
    """A Slurm node list in any compressed form -> host names, in Slurm's order. `var` is the
    variable it was read from, which errors name."""
    if scontrol:
        proc = subprocess.run([scontrol, "show", "hostnames", text], capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            err = proc.stderr.strip()
            raise HostfileError(f"{var}: scontrol show hostnames {text!r} failed (exit {proc.returncode})"
                                + (f": {err}" if err else ""))
        return proc.stdout.split()
    import hostlist  # python-hostlist

    try:
        names = hostlist.expand_hostlist(text)
    except hostlist.BadHostlist as exc:
        raise HostfileError(f"{var}={text!r}: not a Slurm node list ({exc})") from None
    if not names:
        raise HostfileError(f"{var}={text!r}: no hosts")
    return names


_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_counts(text: str, var: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Slurm's per-node counts: `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in text.split(","):
        m = _COUNT.match(item.strip())
        if not m or int(m.group(1)) < 1:
            raise HostfileError(f"{var}={text!r}: expected counts like '2(x3),1', got {item!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


# ----------------------------------------------------------------------------- PBS / LSF


def _merged(pairs: list[tuple[str, int]], var: str) -> list[HostSlots]:
    """(host, slots) pairs -> one record per host, its slots summed, in the order hosts first
    appear: a scheduler lists a host again for more of its slots (one line per slot in a node
    file; `hA 2 hB 2 hA 2` in LSB_MCPU_HOSTS), and a launcher given a host twice (`-H hA:2,hB:2,hA:2`)
    does not add them up."""
    counts: dict[str, int] = {}
    for name, n in pairs:
        counts[name] = counts.get(name, 0) + n
    return [HostSlots(h, n, None, var) for h, n in counts.items()]


def _per_slot_file(path: str, var: str) -> list[HostSlots]:
    """One host name per line, one line per slot (PBS_NODEFILE, LSB_DJOB_HOSTFILE), order kept."""
    try:
        lines = Path(path).read_text().split()
    except OSError as exc:
        raise HostfileError(f"{var}={path}: cannot read ({exc.strerror})") from None
    if not lines:
        raise HostfileError(f"{var}={path}: no hosts in the file")
    return _merged([(validate_host(name, f"{var} ({path})"), 1) for name in lines], var)


def _pbs(env: Mapping[str, str]) -> Allocation:
    read = {k: env[k] for k in ("PBS_NODEFILE", "PBS_JOBID", "PBS_NP") if env.get(k)}
    return Allocation("pbs", _per_slot_file(env["PBS_NODEFILE"], "PBS_NODEFILE"), read,
                      ("slots: lines per host in PBS_NODEFILE",))


def _lsf(env: Mapping[str, str]) -> Allocation:
    """LSF lists the job's first execution host first. On IBM CSM systems (Summit, Lassen:
    CSM_ALLOCATION_ID is set) that is the separate launch (batch) node, which runs no ranks: it is
    dropped. Elsewhere it is a compute host like the others. LSB_DJOB_HOSTFILE is preferred."""
    read = {k: env[k] for k in ("LSB_DJOB_HOSTFILE", "LSB_MCPU_HOSTS", "LSB_JOBID") if env.get(k)}
    if env.get("LSB_DJOB_HOSTFILE"):
        var = "LSB_DJOB_HOSTFILE"
        hosts = _per_slot_file(env[var], var)
    else:
        var, tokens = "LSB_MCPU_HOSTS", env["LSB_MCPU_HOSTS"].split()
        if len(tokens) % 2 or not all(t.isdigit() and int(t) > 0 for t in tokens[1::2]):
            raise HostfileError(f"LSB_MCPU_HOSTS={env['LSB_MCPU_HOSTS']!r}: expected 'host N host N ...'")
        hosts = _merged([(validate_host(h, var), int(n)) for h, n in zip(tokens[::2], tokens[1::2], strict=True)],
                        var)
    notes: tuple[str, ...] = ()
    if env.get("CSM_ALLOCATION_ID") and len(hosts) > 1:
        read["CSM_ALLOCATION_ID"] = env["CSM_ALLOCATION_ID"]
        notes = (f"dropped the launch node {hosts[0].host} (IBM CSM: the first host runs the batch script)",)
        hosts = hosts[1:]
    return Allocation("lsf", hosts, read, notes)


# ----------------------------------------------------------------------------- output


def render(hosts: list[HostSlots], fmt: str) -> str:
    """openmpi: `host slots=N` lines; mpich: `host:N` lines; horovod: `h:n,h:n` (one line)."""
    if fmt == "openmpi":
        return "".join(f"{h.host} slots={h.slots}\n" for h in hosts)
    if fmt == "mpich":
        return "".join(f"{h.host}:{h.slots}\n" for h in hosts)
    if fmt == "horovod":
        return ",".join(f"{h.host}:{h.slots}" for h in hosts) + "\n"
    raise HostfileError(f"unknown format {fmt!r}; expected openmpi, horovod or mpich")
