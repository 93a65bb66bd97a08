"""Pipeline stages in one process, every backend: what the compiled TensorFlow stage (issue 13)
must keep from the eager one: the backward of a micro-batch uses that micro-batch's own forward
(dropout mask, statistics updated once) whatever the order of live micro-batches, and micro-batches
never retrace."""

import numpy as np
import pytest

from hvtrain.backends.base import get_backend
from hvtrain.data.draws import dropout_keys, keep_mask
from hvtrain.model.spec import INPUT
from hvtrain.pipeline.schedule import stage_ops
from hvtrain.runtime.experiment import prepare
from tests.backends.conftest import make_backend, runtime_for

DROPOUT = "tests/configs/dropout_pipeline.yaml"  # dense 128, dropout, dense 64, dropout, dense 10
BN = "tests/configs/bn_mlp.yaml"  # dense 32, batchnorm, relu, dense 10
THREADS = "train.threads=0"  # the other backend tests' default: TF takes its thread count once per process


def stage(name: str, config: str, layers: list[int], sources: tuple[int, ...], outputs: tuple[int, ...],
          *overrides: str):
    p = prepare(config, backend=name, overrides=(*overrides, THREADS))
    backend = get_backend(name)
    rt = runtime_for(name, p.cfg)
    backend.configure(p.cfg, rt.info, None)
    return backend.build_stage(p.cfg, p.spec, layers, sources, outputs, "cpu", p.spec.init_weights(p.cfg.seed), 1,
                               rt, None), p


@pytest.mark.parametrize("randomness", ["per_sample", "per_rank"])
def test_dropout_backward_uses_each_micro_batchs_own_mask(backend_name, randomness):
    """A stage of dropout then a linear dense layer: out = (x * mask / keep) W + b, and with
    d loss / d out = 1, d loss / d x = (1 W^T) * mask / keep is zero exactly where the mask is. The
    mask read off each backward must reproduce that micro-batch's forward output. Two micro-batches
    live at once, backwards in the other order (GPipe's). Per sample, the mask is the one
    hvtrain.data.draws.keep_mask gives the micro-batch's samples, element for element (issue 24)."""
    s, p = stage(backend_name, DROPOUT, [1, 2], (0,), (2,), "model.layers.2.activation=linear",
                 f"train.randomness={randomness}")
    weights = s.get_weights()
    kernel, bias, keep = weights["layers.2.kernel"], weights["layers.2.bias"], 0.7
    rng = np.random.default_rng(0)
    xs = [rng.uniform(1.0, 2.0, (16, 128)).astype(np.float32) for _ in range(2)]
    keys = [dropout_keys(p.cfg.seed, 3, np.arange(16 * m, 16 * m + 16)) for m in (0, 1)]
    draws = keys if randomness == "per_sample" else [None, None]
    outs = [s.forward(m, [x], draws=draws[m])[0] for m, x in enumerate(xs)]
    masks = {m: s.backward(m, [np.ones_like(outs[m])])[0] != 0 for m in (1, 0)}
    assert not np.array_equal(masks[0], masks[1]), "the micro-batches' masks should differ"
    for m in (0, 1):
        assert 0.5 < masks[m].mean() < 0.9
        np.testing.assert_allclose(outs[m], (xs[m] * masks[m] / keep) @ kernel + bias, rtol=1e-5, atol=1e-5,
                                   err_msg=f"micro-batch {m}")
        if randomness == "per_sample":
            np.testing.assert_array_equal(masks[m], keep_mask(keys[m], 1, (128,), 0.3))


def test_batchnorm_statistics_move_once_per_micro_batch(backend_name):
    """Forward + backward of two micro-batches leave the moving statistics where two forwards do."""
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((8, 32)).astype(np.float32) for _ in range(2)]
    stats = []
    for backward in (False, True):
        s, _ = stage(backend_name, BN, [1, 2], (0,), (2,))
        outs = [s.forward(m, [x])[0] for m, x in enumerate(xs)]
        if backward:
            for m in (1, 0):
                s.backward(m, [np.ones_like(outs[m])])
        stats.append({k: v for k, v in s.get_weights().items() if "moving_" in k})
    assert stats[0] and all(np.array_equal(stats[0][k], stats[1][k]) for k in stats[0])


def test_tensorflow_stage_traces_each_call_once():
    """Micro-batches of different sizes, a padding one, a changing loss scale, updates with and
    without the finiteness check: one trace per compiled call and mode."""
    first, p = stage("tensorflow", DROPOUT, [0, 1], (INPUT,), (1,))
    last, _ = stage("tensorflow", DROPOUT, [2, 3, 4], (1,), (4,))
    x, y = p.data.x_train, p.data.y_train
    for m, (n, scale) in enumerate([(5, 1.0), (4, 2.0), (4, 0.5), (3, 1.0)]):
        padding = m == 3
        w = np.full(n, 0.0 if padding else 1.0 / n, np.float32)
        keys = dropout_keys(p.cfg.seed, 0, np.arange(n))
        h = first.forward(m, [x[:n]], padding, keys)
        last.forward_loss(m, h, y[:n], w, scale, keys)
        first.backward(m, last.backward(m, None))
        for st in (first, last):
            st.reduce_gradients(1.0 / scale, check_finite=m % 2 == 0)
            st.apply_update()
    calls = [first._forward[True], first._forward[False], first._accumulate, *last._loss_step.values(),
             *first._reduce.values(), first._apply]
    assert [f.experimental_get_tracing_count() for f in calls] == [1] * len(calls)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_give_the_whole_batch_update(backend_name, schedule):
    """Both stages run their schedule's op order (stage 0's backward of m as soon as stage 1 has
    it): the accumulated update equals one whole-batch step of the unpipelined backend."""
    overrides = ("model.layers.1.rate=0.0", "model.layers.3.rate=0.0", "optimizer.momentum=0")
    first, p = stage(backend_name, DROPOUT, [0, 1], (INPUT,), (1,), *overrides)
    last, _ = stage(backend_name, DROPOUT, [2, 3, 4], (1,), (4,), *overrides)
    whole, _ = make_backend(backend_name, DROPOUT, *overrides, THREADS, weights=p.spec.init_weights(p.cfg.seed))
    n, micro = 12, 3
    x, y, w = p.data.x_train[:n], p.data.y_train[:n], np.full(n, 1.0 / n, np.float32)
    chunks = np.array_split(np.arange(n), micro)
    sent, grads = {}, {}
    later = iter(stage_ops(schedule, 2, 1, micro))
    for kind, m in stage_ops(schedule, 2, 0, micro):
        if kind == "F":
            sent[m] = first.forward(m, [x[chunks[m]]])
            continue
        while m not in grads:  # stage 1 runs until it has sent micro-batch m's gradients
            kind1, m1 = next(later)
            if kind1 == "F":
                last.forward_loss(m1, sent[m1], y[chunks[m1]], w[chunks[m1]])
            else:
                grads[m1] = last.backward(m1, None)
        first.backward(m, grads[m])
    for st in (first, last):
        assert st.reduce_gradients()
        st.apply_update()
    whole.train_step(x, y, w, apply=True)
    got, expected = {**first.get_weights(), **last.get_weights()}, whole.get_weights()
    assert got.keys() == expected.keys()
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=1e-6, err_msg=k)
