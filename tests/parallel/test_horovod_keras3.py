"""Horovod's TensorFlow API under Keras 3 (issue 25): broadcast_variables, DistributedGradientTape
and a partial one with a Keras variable registered local, the Keras DistributedOptimizer in
model.fit (also after gradients computed and not applied, and with backward_passes_per_step 2),
SyncBatchNormalization, TensorFlowKerasState, mixed_float16's LossScaleOptimizer around Horovod's
(an overflow on one rank skips the step on every rank) and the Keras callbacks, as a user's
hand-written Horovod code calls them, on 2 real ranks (tests/fixtures/keras3_conformance.py).
On Horovod 0.28.1 without hvtrain's patch the checks fail: exceptions, model.fit with the
DistributedOptimizer training each rank on its own gradients, silently (0.07 from the averaged run),
and (before patch 3) an overflow on one rank leaving the other waiting in an allreduce."""

from __future__ import annotations

from tests.conftest import run
from tests.support.launch import mpirun_command

CHECKS = ["broadcast_variables", "DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer",
          "backward_passes_per_step", "SyncBatchNormalization", "TensorFlowKerasState", "LossScaleOptimizer",
          "callbacks"]


def test_horovods_tensorflow_api_takes_keras_3_variables_models_and_optimizers():
    proc = run(mpirun_command(2, "python", "tests/fixtures/keras3_conformance.py"), timeout=300, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, "\n".join(line for line in out.splitlines() if line.startswith(("ok", "FAILED")))
    for name in CHECKS:
        assert f"ok {name} (rank 0)" in out and f"ok {name} (rank 1)" in out, name
