"""One optimizer step of a config on this process alone, timed: what `hvtrain plan --network`
measures (no files written, no other rank).
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np

from hvtrain.config.validate import draws_seed
from hvtrain.errors import HvtrainError
from hvtrain.launch.process import affinity
from hvtrain.runtime.experiment import Prepared
from hvtrain.runtime.session import Session, build_native


def measure_step(p: Prepared, steps: int = 10, warmup: int = 3, ranks_per_host: int = 1) -> tuple[float, list[int]]:
    """One optimizer step of `p`'s config on this process alone, in ms (the mean of `steps` after
    `warmup`), and the values of each trainable tensor, in the built model's order: the compute
    time `hvtrain plan --network` measures, with the intra-op threads one of `ranks_per_host`
    ranks gets (train.threads, else this host's CPUs / ranks_per_host). The whole model (a
    pipeline's too) steps on the first rows of the training split; Horovod reduces nothing with
    one rank. Writes no file: no output directory, checkpoint, timeline or autotune log.

    Raises:
        HvtrainError: launched with several ranks (one process must measure alone).
    """
    import time

    from hvtrain.data.batches import Batch
    from hvtrain.training.steps import DataParallelSteps

    h = replace(p.cfg.horovod, timeline=None, autotune=False)  # files Horovod would write
    # threads as one of `ranks_per_host` ranks would have them, not the whole host's
    threads = p.cfg.train.threads or max(1, (len(affinity()) or os.cpu_count() or 1) // ranks_per_host)
    cfg = replace(p.cfg, horovod=h, train=replace(p.cfg.train, threads=threads))
    session = Session(cfg, p.spec, pipelined=False)
    if session.info.size > 1:
        raise HvtrainError(f"measuring a step needs one process alone, got {session.info.size} ranks: run "
                           "hvtrain plan without a launcher, or give --step-ms")
    with session as s:
        build_native(cfg, s.backend, p.spec, p.spec.init_weights(cfg.seed) if p.spec else None, p.data, s.runtime)
        runner = DataParallelSteps(s.backend, s.runtime, draws_seed=draws_seed(cfg, p.spec))
        batch, k = cfg.data.batch_size, cfg.train.grad_accumulation
        rows = np.resize(np.arange(len(p.data.train)), batch)
        x, y = p.data.train.take(rows)
        weight = np.full(batch, 1.0 / (batch * k), np.float32)

        def step() -> None:
            for j in range(k):
                runner.train_batch(Batch(rows, weight, j == k - 1), x, y)

        for _ in range(warmup):
            step()
        runner.loss_sum(reset=True)  # a host sync: the device's queue is empty
        start = time.perf_counter()
        for _ in range(steps):
            step()
        runner.loss_sum(reset=True)
        ms = (time.perf_counter() - start) * 1e3 / steps
        weights, trainable = s.backend.get_weights(), s.backend.trainable_names()
        return ms, [int(v.size) for name, v in weights.items() if name in trainable]
