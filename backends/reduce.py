"""Direct gradient reduction, framework-neutral: after backward, the gradients are summed over the
ranks on the runtime's direct MPI communicator (hvtrain.runtime.horovod.Runtime.sum_), each large
one as it is and the small ones packed into one buffer: no per-tensor hooks, no copy of the large
gradients into a fusion buffer, no wait for Horovod's next cycle, and no background thread
competing with the compute for the rank's cores.

It gives up overlapping the reduction with backward, which pays where the reduction does not
compete for the compute's cores (GPUs): there `horovod.reduction: auto` keeps Horovod's hooks
(torch's DistributedOptimizer, TensorFlow's in-graph allreduce). Measured, np=2 on 2 cores, one
thread per rank: bench/torch_dp.py, bench/tf_dp.py and bench/small_models.py, side by side.
Gradients as views of one flat buffer (DDP's gradient_as_bucket_view) were measured too, and cost
~10% of a one-thread MLP step at batch 128: zeroing the buffer, and backward adding into it
instead of handing its result over.

Each rank's loss is its share of the global mean (hvtrain.data.batches), so the sum over ranks
is the global mean's gradient: nothing is scaled by 1/size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PACK_BYTES = 64 * 1024  # arrays smaller than this travel packed together: one call's latency, not many


def direct_reduction(cfg: Any, on_gpu: bool) -> bool:
    """Gradients summed after backward (`horovod.reduction`): `auto` is direct on the CPU without
    fp16 compression, unless the config asks for what only Horovod's path has (its timeline of the
    allreduces, autotuning them, `num_groups`). Never under train.shard_optimizer, whose chunks are
    reduce-scattered through Horovod (averaged: the loss is scaled for Horovod's path)."""
    if cfg.train.shard_optimizer:
        return False
    h = cfg.horovod
    horovods = bool(h.timeline or h.autotune or h.autotune_from or h.num_groups)
    return h.reduction == "direct" or (h.reduction == "auto" and not on_gpu and cfg.train.compression == "none"
                                       and not horovods)


def sum_arrays(runtime: Any, arrays: list[np.ndarray], into: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Every rank's `arrays` (C-contiguous) summed on the runtime's direct communicator, on every
    rank: into `into` (arrays of the same shapes; packed small ones' results are new arrays instead)
    or, when None, into the arrays themselves (writable). Small ones go packed, per dtype."""
    in_place = into is None
    out: list[np.ndarray | None] = [None] * len(arrays)
    small: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        if a.nbytes < PACK_BYTES:
            small.setdefault(a.dtype, []).append(i)
        else:
            out[i] = runtime.sum_(a, out=None if in_place else into[i])
    for idx in small.values():
        if len(idx) == 1:  # nothing to pack
            i = idx[0]
            out[i] = runtime.sum_(arrays[i], out=None if in_place else into[i])
            continue
        packed = np.concatenate([arrays[i].reshape(-1) for i in idx])
        runtime.sum_(packed)
        at = 0
        for i in idx:
            part = packed[at: at + arrays[i].size].reshape(arrays[i].shape)
            at += arrays[i].size
            if in_place:
                arrays[i][...] = part
                out[i] = arrays[i]
            else:
                out[i] = part
    return out
