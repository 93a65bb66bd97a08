"""Per-sample dropout masks in each framework (issue 24): the int64 tensor ops of
backends/<fw>/draws.py compute exactly the numpy reference hvtrain.data.draws.keep_mask, for a
dense activation, an attention-weight shape and any rate, so torch and TensorFlow drop the same
elements of the same sample on any rank count."""

import importlib

import numpy as np
import pytest

from hvtrain.data.draws import dropout_keys, keep_mask
from tests.backends.conftest import make_backend

TRANSFORMER = "tests/configs/dropout_transformer.yaml"


def framework_mask(name: str, keys: np.ndarray, layer: int, shape: tuple[int, ...], rate: float) -> np.ndarray:
    draws = importlib.import_module(f"hvtrain.backends.{name}.draws")
    d = draws.SampleDraws()
    if name == "torch":
        import torch

        x = torch.zeros((len(keys), *shape))
    else:
        import tensorflow as tf

        x = tf.zeros((len(keys), *shape))
    with draws.keyed(d, keys):
        return np.asarray(d.keep(layer, x, rate))


@pytest.mark.parametrize("layer,shape,rate", [(0, (7,), 0.5), (3, (2, 8, 8), 0.2), (12, (4, 3, 5), 0.9),
                                              (1, (1,), 0.01)])
def test_the_frameworks_masks_are_the_reference_masks(backend_name, layer, shape, rate):
    keys = dropout_keys(2**32 - 1, 4, np.arange(10**9, 10**9 + 40))  # the largest seed, large sample ids
    got = framework_mask(backend_name, keys, layer, shape, rate)
    assert got.dtype == bool and np.array_equal(got, keep_mask(keys, layer, shape, rate))


def test_a_training_step_without_the_samples_keys_is_refused(backend_name):
    """A caller that forgets the keys of a per-sample model fails loudly, never drops nothing."""
    backend, p = make_backend(backend_name, TRANSFORMER, "train.threads=0")
    x, y = p.data.x_train[:4], p.data.y_train[:4]
    with pytest.raises(ValueError, match="per_sample"):
        backend.train_step(x, y, np.full(4, 0.25, np.float32), apply=True)


@pytest.mark.parametrize("saved_under,resumed_under", [("per_rank", "per_sample"), ("per_sample", "per_rank")])
def test_a_checkpoint_resumes_under_the_other_masks_mode(backend_name, saved_under, resumed_under):
    """Defect (cold review): TensorFlow keyed its model variables by position, and a Keras dropout
    has a seed generator under per_rank and none under per_sample, so a dropout model's checkpoint
    from the other mode (or from before train.randomness, per-rank masks) failed to load
    (KeyError 'model.2'). The weights and optimizer state load, in either direction."""
    saved, p = make_backend(backend_name, TRANSFORMER, f"train.randomness={saved_under}", "train.threads=0")
    x, y = p.data.x_train[:4], p.data.y_train[:4]
    keys = dropout_keys(p.cfg.seed, 0, np.arange(4)) if saved_under == "per_sample" else None
    saved.train_step(x, y, np.full(4, 0.25, np.float32), apply=True, keys=keys)
    state = saved.get_state()
    resumed, _ = make_backend(backend_name, TRANSFORMER, f"train.randomness={resumed_under}", "train.threads=0")
    resumed.set_state(state, rng=True)
    a, b = saved.get_weights(), resumed.get_weights()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    again = resumed.get_state()
    assert all(np.array_equal(state[k], again[k]) for k in state if k.startswith("optim."))
