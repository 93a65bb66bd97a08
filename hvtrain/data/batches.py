"""Who trains on what: the seeded per-epoch permutation, each rank's share of every global batch
(sample weights that make the replicas' sum the global mean), steps per epoch, evaluation shards.
Pure numpy, the same on every rank without communicating.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Batch:
    """One rank's share of one global micro-batch.

    `weights` sum to 1 over the *whole optimizer step on all ranks*, so that summing
    weighted per-sample losses, then averaging gradients over ranks (times world size),
    gives exactly the gradient of the mean loss of the global batch. A rank whose share of
    a tail batch is empty gets one zero-weight sample, so it still joins every allreduce.
    """

    indices: np.ndarray
    weights: np.ndarray
    apply: bool  # last micro-batch of an optimizer step
    epoch: int = 0  # with `indices`, what names each sample's per-sample draws (hvtrain.data.draws)


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The one global sample order of an epoch; every rank computes the same one."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch, 0x5A3D]).permutation(n)


def shard_batches(order: np.ndarray, batch_size: int, rank: int, size: int,
                  accumulation: int = 1, epoch: int = 0) -> Iterator[Batch]:
    """Rank `rank`'s batches: global micro-batch k is order[k*B:(k+1)*B] with B = size*batch_size,
    of which the rank takes every size-th sample starting at `rank`.

    So step k on N ranks with per-rank batch b sees exactly the samples of step k on one
    rank with batch N*b. Nothing is dropped: the last global batch may be short.
    """
    global_batch = batch_size * size
    micro = [order[i: i + global_batch] for i in range(0, len(order), global_batch)]
    for start in range(0, len(micro), accumulation):
        group = micro[start: start + accumulation]
        total = sum(len(g) for g in group)
        for j, g in enumerate(group):
            local = g[rank::size]
            weights = np.full(len(local), 1.0 / total, np.float32)
            if len(local) == 0:
                local, weights = g[:1], np.zeros(1, np.float32)
            yield Batch(local, weights, apply=j == len(group) - 1, epoch=epoch)


def steps_per_epoch(n: int, batch_size: int, size: int, accumulation: int = 1) -> int:
    return math.ceil(math.ceil(n / (batch_size * size)) / accumulation)


def shard_eval(n: int, rank: int, size: int) -> np.ndarray:
    """Validation indices of a rank: every sample exactly once across ranks."""
    return np.arange(rank, n, size)
