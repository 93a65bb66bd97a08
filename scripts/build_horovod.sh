#!/usr/bin/env bash
# Build Horovod 0.28.1 for this venv's torch/TensorFlow, or reuse a cached wheel.
#
# Horovod's last release does not compile against torch >= 2.1 or TF >= 2.16 as
# released. The patch below is the smallest set of edits measured to work:
#   1. C++17 in the top CMakeLists.txt and horovod/torch/CMakeLists.txt
#      (torch >= 2.1 headers need it; torch >= 2.14's need C++20 there);
#   2. drop horovod/tensorflow/xla_mpi_ops.cc (includes pre-TF-2.16 XLA headers);
#   3. horovod/runner/mpi_run.py: double-dash OpenMPI options (--mca, --bind-to,
#      --map-by, --rank-by). OpenMPI 5's prterun rejects the single-dash forms
#      ("Executable: none"); OpenMPI 4.1 accepts both.
#   4. horovod/runner/mpi_run.py: mpirun runs as horovodrun's child (runner_patch.py),
#      not exec'd over it by /bin/sh -c, so a plain `horovodrun -np N hvtrain train`
#      is pre-empted like `hvtrain launch`: a SIGTERM to the whole job (Slurm) no
#      longer kills sh (exit 143) nor makes mpirun kill the ranks before they checkpoint
#      (mpirun starts with SIGTERM blocked); a SIGTERM/SIGUSR1 to horovodrun reaches the
#      ranks as SIGUSR1; horovodrun exits with mpirun's code (75 when pre-empted).
#   5. horovod/runner/gloo_run.py: horovodrun --gloo exits with the first failing
#      process's exit code and one line, not a RuntimeError traceback and exit 1
#      (a clean pre-emption is 75 on every rank). The Python API (run_func) still raises.
#      A SIGUSR1 to it ends the ranks as a SIGTERM does (SIGTERM to each, 5 s grace),
#      instead of killing horovodrun alone (exit 138, its ranks then ended anyway).
#   6. horovod/runner/common/util/safe_shell_exec.py: the middlemen, and the shells
#      they start (ignored, not blocked: dash unblocks every signal), ignore SIGTERM:
#      a SIGTERM to the whole job (Slurm) killed them, orphaning the ranks, and
#      horovodrun --gloo exited 143 whatever the ranks did. Horovod ends them through
#      its events (SIGTERM to the command, SIGKILL 5 s later).
#   7. the same file, terminate_executor_shell_and_children (the middleman ending its
#      command, e.g. on horovodrun --gloo's SIGTERM): it froze the shell (SIGSTOP) even
#      when every command had ended, and reaped it with psutil's wait, racing the
#      middleman's own subprocess wait: a pre-empted job's 75 came out as 0 (the lost
#      status) or 137 (the frozen shell SIGKILLed). Now the shell is frozen only while a
#      command is still alive, and waited for without reaping (runner_patch.py).
#   8. horovod/runner/gloo_run.py, _exec_command: a rank on this host runs its command
#      with SIGTERM back at its default (runner_patch.with_default_sigterm): an ignored
#      signal is inherited, so after edit 6 every rank ignored SIGTERM, and a rank without
#      a handler of its own (an elastic rank, predict, a user's script) could not be ended
#      by it: Horovod's teardown always waited 5 s, then SIGKILLed it. A remote rank's
#      ssh keeps ignoring it (the remote command starts afresh).
# cmake 4 needs CMAKE_POLICY_VERSION_MINIMUM=3.5 for Horovod's bundled projects.
#
# GPU build (second argument `gpu`, from `make setup GPU=1`): HOROVOD_GPU_OPERATIONS=NCCL against
# the CUDA toolkit and NCCL that pip installed beside the venv's CUDA torch (nvidia/cu13: nvcc,
# runtime, crt, nvvm, cccl; nvidia/nccl), so it compiles on a machine without a GPU or a system
# CUDA. NCCL is linked as the shared library torch ships and the torch binding links libcudart.so.13
# (the TF binding the static runtime): both are found at run time through RPATH entries into
# site-packages (a TensorFlow-only process loads them too); kernels for HOROVOD_BUILD_CUDA_CC_LIST
# (default 75,80,86,89,90,100,120: Turing to Blackwell; CUDA 13 has nothing older; part of the
# cache key, as nvcc's version is). `horovodrun --check-build` must then list NCCL.
#
# The wheel is cached under ${HVTRAIN_CACHE_DIR:-~/.cache/hvtrain}/horovod/<key>/,
# key = Python, torch, TensorFlow, MPI versions and this script's hash, so a
# change of any of them rebuilds.
#
# Usage: scripts/build_horovod.sh PYTHON [gpu]   (the venv's python)
set -euo pipefail

PY=${1:?usage: build_horovod.sh PYTHON [gpu]}
FLAVOUR=${2:-cpu}
case "$FLAVOUR" in cpu|gpu) ;; *) echo "build_horovod: second argument is cpu or gpu, not '$FLAVOUR'" >&2; exit 2;; esac
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"   # absolute: the build cds into the sdist
HVD_VERSION=0.28.1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache_root=${HVTRAIN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hvtrain}

versions=$("$PY" - <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
def v(*names):
    for n in names:
        try:
            return version(n)
        except PackageNotFoundError:
            pass
    sys.exit(f"build_horovod: {names[0]} is not installed in this venv; install it first")
print(f"py{sys.version_info[0]}{sys.version_info[1]}-torch{v('torch')}-tf{v('tensorflow-cpu', 'tensorflow')}")
PYEOF
)
mpi_version=$(mpirun --version 2>/dev/null | head -n 1 | tr -c 'A-Za-z0-9.\n' '_' || true)
[ -n "$mpi_version" ] || { echo "build_horovod: mpirun not found; install OpenMPI first" >&2; exit 1; }
script_hash=$(cat "${BASH_SOURCE[0]}" "$here/runner_patch.py" | sha256sum | cut -c1-12)
key="hvd${HVD_VERSION}-${versions}-${mpi_version}-${script_hash}"
if [ "$FLAVOUR" = gpu ]; then   # what the kernels are compiled for and by is part of the wheel too
  cc_list=${HOROVOD_BUILD_CUDA_CC_LIST:-75,80,86,89,90,100,120}
  nvcc_version=$("$PY" -c 'from importlib.metadata import version; print(version("nvidia-cuda-nvcc"))' 2>/dev/null) \
    || { echo "build_horovod: GPU build needs nvidia-cuda-nvcc (setup.sh GPU=1 installs it)" >&2; exit 1; }
  key="$key-nccl-nvcc$nvcc_version-sm${cc_list//,/_}"
fi
cache_dir="$cache_root/horovod/$key"

patch_runner() {  # patch_runner DIR (horovod/runner): edits 4 to 8, checked
  cp "$here/runner_patch.py" "$1/hvtrain_patch.py"
  patch_file "$1/mpi_run.py" \
    "s|^        os.execve('/bin/sh', \['/bin/sh', '-c', mpirun_command\], env)$|        from horovod.runner.hvtrain_patch import run_mpirun; sys.exit(run_mpirun(mpirun_command, env))|" \
    "sys.exit(run_mpirun(mpirun_command, env))"
  patch_file "$1/gloo_run.py" \
    "/^def launch_gloo(/,/^def _get_min_start_hosts/ s|^            raise RuntimeError('Horovod detected that one or more processes exited with non-zero '$|            if not settings.run_func_mode: from horovod.runner.hvtrain_patch import exit_as; exit_as(name, exit_code)\n&|" \
    "exit_as(name, exit_code)"
  patch_file "$1/gloo_run.py" \
    "s|^    signal.signal(signal.SIGTERM, set_event_on_signal)$|&\n    signal.signal(signal.SIGUSR1, set_event_on_signal)  # hvtrain's patch: a notice, as SIGTERM|" \
    "signal.signal(signal.SIGUSR1, set_event_on_signal)"
  patch_file "$1/gloo_run.py" \
    "/^def _exec_command_fn(/,/^def create_run_env_vars/ s|^        if settings.verbose:$|        else:  # hvtrain's patch: edit 8\n            from horovod.runner.hvtrain_patch import with_default_sigterm; command = with_default_sigterm(command)\n\n&|" \
    "command = with_default_sigterm(command)"
  patch_file "$1/common/util/safe_shell_exec.py" \
    "s|^    os.setsid()$|&\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # hvtrain's patch: edit 6|" \
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)  # hvtrain"
  patch_file "$1/common/util/safe_shell_exec.py" \
    "s|^        p.send_signal(signal.SIGSTOP)$|        if alive: p.send_signal(signal.SIGSTOP)  # hvtrain's patch: edit 7|" \
    "if alive: p.send_signal(signal.SIGSTOP)"
  patch_file "$1/common/util/safe_shell_exec.py" \
    "s|^        p.wait(timeout=GRACEFUL_TERMINATION_TIME_S)$|        from horovod.runner.hvtrain_patch import wait_unreaped; wait_unreaped(p, GRACEFUL_TERMINATION_TIME_S)|" \
    "wait_unreaped(p, GRACEFUL_TERMINATION_TIME_S)"
}

wheel=$(ls "$cache_dir"/horovod-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
  echo "build_horovod: no cached wheel for $key; building (takes ~10 min on 2 cores)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$work"
  tar -xzf "$work/horovod-$HVD_VERSION.tar.gz" -C "$work"
  src="$work/horovod-$HVD_VERSION"

  patch_file() {  # patch_file FILE SED_EXPR GREP_AFTER: apply and check it took
    sed -i -e "$2" "$1"
    grep -q -e "$3" "$1" || { echo "build_horovod: patch '$2' did not apply to $1" >&2; exit 1; }
  }
  patch_file "$src/CMakeLists.txt" 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' 'set(CMAKE_CXX_STANDARD 17)'
  # torch >= 2.14's headers need C++20 (std::strong_ordering in c10/util/intrusive_ptr.h)
  torch_std=$("$PY" -c 'import torch; print(20 if tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) >= (2, 14) else 17)')
  patch_file "$src/horovod/torch/CMakeLists.txt" "s/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD $torch_std)/" "set(CMAKE_CXX_STANDARD $torch_std)"
  grep -q xla_mpi_ops.cc "$src/horovod/tensorflow/CMakeLists.txt" || { echo "build_horovod: xla_mpi_ops.cc line not found" >&2; exit 1; }
  sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
  patch_file "$src/horovod/runner/mpi_run.py" \
    "s/'-mca /'--mca /g; s/'-bind-to /'--bind-to /g; s/'-map-by /'--map-by /g; s/'-rank-by /'--rank-by /g" \
    "\['--bind-to none', '--map-by slot'\]"
  if grep -nE "'-(mca|bind-to|map-by|rank-by) " "$src/horovod/runner/mpi_run.py"; then
    echo "build_horovod: single-dash OpenMPI options left in mpi_run.py" >&2; exit 1
  fi
  patch_runner "$src/horovod/runner"

  gpu_env=()
  if [ "$FLAVOUR" = gpu ]; then
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cuda="$site/nvidia/cu13" nccl="$site/nvidia/nccl"
    for f in "$cuda/bin/nvcc" "$cuda/include/cuda_runtime.h" "$cuda/lib/libcudart_static.a" "$nccl/include/nccl.h"; do
      [ -e "$f" ] || { echo "build_horovod: GPU build needs $f (setup.sh GPU=1 installs it)" >&2; exit 1; }
    done
    ls "$nccl"/lib/libnccl.so* >/dev/null 2>&1 || { echo "build_horovod: no libnccl.so in $nccl/lib" >&2; exit 1; }
    [ -e "$nccl/lib/libnccl.so" ] || ln -s "$(basename "$(ls "$nccl"/lib/libnccl.so.* | head -n 1)")" "$nccl/lib/libnccl.so"
    [ -e "$cuda/lib64" ] || ln -s lib "$cuda/lib64"   # nvcc.profile and FindCUDAToolkit look there too
    # the wheels ship versioned names only (libcudart.so.13); FindCUDAToolkit looks for libcudart.so
    for lib in "$cuda"/lib/lib*.so.*; do
      [ -e "${lib%.so.*}.so" ] || ln -s "$(basename "$lib")" "${lib%.so.*}.so"
    done
    # Horovod's setup.py runs $HOROVOD_CMAKE: this wrapper adds RPATH entries to its libraries (their
    # directory is site-packages/horovod/<framework>/) for NCCL and the CUDA 13 libraries (the torch
    # binding needs libcudart.so.13), relative, ahead of the absolute build-venv paths CMake also
    # records (those are harmless elsewhere: a path that does not exist is skipped), at configure only
    cat > "$work/cmake" <<WRAP
#!/bin/sh
case "\$1" in --*) exec cmake "\$@";; esac
exec cmake "\$@" '-DCMAKE_BUILD_RPATH=\$ORIGIN/../../nvidia/nccl/lib;\$ORIGIN/../../nvidia/cu13/lib' -DCMAKE_BUILD_WITH_INSTALL_RPATH=OFF
WRAP
    chmod +x "$work/cmake"
    # TF >= 2.18 exports no stream_executor::gpu::AsGpuStreamValue, which Horovod declares and calls
    # for the CUDA stream of a TF op (mpi_lib.so then fails to load: undefined symbol); the template
    # reads the same handle through Stream::platform_specific_handle(), where Stream is complete
    patch_file "$src/horovod/tensorflow/mpi_ops.cc" \
      's|^GpuStreamHandle AsGpuStreamValue(Stream\* stream);$|template <typename S> GpuStreamHandle AsGpuStreamValue(S* stream) { return static_cast<GpuStreamHandle>(stream->platform_specific_handle().stream); }  // hvtrain|' \
      'platform_specific_handle().stream); }  // hvtrain'
    gpu_env=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME="$cuda" HOROVOD_NCCL_HOME="$nccl"
             HOROVOD_NCCL_INCLUDE="$nccl/include" HOROVOD_NCCL_LIB="$nccl/lib" HOROVOD_NCCL_LINK=SHARED
             HOROVOD_BUILD_CUDA_CC_LIST="$cc_list"
             HOROVOD_CMAKE="$work/cmake" PATH="$cuda/bin:$PATH")
  fi
  # the compile's parallelism: a -jN of the caller's MAKEFLAGS, else 2 (make's own MAKEFLAGS also
  # carries its command line's variables and jobserver, which mean nothing to Horovod's build)
  jobs=$([[ "${MAKEFLAGS:-}" =~ -j([0-9]+) ]] && echo "-j${BASH_REMATCH[1]}" || echo -j2)
  (cd "$src" && \
    env CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS="$jobs" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_MXNET=1 "${gpu_env[@]}" \
    "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$work/dist" .)
  mkdir -p "$cache_dir"
  cp "$work"/dist/horovod-*.whl "$cache_dir/"
  wheel=$(ls "$cache_dir"/horovod-*.whl | head -n 1)
fi

"$PY" -m pip install -q --force-reinstall --no-deps "$wheel"
"$PY" -m pip install -q cloudpickle psutil pyyaml packaging

bindir=$(dirname "$PY")
report=$("$bindir/horovodrun" --check-build)
echo "$report"
wants=(TensorFlow PyTorch MPI Gloo)
[ "$FLAVOUR" = cpu ] || wants+=(NCCL)
for want in "${wants[@]}"; do
  grep -qF "[X] $want" <<<"$report" || { echo "build_horovod: Horovod was built without $want" >&2; exit 1; }
done
