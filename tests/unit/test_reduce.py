"""The direct gradient reduction's packing (backends/reduce.py), its choice (horovod.reduction) and
the Horovod cycle it sets; the torch gradients it sums (backends/torch/ops.DirectGradients). The
real multi-rank runs (np=2 equals np=1, replicas agree, resume) go through it by default on CPUs:
tests/parallel."""

import numpy as np
import pytest
import torch

from hvtrain.backends.reduce import PACK_BYTES, direct_reduction, sum_arrays
from hvtrain.config.load import load_config
from hvtrain.launch.process import ProcessInfo
from hvtrain.runtime.knobs import horovod_env


class TwoRanks:
    """A world of two ranks holding the same arrays: a sum is twice each; every call recorded."""

    def __init__(self) -> None:
        self.info, self.direct, self.calls = ProcessInfo(0, 2), True, []

    def sum_(self, values, out=None):
        self.calls.append((values.dtype, values.size))
        target = values if out is None else out
        target[...] = values * 2
        return target


def arrays():
    rng = np.random.default_rng(0)
    big = PACK_BYTES // 4 + 1  # float32 elements: one over the packing limit
    return [rng.standard_normal((big,)).astype(np.float32), rng.standard_normal((3, 4)).astype(np.float32),
            rng.standard_normal((5,)).astype(np.float64), rng.standard_normal((2, big)).astype(np.float32),
            rng.standard_normal((7,)).astype(np.float32)]


def test_large_arrays_travel_alone_and_small_ones_packed_per_dtype():
    world, given = TwoRanks(), arrays()
    before = [a.copy() for a in given]
    out = sum_arrays(world, given)
    for a, b, o in zip(given, before, out, strict=True):
        assert o is a and o.shape == b.shape and o.dtype == b.dtype
        np.testing.assert_array_equal(o, 2 * b)
    # two large float32 alone; the small float32 ones (12 + 7) in one call, the float64 one in another
    assert sorted(world.calls, key=str) == sorted([(np.dtype(np.float32), given[0].size),
                                                   (np.dtype(np.float32), given[3].size),
                                                   (np.dtype(np.float32), 19), (np.dtype(np.float64), 5)], key=str)


def test_into_other_arrays_leaves_the_inputs_alone():
    world, given = TwoRanks(), arrays()
    before = [a.copy() for a in given]
    into = [np.empty_like(a) for a in given]
    out = sum_arrays(world, given, into)
    for a, b, o in zip(given, before, out, strict=True):
        np.testing.assert_array_equal(a, b)  # not written
        np.testing.assert_array_equal(o, 2 * b)
    assert out[0] is into[0] and out[3] is into[3]


@pytest.mark.parametrize(("sets", "gpu", "expected"), [
    ((), False, True), ((), True, False), (("train.compression=fp16",), False, False),
    (("horovod.reduction=hooks",), False, False), (("horovod.reduction=direct",), True, True),
    # what only Horovod's path has: its timeline, autotuning, gradient groups
    (("horovod.timeline=t.json",), False, False), (("horovod.autotune=true",), False, False),
    (("horovod.num_groups=2",), False, False),
    (("train.shard_optimizer=true",), False, False), (("train.shard_optimizer=true", "horovod.reduction=direct"),
                                                      False, False)])
def test_which_reduction(sets, gpu, expected):
    cfg = load_config("examples/digits_mlp.yaml", list(sets))
    assert direct_reduction(cfg, gpu) is expected


@pytest.mark.parametrize("key", ["train.compression=fp16", "horovod.num_groups=2", "horovod.timeline=t.json",
                                 "horovod.autotune=true"])
def test_direct_refuses_what_only_horovods_path_does(key):
    from hvtrain.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"{key.split('=')[0]}: acts on Horovod's allreduces.*reduction: hooks"):
        load_config("examples/digits_mlp.yaml", ["horovod.reduction=direct", key])


def test_the_direct_reduction_idles_horovods_cycle_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    h = load_config("examples/digits_mlp.yaml").horovod
    assert horovod_env(h)["HOROVOD_CYCLE_TIME"] == "1"
    assert horovod_env(h, direct=True)["HOROVOD_CYCLE_TIME"] == "200"
    h = load_config("examples/digits_mlp.yaml", ["horovod.direct_cycle_ms=5"]).horovod
    assert horovod_env(h, direct=True)["HOROVOD_CYCLE_TIME"] == "5"
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "3")
    assert "HOROVOD_CYCLE_TIME" not in horovod_env(h, direct=True)


def test_torch_gradients_are_summed_in_place_and_a_missing_one_steps_on_zero():
    from hvtrain.backends.torch.ops import DirectGradients

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5000), torch.nn.ReLU(), torch.nn.Linear(5000, 3))
    unused = torch.nn.Parameter(torch.ones(2))  # an unused head: no gradient from backward
    model.register_parameter("unused", unused)
    model(torch.randn(8, 4)).sum().backward()
    model[0].weight.grad = model[0].weight.grad.t().contiguous().t()  # a non-contiguous gradient
    expected = {n: 2 * p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    world = TwoRanks()
    DirectGradients(list(model.parameters()), world).sum()
    for n, p in model.named_parameters():
        if n == "unused":
            assert torch.equal(p.grad, torch.zeros(2))
        else:
            torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=0)
    assert len(world.calls) == 2  # the 80 KB first weight alone; everything else packed


def test_a_scalar_keeps_its_shape():
    """A native Keras model's scalar weight (add_weight(shape=())): TensorFlow checks the summed shape."""
    world = TwoRanks()
    out = sum_arrays(world, [np.require(np.array(3.0, np.float32), requirements="C")], [np.empty((), np.float32)])
    assert out[0].shape == () and float(out[0]) == 6.0


def test_torch_sparse_and_channels_last_gradients_are_summed_dense_and_contiguous():
    from hvtrain.backends.torch.ops import DirectGradients

    torch.manual_seed(0)
    emb = torch.nn.Embedding(5000, 8, sparse=True)  # 160 KB: summed alone, in place
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)  # unused: a zero gradient
    emb(torch.tensor([1, 2, 2])).sum().backward()
    expected = 2 * emb.weight.grad.to_dense()
    world = TwoRanks()
    DirectGradients([*emb.parameters(), *conv.parameters()], world).sum()
    torch.testing.assert_close(emb.weight.grad, expected, rtol=0, atol=0)
    assert not emb.weight.grad.is_sparse
    assert torch.equal(conv.weight.grad, torch.zeros_like(conv.weight)) and conv.weight.grad.is_contiguous()
