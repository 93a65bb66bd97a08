"""The GPU path, proven on a GPU machine (scripts/gpu_check.sh runs each step in its own process).

    python scripts/gpu_check.py train FRAMEWORK CONFIG OUT [KEY=VALUE ...] [--resume]   # on GPU 0
    python scripts/gpu_check.py forward FRAMEWORK WEIGHTS OUT.npy            # logits of fixed rows
    python scripts/gpu_check.py compare A.npy B.npy TOLERANCE
    python scripts/gpu_check.py nccl FRAMEWORK          # Horovod's collectives on GPU tensors, through NCCL
    python scripts/gpu_check.py loop OUT.json                                # a plain torch loop

Every step prints one line `gpu_check: ...` and exits non-zero when what it proves does not hold.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def fail(message: str) -> None:
    print(f"gpu_check: FAILED: {message}", flush=True)
    sys.exit(1)


def peak_gpu_bytes(framework: str) -> int:
    """Bytes this process allocated on GPU 0: more than none proves the work ran there."""
    if framework == "torch":
        import torch

        return int(torch.cuda.max_memory_allocated(0)) if torch.cuda.is_available() else 0
    import tensorflow as tf

    return int(tf.config.experimental.get_memory_info("GPU:0")["peak"]) \
        if tf.config.list_physical_devices("GPU") else 0


def train(framework: str, config: str, out: str, *overrides: str) -> None:
    import hvtrain

    t0 = time.perf_counter()
    resume = "auto" if "--resume" in overrides else None
    overrides = tuple(o for o in overrides if o != "--resume")
    s = hvtrain.train(str(ROOT / config), backend=framework, output_dir=out, overrides=list(overrides), quiet=True,
                      resume=resume)
    peak = peak_gpu_bytes(framework)
    line = (f"{framework} {config} {' '.join(overrides)}: val_accuracy {s.get('val_accuracy')}, "
            f"{s.get('samples_per_sec')} samples/s, peak GPU memory {peak / 2**20:.1f} MiB, "
            f"{time.perf_counter() - t0:.1f} s")
    if os.environ.get("CUDA_VISIBLE_DEVICES") != "" and peak <= 0:  # "": the CPU on purpose
        fail(f"{line}: nothing was allocated on the GPU")
    if (s.get("val_accuracy") or 0) < 0.85:
        fail(f"{line}: the digits should reach 0.85")
    print(f"gpu_check: ok: {line}", flush=True)


def forward(framework: str, weights: str, out: str) -> None:
    from sklearn.datasets import load_digits

    import hvtrain

    x = load_digits().data[:256].astype(np.float32)
    logits = hvtrain.predict(str(ROOT / "examples/digits_cnn.yaml"), weights, x, backend=framework, kind="logits")
    np.save(out, logits)
    on_gpu = peak_gpu_bytes(framework) > 0
    if os.environ.get("CUDA_VISIBLE_DEVICES") != "" and not on_gpu:
        fail(f"{framework} forward of {weights}: nothing was allocated on the GPU")
    print(f"gpu_check: ok: {framework} forward on {'GPU' if on_gpu else 'CPU'} -> {out}", flush=True)


def nccl(framework: str) -> None:
    """Horovod's allreduce, grouped allreduce, broadcast and allgather of GPU tensors on one rank: the
    NCCL path (found through the build's RPATH; TensorFlow's CUDA stream handed to it) really runs.
    The shell step runs it with NCCL_DEBUG=INFO and requires NCCL's "Init COMPLETE"."""
    if framework == "torch":
        import horovod.torch as hvd
        import torch

        hvd.init()
        torch.cuda.set_device(hvd.local_rank())
        x = torch.arange(1024, dtype=torch.float32, device="cuda")
        got = [hvd.allreduce(x, op=hvd.Sum), *hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum),
               hvd.broadcast(x, root_rank=0), hvd.allgather(x)]
        ok = all(t.is_cuda for t in got) and all(torch.equal(t.cpu(), w) for t, w in zip(
            got, [x.cpu(), x.cpu(), 2 * x.cpu(), x.cpu(), x.cpu()], strict=True))
    else:
        import horovod.tensorflow as hvd
        import tensorflow as tf

        hvd.init()
        gpus = tf.config.list_physical_devices("GPU")
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
        x = tf.range(1024, dtype=tf.float32)

        @tf.function
        def collectives(t):
            with tf.device("/GPU:0"):
                t = tf.identity(t)
                return [hvd.allreduce(t, op=hvd.Sum), *hvd.grouped_allreduce([t, 2 * t], op=hvd.Sum),
                        hvd.broadcast(t, root_rank=0), hvd.allgather(t)]

        got = collectives(x)
        want = [x, x, 2 * x, x, x]
        ok = all("GPU" in t.device for t in got) and all(bool(tf.reduce_all(t == w)) for t, w in zip(got, want,
                                                                                                       strict=True))
    if not hvd.nccl_built() or not ok:
        fail(f"{framework}: Horovod's collectives of GPU tensors (nccl_built {hvd.nccl_built()}) gave wrong results")
    print(f"gpu_check: ok: {framework} allreduce, grouped allreduce, broadcast, allgather of GPU tensors", flush=True)


def compare(a: str, b: str, tolerance: str) -> None:
    x, y = np.load(a), np.load(b)
    gap = float(np.max(np.abs(x - y)))
    if not gap <= float(tolerance):
        fail(f"{a} and {b} differ by {gap:.3g} > {tolerance}")
    print(f"gpu_check: ok: {Path(a).name} vs {Path(b).name}: max |diff| {gap:.3g} <= {tolerance}", flush=True)


def loop(out: str, epochs: int = 12, batch: int = 32) -> None:
    """examples/digits_cnn.yaml's model, data, batch and epochs as a plain torch loop on GPU 0: the
    batches moved to the GPU step by step, as hvtrain's are; the rate after the first epoch (hvtrain's
    samples_per_sec is its last epoch's)."""
    import torch
    from sklearn.datasets import load_digits
    from torch import nn

    digits = load_digits()
    x = ((digits.data - digits.data.mean(0)) / (digits.data.std(0) + 1e-7)).astype(np.float32)
    x, y = x.reshape(-1, 1, 8, 8)[: int(len(x) * 0.8)], digits.target[: int(len(x) * 0.8)]
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.002)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32, as hvtrain's
    rng = np.random.default_rng(0)
    seen, t0 = 0, time.perf_counter()
    for epoch in range(epochs):
        if epoch == 1:  # the rate of the epochs after the first (warm-up: cuDNN's choices, the allocator)
            torch.cuda.synchronize()
            seen, t0 = 0, time.perf_counter()
        order = rng.permutation(len(x))
        for i in range(0, len(x) - batch + 1, batch):
            idx = order[i:i + batch]
            xb = torch.from_numpy(x[idx]).pin_memory().to(dev, non_blocking=True)
            yb = torch.from_numpy(y[idx]).pin_memory().to(dev, non_blocking=True)
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += batch
    torch.cuda.synchronize()
    rate = seen / (time.perf_counter() - t0)
    Path(out).write_text(json.dumps({"samples_per_sec": rate}))
    print(f"gpu_check: ok: plain torch loop, digits CNN batch {batch}: {rate:,.0f} samples/s", flush=True)


if __name__ == "__main__":
    verbs = {"train": train, "forward": forward, "compare": compare, "nccl": nccl, "loop": loop}
    if len(sys.argv) < 2 or sys.argv[1] not in verbs:
        sys.exit(__doc__)
    verbs[sys.argv[1]](*sys.argv[2:])
