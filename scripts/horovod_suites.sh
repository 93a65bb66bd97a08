#!/usr/bin/env bash
# Horovod v0.28.1's own parallel test suites against this venv's (patched) build (issue 25).
# The suites are not in the sdist: give a checkout of github.com/horovod/horovod at v0.28.1
# (its test/ folder is used where it is; nothing is copied into this project).
#
# Usage: [VENV=.venv] scripts/horovod_suites.sh HOROVOD_CHECKOUT [SUITE...]
#   (default: test_tensorflow.py test_torch.py gloo:test_torch.py test_tensorflow2_keras.py)
# Each suite runs under `horovodrun -np 2`, a suite named gloo:SUITE under `horovodrun --gloo -np 2`
# (test_torch.py's Gloo-controller tests skip under MPI: the default runs it both ways); its pytest
# summary line and time are printed.
set -euo pipefail
src=${1:?usage: horovod_suites.sh HOROVOD_CHECKOUT [test_tensorflow.py test_torch.py ...]}
shift
suites=("$@")
[ ${#suites[@]} -gt 0 ] || suites=(test_tensorflow.py test_torch.py gloo:test_torch.py test_tensorflow2_keras.py)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin="$(cd "$here" && cd "${VENV:-.venv}" && pwd)/bin"
"$bin/python" -m pip install -q parameterized mock   # the suites' own test dependencies
export PATH="$bin:$PATH" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TF_CPP_MIN_LOG_LEVEL=2
cd "$src/test/parallel"
for suite in "${suites[@]}"; do
  log=$(mktemp)
  start=$(date +%s)
  controller=() file=$suite rank0='^\[1,0\]<std[a-z]*>:'
  [[ "$suite" == gloo:* ]] && controller=(--gloo) file=${suite#gloo:} rank0='^\[0\]<std[a-z]*>:'
  horovodrun "${controller[@]}" -np 2 -H localhost:2 python -m pytest -q -rfs --tb=line -p no:cacheprovider "$file" \
    >"$log" 2>&1 || true
  summary=$(sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -a "$rank0" | sed "s/$rank0//" \
            | grep -aE '^(FAILED|SUBFAILED|[0-9]+ (passed|failed))|(passed|failed).* in [0-9.]+s' | tail -n 12)
  echo "== $suite ($(( $(date +%s) - start )) s, log $log)"
  echo "$summary"
done
