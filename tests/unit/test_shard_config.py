"""train.shard_optimizer (issue 24 point 4): what it does not cover yet is refused at its key, before
any rank starts, never trained half-sharded."""

from __future__ import annotations

import pytest

from hvtrain.config.load import load_config
from hvtrain.errors import ConfigError


def cfg(tmp_path, extra: str = "", train: str = ""):
    p = tmp_path / "z.yaml"
    p.write_text("name: z\ndata: {dataset: 'sklearn:digits', batch_size: 8}\n"
                 "model: {input_shape: [64], layers: [{type: dense, units: 16}, {type: dense, units: 10}]}\n"
                 f"train: {{shard_optimizer: true{train}}}\n{extra}")
    return load_config(p)


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_a_data_parallel_run_may_shard(tmp_path, backend):
    assert cfg(tmp_path, f"backend: {backend}\n").train.shard_optimizer


def test_a_pipeline_may_shard_each_stage_over_its_replicas(tmp_path):
    assert cfg(tmp_path, "parallel: {pipeline: {stages: 2}}\n").train.shard_optimizer


@pytest.mark.parametrize(("extra", "train", "why"), [
    ("", ", precision: fp16", "train.precision fp16"),
    ("", ", on_nan: skip", "train.on_nan: skip are not combined yet"),
    ("", ", compression: fp16", "train.compression fp16 is not combined"),
    ("horovod: {num_groups: 2}\n", "", "horovod.num_groups is not combined"),
])
def test_what_sharding_does_not_cover_is_refused_at_its_key(tmp_path, extra, train, why):
    with pytest.raises(ConfigError, match=r"z\.yaml:4: train\.shard_optimizer: .*" + why.replace(".", r"\.")):
        cfg(tmp_path, extra, train)
