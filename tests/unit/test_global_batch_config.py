"""data.global_batch_size (issue 24): the per-replica batch is derived from the world, or the run
is refused with the rank counts the batch fits, before any batch is read."""

from __future__ import annotations

import pytest

from hvtrain.config.load import load_config
from hvtrain.config.validate import per_replica_batch
from hvtrain.errors import ConfigError


def cfg(tmp_path, data: str = "global_batch_size: 64", extra: str = ""):
    p = tmp_path / "g.yaml"
    p.write_text(f"name: g\ndata: {{dataset: 'sklearn:digits', {data}}}\n"
                 f"model: {{input_shape: [64], layers: [{{type: dense, units: 10}}]}}\n{extra}")
    return load_config(p)


@pytest.mark.parametrize(("replicas", "acc", "per"), [(1, 1, 64), (2, 1, 32), (4, 1, 16), (2, 2, 16), (64, 1, 1)])
def test_the_per_replica_batch_is_the_global_one_split(tmp_path, replicas, acc, per):
    c = cfg(tmp_path, extra=f"train: {{grad_accumulation: {acc}}}\n")
    assert per_replica_batch(c, replicas) == per == c.data.batch_size
    assert per_replica_batch(c, 1) == 64 // acc, "derived again for another world (an elastic reset)"


def test_a_global_batch_that_does_not_split_names_the_counts_it_fits(tmp_path):
    c = cfg(tmp_path)
    with pytest.raises(ConfigError, match=r"g\.yaml:2: data\.global_batch_size: 64 does not split evenly over 3 "
                                          r"replica\(s\); replica counts it fits: 1, 2, 4, 8, 16, 32, 64$"):
        per_replica_batch(c, 3)
    c = cfg(tmp_path, extra="train: {grad_accumulation: 4}\n")
    with pytest.raises(ConfigError, match=r"64 does not split evenly over 32 replica\(s\) x 4 accumulation steps; "
                                          r"replica counts it fits: 1, 2, 4, 8, 16$"):
        per_replica_batch(c, 32)


def test_a_per_replica_batch_is_left_as_configured(tmp_path):
    c = cfg(tmp_path, "batch_size: 24")
    assert per_replica_batch(c, 4) == 24


@pytest.mark.parametrize(("data", "extra", "key"), [
    ("global_batch_size: 64, batch_size: 32", "", "data.global_batch_size"),
    ("global_batch_size: 64", "optimizer: {scale_lr: true}\n", "optimizer.scale_lr"),
    ("global_batch_size: 0", "", "data.global_batch_size"),
])
def test_what_would_make_the_global_batch_mean_another_training_is_refused(tmp_path, data, extra, key):
    with pytest.raises(ConfigError, match=rf"g\.yaml:\d+: {key.replace('.', '[.]')}"):
        cfg(tmp_path, data, extra)


def test_a_global_batch_not_a_multiple_of_the_accumulation_is_refused_at_load(tmp_path):
    with pytest.raises(ConfigError, match=r"g\.yaml:2: data\.global_batch_size: 64 is not a multiple of "
                                          r"train\.grad_accumulation 3"):
        cfg(tmp_path, extra="train: {grad_accumulation: 3}\n")


def test_the_run_identity_does_not_depend_on_the_world(tmp_path):
    """summary.json's config_hash and a checkpoint's experiment: the same on every rank count (a
    requeue on another node count of a finished run keeps its results, resumes its checkpoints)."""
    from hvtrain.config.validate import experiment_record
    from hvtrain.runtime.manifest import config_hash, training_hash

    c = cfg(tmp_path)
    seen = set()
    for replicas in (1, 2, 4):
        per_replica_batch(c, replicas)
        seen.add((training_hash(c), config_hash(c), str(experiment_record(c))))
    assert len(seen) == 1
    assert "batch_size" not in experiment_record(c)["data"]
    fixed = cfg(tmp_path, "batch_size: 16")
    assert experiment_record(fixed)["data"]["batch_size"] == 16, "a per-replica batch is the experiment's"


def test_a_launch_the_global_batch_does_not_fit_fails_before_any_framework_starts(tmp_path, monkeypatch):
    import sys

    import hvtrain

    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    before = {m for m in ("torch", "tensorflow", "horovod") if m in sys.modules}
    config = {"name": "g", "data": {"dataset": "sklearn:digits", "global_batch_size": 64},
              "model": {"input_shape": [64], "layers": [{"type": "dense", "units": 10}]},
              "output_dir": str(tmp_path / "g")}
    with pytest.raises(ConfigError, match=r"data\.global_batch_size: 64 does not split evenly over 3 replica"):
        hvtrain.train(config, quiet=True)
    assert {m for m in ("torch", "tensorflow", "horovod") if m in sys.modules} == before
