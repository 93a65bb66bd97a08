"""Counter-based draws (hvtrain.data.draws, issue 24): a sample's dropout mask is a function of
(seed, epoch, sample, layer, element) alone, so it cannot depend on the batch, rank or world size
that computes it; and the masks are fair coins (the tensor-side hash is a 32-bit finaliser)."""

import numpy as np
import pytest

from hvtrain.config.validate import draws_seed, per_sample_randomness
from hvtrain.data.draws import dropout_keys, keep_mask, uniforms
from hvtrain.errors import ConfigError


def test_a_samples_mask_does_not_depend_on_the_batch_it_travels_in():
    samples = np.array([5, 900, 17, 42, 3, 1000])
    together = keep_mask(dropout_keys(7, 2, samples), 4, (3, 5), 0.4)
    alone = np.concatenate([keep_mask(dropout_keys(7, 2, samples[i:i + 1]), 4, (3, 5), 0.4)
                            for i in range(len(samples))])
    assert np.array_equal(together, alone)
    # split as two ranks take them (every 2nd sample)
    halves = [keep_mask(dropout_keys(7, 2, samples[r::2]), 4, (3, 5), 0.4) for r in (0, 1)]
    assert np.array_equal(together[0::2], halves[0]) and np.array_equal(together[1::2], halves[1])


def test_masks_change_with_every_part_of_the_key():
    base = keep_mask(dropout_keys(7, 2, np.arange(64)), 4, (256,), 0.5)
    for other in (keep_mask(dropout_keys(8, 2, np.arange(64)), 4, (256,), 0.5),  # seed
                  keep_mask(dropout_keys(7, 3, np.arange(64)), 4, (256,), 0.5),  # epoch
                  keep_mask(dropout_keys(7, 2, np.arange(1, 65)), 4, (256,), 0.5),  # sample
                  keep_mask(dropout_keys(7, 2, np.arange(64)), 5, (256,), 0.5)):  # layer
        agree = (base == other).mean()
        assert 0.45 < agree < 0.55, agree  # independent coins agree half the time


def test_masks_are_fair_and_uncorrelated():
    for rate in (0.1, 0.5, 0.9):
        m = keep_mask(dropout_keys(0, 0, np.arange(2048)), 0, (512,), rate)
        assert abs(m.mean() - (1 - rate)) < 0.005, (rate, m.mean())
    m = keep_mask(dropout_keys(0, 0, np.arange(2048)), 0, (512,), 0.5).astype(np.float64)
    for a, b in ((m[:, :-1], m[:, 1:]), (m[:-1], m[1:])):  # neighbouring elements, neighbouring samples
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.01


def test_augmentations_draws_are_unchanged_by_the_shared_module():
    """augment's uniforms moved here: the values its tests and saved runs were made with."""
    expected = [[0.8075375, 0.80501527], [0.78798862, 0.21611812]]  # augment.uniforms before the move
    np.testing.assert_allclose(uniforms(3, 1, np.array([0, 9]), 2), expected, rtol=0, atol=1e-8)


def _config(tmp_path, model: str, randomness: str | None):
    from hvtrain.config.load import load_config

    p = tmp_path / "r.yaml"
    p.write_text("name: r\ndata: {dataset: 'sklearn:digits'}\n" + model
                 + (f"train: {{randomness: {randomness}}}\n" if randomness else ""))
    return load_config(p)


LAYERS = "model: {input_shape: [64], layers: [{type: dropout, rate: 0.5}, {type: dense, units: 10}]}\n"
ENTRYPOINT = "model: {entrypoint: 'pkg.models:build'}\n"


@pytest.mark.parametrize(("model", "randomness", "per_sample"), [
    (LAYERS, None, True), (LAYERS, "auto", True), (LAYERS, "per_sample", True), (LAYERS, "per_rank", False),
    (ENTRYPOINT, None, False), (ENTRYPOINT, "per_rank", False)])
def test_randomness_auto_is_per_sample_for_the_catalogue_and_per_rank_for_a_native_model(
        tmp_path, model, randomness, per_sample):
    c = _config(tmp_path, model, randomness)
    assert per_sample_randomness(c) is per_sample
    assert draws_seed(c) == (c.seed if per_sample else None)


def test_per_sample_for_a_native_model_is_refused_at_its_key(tmp_path):
    """Its layers draw from the framework's streams: per_sample would be a promise not kept."""
    with pytest.raises(ConfigError, match=r"r\.yaml:4: train\.randomness: per_sample draws the catalogue's dropout "
                                          r"masks .*set per_rank or auto$"):
        _config(tmp_path, ENTRYPOINT, "per_sample")


def test_a_checkpoint_from_before_train_randomness_still_resumes_and_its_masks_are_named():
    """train.randomness is not a key a resume must match (masks change from the resume on, as on
    a world-size change under per_rank); a record without it drew per-rank masks."""
    from hvtrain.io.checkpoints import config_differences
    from hvtrain.training.checkpoint import _randomness

    old = {"model": {"layers": [{"type": "dropout"}]}, "train": {"epochs": 3}}
    new = {"model": {"layers": [{"type": "dropout"}]}, "train": {"epochs": 3, "randomness": "auto"}}
    assert config_differences(old, new) == []
    assert _randomness(old) == "per_rank" and _randomness(new) == "per_sample"
    assert _randomness({"model": {"entrypoint": "m:f"}, "train": {"randomness": "auto"}}) == "per_rank"
