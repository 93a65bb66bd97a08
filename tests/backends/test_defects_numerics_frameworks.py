"""Issue 21, numerics of the input path and re-running on a finished run: one process, every backend."""

from __future__ import annotations

import numpy as np

from hvtrain.backends.base import get_backend
from tests.backends.conftest import make_backend

MLP = "tests/configs/parity_mlp.yaml"
BN = "tests/configs/bn_mlp.yaml"  # dense 32, batchnorm, relu, dense 10


def test_defect_01_fp16_skip_lowers_the_loss_scale_after_overflow_and_then_learns(backend_name):
    """Defect: TensorFlow fp16 with train.on_nan: skip never called the LossScaleOptimizer on a
    step whose scaled gradients overflowed, so the scale never dropped and every later update was
    skipped too (the run exited 0 with the initial weights). Inputs of 1000 overflow fp16 at the
    initial scale 2^15 (about 6 halvings are needed); `stop` and torch always learned. Both
    on_nan settings must take the same updates here (no loss is non-finite, only scaled gradients)."""
    final = {}
    for on_nan in ("skip", "stop"):
        backend, p = make_backend(backend_name, MLP, "train.precision=fp16", f"train.on_nan={on_nan}",
                                  "optimizer.lr=0.001")
        x, y = p.data.x_train[:32] * 1000.0, p.data.y_train[:32]
        before = backend.get_weights()["layers.0.kernel"]
        for _ in range(12):
            assert backend.train_step(x, y, np.full(32, 1 / 32, np.float32), apply=True)
        final[on_nan] = backend.get_weights()["layers.0.kernel"]
        assert not np.array_equal(final[on_nan], before), f"on_nan={on_nan}: no update in 12 steps"
    np.testing.assert_array_equal(final["skip"], final["stop"])


def one_stage_steps(backend_name: str, config: str, micro_batches: int, *overrides: str):
    """The real PipelineSteps over a one-stage plan (the whole model on this rank): the pipeline
    path's loss scale, micro-batching, reduce and update, in one process."""
    from types import SimpleNamespace

    from mpi4py import MPI

    from hvtrain.metrics.suite import MetricSet
    from hvtrain.model.spec import INPUT
    from hvtrain.pipeline.runner import PipelineSteps
    from hvtrain.runtime.experiment import prepare
    from tests.backends.conftest import runtime_for

    p = prepare(config, backend=backend_name, overrides=[*overrides, "train.threads=0"])
    backend = get_backend(backend_name)
    rt = runtime_for(backend_name, p.cfg)
    backend.configure(p.cfg, rt.info, None)
    last = len(p.spec.layers) - 1
    engine = backend.build_stage(p.cfg, p.spec, list(range(last + 1)), (INPUT,), (last,), "cpu",
                                 p.spec.init_weights(p.cfg.seed), 1, rt, None)
    plan = SimpleNamespace(stage_of=lambda r: 0, replica_of=lambda r: 0, replicas=1, num_stages=1,
                           micro_batches=micro_batches, schedule="gpipe",
                           stages=[SimpleNamespace(in_shapes=(tuple(p.spec.input_shape),), out_shapes=((10,),))])
    return PipelineSteps(p.cfg, plan, p.spec, engine, rt, MPI.COMM_WORLD, MetricSet.of(p.cfg, p.data)), p


def test_pipeline_fp16_skip_backs_off_the_loss_scale_and_learns(backend_name):
    """The same overflow through the pipeline path (PipelineSteps' LossScale and the stage's
    reduce/apply): the scale halves on every overflowed step, the update is skipped only then,
    and the stage learns. Checked for item 1: this path had no such defect."""
    from hvtrain.data.batches import Batch

    steps, p = one_stage_steps(backend_name, MLP, 2, "train.precision=fp16", "train.on_nan=skip",
                               "optimizer.lr=0.001")
    x, y = p.data.x_train[:32] * 1000.0, p.data.y_train[:32]
    before = steps.weights()["layers.0.kernel"]
    scales = []
    for _ in range(12):
        assert steps.train_batch(Batch(np.arange(32), np.full(32, 1 / 32, np.float32), True), x, y)
        scales.append(steps.scaler.scale)
    assert scales[0] == 2.0 ** 14 and min(scales) <= 2.0 ** 10, scales
    after = steps.weights()["layers.0.kernel"]
    assert np.all(np.isfinite(after)) and not np.array_equal(after, before)


def test_micro_batches_change_a_batchnorm_models_update(backend_name):
    """Why parallel.pipeline.micro_batches joined the resume compatibility keys: one step of the
    same 32 samples in 1 or 2 micro-batches gives another update with batchnorm (statistics per
    micro-batch), the same one without it (float rounding apart)."""
    from hvtrain.data.batches import Batch

    deltas = {}
    for config in (BN, MLP):
        for micro in (1, 2):
            steps, p = one_stage_steps(backend_name, config, micro)
            before = steps.weights()["layers.0.kernel"]
            batch = Batch(np.arange(32), np.full(32, 1 / 32, np.float32), True)
            steps.train_batch(batch, p.data.x_train[:32], p.data.y_train[:32])
            deltas[config, micro] = steps.weights()["layers.0.kernel"] - before
    assert np.abs(deltas[BN, 1] - deltas[BN, 2]).max() > 1e-3 * np.abs(deltas[BN, 1]).max()
    np.testing.assert_allclose(deltas[MLP, 1], deltas[MLP, 2], rtol=0, atol=1e-6)


def test_defect_04_a_model_trains_on_float64_features_far_from_zero_and_predicts_alike(tmp_path):
    """The real run behind the unit tests: x = 1e8 + N(0, 1) (float64, the Python API's arrays),
    label x0 + x1 > 0. Cast to float32 before standardising, it trained to 0.445; predict on the
    raw rows (the inputs record's float64 statistics) gives the run's own accuracy."""
    import hvtrain

    rng = np.random.default_rng(0)
    noise = rng.standard_normal((600, 2))
    x, y = 1e8 + noise, (noise[:, 0] + noise[:, 1] > 0).astype(np.int64)
    cfg = {"name": "offset", "backend": "torch", "seed": 1, "data": {"batch_size": 32},
           "model": {"input_shape": [2], "layers": [{"type": "dense", "units": 2}]},
           "optimizer": {"name": "adam", "lr": 0.05}, "metrics": ["accuracy"], "train": {"epochs": 4, "threads": 1}}
    summary = hvtrain.train(cfg, data=(x, y), output_dir=str(tmp_path), quiet=True)
    assert summary["val_accuracy"] > 0.95, summary["val_accuracy"]
    labels = hvtrain.predict(cfg, str(tmp_path / "final.safetensors"), x, data=(x, y), kind="labels")
    from hvtrain.runtime.experiment import prepare

    val = prepare(cfg, data=(x, y)).data.val
    assert float(np.mean(labels[val.rows] == y[val.rows])) == summary["val_accuracy"]


def test_defect_05_evaluate_feeds_the_weights_as_they_were_trained_and_refuses_another_split(tmp_path):
    """Defect: `hvtrain evaluate` normalised with the config's data.normalize, not the statistics the
    weights were trained with (their inputs record, which predict uses): trained with minmax, it
    scored standardised inputs (0.877 instead of 0.928). And a changed seed or validation_split
    silently evaluated on training samples. Now evaluate equals the run's own last evaluation, and
    another split on the same samples is one located error."""
    import pytest

    import hvtrain
    from hvtrain.errors import ConfigError

    cfg = "examples/digits_mlp.yaml"
    summary = hvtrain.train(cfg, output_dir=str(tmp_path / "run"), quiet=True,
                            overrides=["train.epochs=2", "data.normalize=minmax", "train.threads=1"])
    weights = str(tmp_path / "run" / "final.safetensors")
    got = hvtrain.evaluate(cfg, weights, output_dir=str(tmp_path / "eval"), overrides=["train.threads=1"])
    assert got["val_accuracy"] == pytest.approx(summary["val_accuracy"], abs=1e-12)
    assert got["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    for override, key in (("seed=7", "seed"), ("data.validation_split=0.3", "data.validation_split")):
        with pytest.raises(ConfigError, match=rf"{key}: .*final.safetensors was trained with seed 1234 and "
                                              r"data.validation_split 0.2 on these 1797 samples"):
            hvtrain.evaluate(cfg, weights, output_dir=str(tmp_path / "eval"), overrides=[override])
