"""The Backend contract, checked identically on every registered backend."""

import numpy as np
import pytest

from hvtrain.backends.base import Backend
from hvtrain.errors import DataError
from tests.backends.conftest import make_backend

CNN = "tests/configs/parity_cnn.yaml"


def test_is_a_backend(backend_name):
    engine, _ = make_backend(backend_name, CNN)
    assert isinstance(engine, Backend) and engine.name == backend_name


@pytest.mark.parametrize("config", [CNN, "tests/configs/catalogue_image.yaml", "tests/configs/catalogue_tokens.yaml",
                                    "tests/configs/catalogue_residual.yaml", "tests/configs/catalogue_sequence.yaml",
                                    "examples/digits_transformer.yaml"])
def test_weights_round_trip_exactly(backend_name, config):
    """Every catalogue layer (graphs, merges, attention included) maps neutral <-> native exactly."""
    engine, p = make_backend(backend_name, config)
    init = p.spec.init_weights(p.cfg.seed)
    got = engine.get_weights()
    assert sorted(got) == sorted(init)
    for k in init:
        np.testing.assert_array_equal(got[k], init[k], err_msg=k)
    rng = np.random.default_rng(0)
    other = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in init.items()}
    engine.set_weights(other)
    back = engine.get_weights()
    assert all(np.array_equal(back[k], other[k]) for k in other)


def test_set_weights_rejects_wrong_shapes(backend_name):
    engine, p = make_backend(backend_name, CNN)
    bad = dict(engine.get_weights())
    bad["layers.6.kernel"] = np.zeros((5, 10), np.float32)
    with pytest.raises(DataError, match=r"weight 'layers.6.kernel' has shape \[5, 10\]"):
        engine.set_weights(bad)


def test_training_step_moves_weights_and_accumulates_loss(backend_name):
    engine, p = make_backend(backend_name, CNN)
    before = engine.get_weights()
    x, y = p.data.x_train[:32], p.data.y_train[:32]
    engine.loss_sum(reset=True)
    engine.train_step(x, y, np.full(32, 1 / 32, np.float32), apply=True)
    loss = engine.loss_sum()
    assert 3.5 > loss > 1.5  # ~ln(10) at init
    after = engine.get_weights()
    assert max(np.abs(after[k] - before[k]).max() for k in before) > 0


def test_eval_sums_match_predictions(backend_name):
    """The framework sums the loss; hvtrain.metrics.suite sums the rest from the same outputs."""
    from hvtrain.metrics.names import Metric
    from hvtrain.metrics.suite import MetricSet

    engine, p = make_backend(backend_name, CNN)
    x, y = p.data.x_val[:50], p.data.y_val[:50]
    metrics = MetricSet("cross_entropy", [Metric("accuracy"), Metric("confusion_matrix")], 10, 50)
    sums = engine.eval_batch(x, y, metrics, np.arange(50))
    assert sums.shape == (metrics.size - 1,) == (4 + 100,) and 0 <= sums[1] <= 50 and sums[0] > 0
    logits = engine.predict(x)
    assert logits.shape == (50, 10)
    assert sums[1] == np.sum(logits.argmax(1) == y) == np.trace(sums[4:].reshape(10, 10))
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_loss = np.sum(np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(50), y])
    assert sums[0] == pytest.approx(log_loss, rel=1e-5)  # the framework's cross entropy of those logits


def test_entrypoint_must_return_the_framework_model(backend_name):
    from hvtrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.entrypoint: expected the function to return a .* for backend "
                                          rf"{backend_name}, got str"):
        make_backend(backend_name, "tests/configs/entrypoint.yaml",
                     "model.entrypoint=tests.fixtures.native_models:not_a_model", "model.kwargs={}")
