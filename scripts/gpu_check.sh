#!/usr/bin/env bash
# The GPU path on one GPU, in under 4 minutes: run on a GPU machine after `make setup GPU=1`.
#   scripts/gpu_check.sh [OUT_DIR]     (VENV=.venv by default; the log goes to OUT_DIR/gpu_check.log)
# 1. hvtrain doctor: a GPU, its driver and CUDA, Horovod with NCCL
# 2. the digits MLP and CNN on GPU 0, torch and TensorFlow (each must allocate on the GPU, reach 0.85)
# 3. bf16 on the GPU, both frameworks
# 4. CPU-vs-GPU forward parity of the same weights, 1e-4 (fp32 is fp32 on the GPU: hvtrain turns TF32 off)
# 5. Horovod's collectives of GPU tensors through NCCL, torch and TensorFlow (NCCL must log Init COMPLETE)
# 6. a checkpoint written on the GPU resumed on the CPU (CUDA_VISIBLE_DEVICES=)
# 7. throughput: hvtrain's digits CNN >= 0.8x a plain torch loop of it on the same GPU
# It fails on the first step that does not hold (printing the end of that step's stderr), and warns
# when the whole took over 240 s.
set -Eeuo pipefail
if [ -n "${1:-}" ]; then mkdir -p "$1"; out=$(cd "$1" && pwd); else out=$(mktemp -d); fi   # absolute
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=$(cd "${VENV:-.venv}" && pwd)
export PATH="$venv/bin:$PATH" TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
trap 'echo "gpu_check: FAILED at line $LINENO; the end of $out/stderr.log:" | tee -a "$out/gpu_check.log";
      tail -n 20 "$out/stderr.log" 2>/dev/null | tee -a "$out/gpu_check.log"' ERR
py() { python scripts/gpu_check.py "$@" 2>>"$out/stderr.log" | tee -a "$out/gpu_check.log"; }
start=$(date +%s)
{
  echo "gpu_check: $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi -L || { echo "gpu_check: FAILED: nvidia-smi lists no GPU"; exit 1; }
  hvtrain doctor --backend torch
  hvtrain doctor --backend tensorflow | sed -n '/^horovod:/,/^mpi:/p'
} 2>&1 | tee "$out/gpu_check.log"
grep -q "nccl=yes" "$out/gpu_check.log" || { echo "gpu_check: FAILED: Horovod without NCCL: make setup GPU=1" | tee -a "$out/gpu_check.log"; exit 1; }

for fw in torch tensorflow; do
  py train "$fw" examples/digits_mlp.yaml "$out/$fw-mlp"
  py train "$fw" examples/digits_cnn.yaml "$out/$fw-cnn"
  py train "$fw" examples/digits_cnn.yaml "$out/$fw-bf16" train.precision=bf16
  py forward "$fw" "$out/$fw-cnn/final.safetensors" "$out/$fw-gpu.npy"
  CUDA_VISIBLE_DEVICES= py forward "$fw" "$out/$fw-cnn/final.safetensors" "$out/$fw-cpu.npy"
  py compare "$out/$fw-gpu.npy" "$out/$fw-cpu.npy" 1e-4
done

for fw in torch tensorflow; do
  # NCCL writes its log to stdout unless NCCL_DEBUG_FILE names a file
  env NCCL_DEBUG=INFO NCCL_DEBUG_FILE="$out/nccl-$fw.log" python scripts/gpu_check.py nccl "$fw" 2>>"$out/stderr.log" \
    | tee -a "$out/gpu_check.log"
  grep -q "Init COMPLETE" "$out/nccl-$fw.log" \
    || { echo "gpu_check: FAILED: $fw: NCCL logged no Init COMPLETE ($out/nccl-$fw.log)" | tee -a "$out/gpu_check.log"; exit 1; }
done

# stopped on the GPU after 100 steps, finished on the CPU from its checkpoint
py train torch examples/digits_cnn.yaml "$out/resume" train.max_steps=100 train.checkpoint_every=50 \
  train.checkpoint_unit=step
CUDA_VISIBLE_DEVICES= py train torch examples/digits_cnn.yaml "$out/resume" --resume
python - "$out" <<'PY' 2>&1 | tee -a "$out/gpu_check.log"
import json, sys
s = json.load(open(f"{sys.argv[1]}/resume/summary.json"))
full = json.load(open(f"{sys.argv[1]}/torch-cnn/summary.json"))
assert (s["resumed_from"] or "").endswith("-s00000100.safetensors"), f"did not resume: {s['resumed_from']}"
assert s["steps"] == full["steps"], (s["steps"], full["steps"])
print(f"gpu_check: ok: resumed on the CPU from {s['resumed_from']} to step {s['steps']}, val_accuracy {s['val_accuracy']}")
PY

py loop "$out/loop.json"
python - "$out" <<'PY' 2>&1 | tee -a "$out/gpu_check.log"
import json, sys
hv = json.load(open(f"{sys.argv[1]}/torch-cnn/summary.json"))["samples_per_sec"]
loop = json.load(open(f"{sys.argv[1]}/loop.json"))["samples_per_sec"]
line = f"hvtrain {hv:,.0f} samples/s vs a plain torch loop {loop:,.0f}: {hv / loop:.2f}x (digits CNN, batch 32)"
assert hv >= 0.8 * loop, f"gpu_check: FAILED: {line}, under 0.8x"
print(f"gpu_check: ok: {line}")
PY
took=$(( $(date +%s) - start ))
[ "$took" -le 240 ] || echo "gpu_check: WARNING: it took ${took} s, over its 240 (a first run on a GPU newer than the kernels' sm list JIT-compiles them)" | tee -a "$out/gpu_check.log"
echo "gpu_check: passed in ${took} s; log: $out/gpu_check.log" | tee -a "$out/gpu_check.log"
