"""Environment report for `hvtrain doctor`: versions, Horovod build, MPI, CPUs/GPUs."""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from hvtrain.backends.registry import BACKENDS
from hvtrain.launch import mpi
from hvtrain.launch.horovodrun import keras3_patch, runner_patch
from hvtrain.version import __version__

# What doctor looks for per registered backend (keys are exactly hvtrain.backends.registry.BACKENDS, checked
# by tests/unit/test_registry.py): the distributions that provide its framework (any one) and the
# framework's Horovod binding. Read from metadata so that a missing framework is reported, not raised.
FRAMEWORKS: dict[str, tuple[tuple[str, ...], str]] = {
    "torch": (("torch",), "horovod.torch"),
    "tensorflow": (("tensorflow-cpu", "tensorflow"), "horovod.tensorflow"),
}


@dataclass
class Report:
    sections: dict[str, dict[str, str]] = field(default_factory=dict)
    missing: dict[str, list[str]] = field(default_factory=dict)  # backend -> problems
    warnings: list[str] = field(default_factory=list)  # true of every backend; no reason to fail

    def problems(self, backend: str) -> list[str]:
        return self.missing.get(backend, [])


def _version(*names: str) -> str | None:
    for n in names:
        try:
            return version(n)
        except PackageNotFoundError:
            continue
    return None


def _horovod_build(module: str) -> tuple[str, list[str]]:
    """Import horovod.<fw> and read what it was built with."""
    try:
        hvd = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding
        return f"unusable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})", [
            f"{module} cannot be imported; run `make setup` (scripts/build_horovod.sh)"]
    built = {"mpi": hvd.mpi_built(), "gloo": hvd.gloo_built(), "nccl": hvd.nccl_built(),
             "ddl": hvd.ddl_built(), "ccl": hvd.ccl_built()}
    text = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in built.items())
    problems = [] if built["mpi"] or built["gloo"] else [f"{module} has neither MPI nor Gloo built"]
    return text, problems


def collect() -> Report:
    r = Report()
    r.sections["hvtrain"] = {"version": __version__, "python": f"{platform.python_version()} ({sys.executable})"}
    frameworks: dict[str, str] = {}
    for backend in BACKENDS:
        v = _version(*FRAMEWORKS[backend][0])
        frameworks[backend] = v or "not installed"
        if v is None:
            r.missing.setdefault(backend, []).append(f"{backend} is not installed (pip install hvtrain[{backend}])")
    r.sections["frameworks"] = frameworks
    hv = {"horovod": _version("horovod") or "not installed"}
    if hv["horovod"] == "not installed":
        for backend in BACKENDS:
            r.missing.setdefault(backend, []).append("horovod is not installed; run `make setup`")
    else:
        for backend in BACKENDS:
            module = FRAMEWORKS[backend][1]
            if frameworks[backend] == "not installed":
                continue
            text, problems = _horovod_build(module)
            hv[module] = text
            if problems:
                r.missing.setdefault(backend, []).extend(problems)
        hv["launcher patch"] = patch = runner_patch()
        if not patch.startswith("present"):
            # Training is unaffected, so doctor still passes; what docs/hpc.md promises of a
            # pre-empted horovodrun job (plain, or hvtrain launch's default launcher) does not hold.
            r.warnings.append(f"Horovod's launcher lacks hvtrain's patch ({patch}; scripts/build_horovod.sh "
                              "edits 4-8): a pre-empted horovodrun or horovodrun --gloo job, plain or under "
                              "hvtrain launch, may exit 143 or 1 without a checkpoint, not 75; use "
                              "`hvtrain launch --launcher mpirun`, or build Horovod with `make setup`")
        if frameworks.get("tensorflow", "not installed") != "not installed":
            hv["keras 3 patch"] = keras3 = keras3_patch()
            if not keras3.startswith("present"):
                r.missing.setdefault("tensorflow", []).append(
                    f"Horovod's TensorFlow binding lacks hvtrain's Keras 3 patch ({keras3}); run `make setup` "
                    "(or .venv/bin/python scripts/horovod_keras3.py)")
    r.sections["horovod"] = hv
    info = mpi.detect()
    r.sections["mpi"] = {"flavour": info.flavour, "version": info.version or "-", "mpirun": info.path or "-",
                         "mpi4py": _version("mpi4py") or "not installed"}
    gpus = gpu_facts(frameworks)
    r.sections["hardware"] = {"cpus": str(len(os.sched_getaffinity(0))), **gpus}
    nccl = {m: "nccl=yes" in hv.get(m, "") for m in ("horovod.torch", "horovod.tensorflow") if m in hv}
    if gpus["gpus"].isdigit() and int(gpus["gpus"]) > 0 and nccl and not any(nccl.values()):
        # a CPU build of Horovod has no CUDA at all: a GPU tensor cannot be reduced
        for backend in BACKENDS:
            r.missing.setdefault(backend, []).append(
                f"{gpus['gpus']} GPU(s) visible but Horovod was built without NCCL (a CPU build): "
                "run `make setup GPU=1`")
    r.warnings.extend(unseen_gpus(gpus, os.environ.get("CUDA_VISIBLE_DEVICES")))
    return r


# the oldest driver each CUDA major runs on (NVIDIA's CUDA compatibility table)
MIN_DRIVER = {12: 525, 13: 580}


def unseen_gpus(facts: dict[str, str], visible: str | None = None) -> list[str]:
    """Warnings where nvidia-smi lists GPUs that a framework does not see: that framework trains on
    the CPU (slower, not wrong). Why, as far as can be told: a CPU build, a driver older than its
    CUDA needs, or else CUDA libraries it could not load. `visible` is CUDA_VISIBLE_DEVICES: set and
    empty, the GPUs are hidden on purpose (nvidia-smi ignores it) and nothing is said."""
    listed = facts.get("nvidia-smi GPUs", "0")
    if not listed.isdigit() or int(listed) == 0 or (visible is not None and not visible.strip()):
        return []
    driver = facts.get("driver", "").split(".")[0]
    out = []
    for name, key, cuda in (("torch", "gpus", "torch CUDA"), ("TensorFlow", "TensorFlow GPUs", "TensorFlow CUDA")):
        if facts.get(key) != "0":
            continue
        version = facts.get(cuda, "")
        need = MIN_DRIVER.get(int(version.split(".")[0])) if version[:1].isdigit() else None
        if version.startswith("none"):
            why = "a CPU build: run `make setup GPU=1`"
        elif need and driver.isdigit() and int(driver) < need:
            why = f"its CUDA {version} needs driver R{need} or newer, this host has {facts.get('driver')}"
        else:
            named = "" if visible is None else f", or CUDA_VISIBLE_DEVICES={visible!r} names no GPU"
            why = f"its CUDA {version} libraries did not load{named}: TF_CPP_MIN_LOG_LEVEL=0 shows TensorFlow's reasons"
        out.append(f"nvidia-smi lists {listed} GPU(s) but {name} sees none ({why}); it trains on the CPU")
    return out


def gpu_facts(frameworks: dict[str, str]) -> dict[str, str]:
    """The GPU stack as the frameworks see it: devices and their names, the NVIDIA driver, the CUDA
    torch and TensorFlow were built for, the NCCL torch loads; "none" for what is absent (a CPU build)."""
    facts: dict[str, str] = {"gpus": "unknown (torch not installed)"}
    if frameworks.get("torch", "not installed") != "not installed":
        import torch

        count = torch.cuda.device_count()
        facts["gpus"] = str(count)
        for i in range(count):
            p = torch.cuda.get_device_properties(i)
            facts[f"cuda:{i}"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}"
        facts["torch CUDA"] = torch.version.cuda or "none (a CPU build of torch)"
        nccl = torch.cuda.nccl.version() if torch.version.cuda and torch.distributed.is_nccl_available() else None
        facts["NCCL (torch)"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl or "none")
    if frameworks.get("tensorflow", "not installed") != "not installed":
        import tensorflow as tf

        build = tf.sysconfig.get_build_info()
        facts["TensorFlow CUDA"] = build.get("cuda_version") or "none (a CPU build of TensorFlow)"
        facts["TensorFlow GPUs"] = str(len(tf.config.list_physical_devices("GPU")))
    facts["driver"], facts["nvidia-smi GPUs"] = _nvidia_smi()
    return facts


def _nvidia_smi() -> tuple[str, str]:
    """The NVIDIA driver's version and how many GPUs it lists (whatever CUDA_VISIBLE_DEVICES says)."""
    if shutil.which("nvidia-smi") is None:
        return "none (no nvidia-smi)", "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__})", "unknown"
    lines = out.stdout.split()
    if out.returncode != 0 or not lines:
        return f"unknown (nvidia-smi exited {out.returncode})", "unknown"
    return ", ".join(sorted(set(lines))), str(len(lines))
