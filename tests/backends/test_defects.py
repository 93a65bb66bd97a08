"""Regression tests, one per defect found by reading the code (issue 8, point 4), on every backend."""

import copy

import numpy as np
import pytest

from hvtrain.backends.base import get_backend
from hvtrain.errors import DataError
from hvtrain.runtime.experiment import prepare
from tests.backends.conftest import make_backend, runtime_for

BN = "tests/configs/bn_mlp.yaml"
MLP = "tests/configs/parity_mlp.yaml"


def stats(weights):
    return {k: v.copy() for k, v in weights.items() if "moving_" in k}


def test_one_sample_batch_with_batchnorm_trains_and_leaves_moving_statistics(backend_name):
    """Defect: torch raised 'Expected more than 1 value per channel when training' on a per-rank
    batch of one sample (a tail share, or a micro-batch of 1)."""
    backend, p = make_backend(backend_name, BN)
    before = backend.get_weights()
    assert backend.train_step(p.data.x_train[:1], p.data.y_train[:1], np.ones(1, np.float32), apply=True)
    after = backend.get_weights()
    for k, v in stats(before).items():
        np.testing.assert_array_equal(after[k], v, err_msg=k)
    assert not np.array_equal(after["layers.3.kernel"], before["layers.3.kernel"])  # it did learn


def test_zero_weight_padding_sample_changes_nothing(backend_name):
    """Defect: the zero-weight sample a rank trains on when its share of a tail batch is empty
    updated batchnorm moving statistics (and crashed torch)."""
    backend, p = make_backend(backend_name, BN)
    before = backend.get_weights()
    assert backend.train_step(p.data.x_train[:1], p.data.y_train[:1], np.zeros(1, np.float32), apply=True)
    after = backend.get_weights()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


def test_normal_batches_still_update_moving_statistics(backend_name):
    backend, p = make_backend(backend_name, BN)
    before = stats(backend.get_weights())
    backend.train_step(p.data.x_train[:8], p.data.y_train[:8], np.full(8, 1 / 8, np.float32), apply=True)
    after = backend.get_weights()
    assert all(not np.array_equal(after[k], v) for k, v in before.items())


def test_fp16_applies_the_same_weight_decay_as_fp32(backend_name):
    """Defect: TensorFlow added the L2 term to loss-scaled gradients under fp16, so decay was
    ~2^15 too weak. A zero-weight batch has zero loss gradients: the update is decay alone."""
    deltas = {}
    for precision in ("fp32", "fp16"):
        backend, p = make_backend(backend_name, MLP, f"train.precision={precision}", "optimizer.weight_decay=0.5")
        before = backend.get_weights()
        backend.train_step(p.data.x_train[:4], p.data.y_train[:4], np.zeros(4, np.float32), apply=True)
        after = backend.get_weights()
        deltas[precision] = after["layers.0.kernel"] - before["layers.0.kernel"]
    expected = -0.05 * 0.5 * before["layers.0.kernel"]  # -lr * wd * w
    np.testing.assert_allclose(deltas["fp32"], expected, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(deltas["fp16"], expected, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("elastic", [False, True])
def test_discarded_gradients_do_not_reach_the_next_update(backend_name, elastic, monkeypatch):
    """Defect: after Horovod restored state from a commit (a failed allreduce mid-step), torch kept
    the .grad and TF the gradient accumulator of the abandoned micro-batches, so the next update
    differed from a run resumed at that commit. `elastic` wraps the optimizer as Horovod elastic does."""
    overrides = ("train.grad_accumulation=2",)
    backend, p = make_backend(backend_name, MLP, *overrides)
    if elastic:  # rebuilt under an elastic runtime: Horovod's DistributedOptimizer hooks even at size 1
        monkeypatch.setenv("HOROVOD_ELASTIC", "1")
        rt = copy.copy(runtime_for(backend_name, p.cfg))
        rt.elastic = True
        backend.build(p.cfg, p.spec, p.spec.init_weights(p.cfg.seed), p.data.num_outputs, rt)
    x, y = p.data.x_train, p.data.y_train
    w = np.full(8, 1 / 16, np.float32)
    backend.train_step(x[:8], y[:8], w, apply=False)  # the abandoned micro-batch
    backend.discard_gradients()
    backend.train_step(x[8:16], y[8:16], w, apply=False)
    backend.train_step(x[16:24], y[16:24], w, apply=True)
    fresh, _ = make_backend(backend_name, MLP, *overrides)
    fresh.train_step(x[8:16], y[8:16], w, apply=False)
    fresh.train_step(x[16:24], y[16:24], w, apply=True)
    a, b = backend.get_weights(), fresh.get_weights()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6, err_msg=k)


def test_entrypoint_weights_with_missing_or_unexpected_names_are_a_located_error(backend_name):
    """Defect: torch loaded native weights with strict=False (missing keys silently kept their
    values); TensorFlow raised a KeyError traceback. Both must name what does not match."""
    fn = "torch_mlp" if backend_name == "torch" else "keras_mlp"
    backend, _ = make_backend(backend_name, "tests/configs/entrypoint.yaml",
                              f"model.entrypoint=tests.fixtures.native_models:{fn}")
    weights = backend.get_weights()
    dropped = sorted(weights)[0]
    partial = {k: v for k, v in weights.items() if k != dropped}
    with pytest.raises(DataError, match=rf"weights do not match the entrypoint model: missing 1 \({dropped}\)"):
        backend.set_weights(partial)
    with pytest.raises(DataError, match=r"unexpected 1 \(no\.such\.weight\)"):
        backend.set_weights({**weights, "no.such.weight": np.zeros(1, np.float32)})
    backend.set_weights(weights)  # the exact set still loads


def test_a_second_session_with_other_threads_configures_without_error(backend_name):
    """Defect: TensorFlow's thread pools are fixed once TF has run; a later session in the same
    process (the Python API's second hvtrain.train, here with train.threads=1 after the earlier
    tests' default) raised "Intra op parallelism cannot be modified after initialization"."""
    make_backend(backend_name, "examples/digits_mlp.yaml")  # an earlier session: the framework has run
    p = prepare("examples/digits_mlp.yaml", backend=backend_name, overrides=["train.threads=1"])
    again = get_backend(backend_name)
    again.configure(p.cfg, runtime_for(backend_name, p.cfg).info, None)
