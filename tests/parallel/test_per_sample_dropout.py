"""Per-sample randomness (issue 24, point 3), real runs. With train.randomness: per_sample (the
default for model.layers), every dropout mask is a hash of (seed, epoch, sample, layer, element):

- a transformer with attention dropout and dropout layers trains to the same weights on 2 ranks as
  on 1 with the same global batch, and a 2-stage pipeline on 2 ranks to those of the unpipelined
  model on 1 (each backend; per-rank streams gave 0.08 apart on the dropout MLP of test_global_batch);
- torch and TensorFlow draw the same masks: after 50 steps their losses agree to 1e-4 (relative), where
  their own per-rank streams are percents apart (the comparison can fail).

SGD with momentum: Adam turns float noise in a gradient that is zero in exact arithmetic (attention's
key bias: softmax ignores a shift) into steps of +-lr, with or without dropout (3e-4 after 50 steps)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import hvtrain, load_weights, max_abs_diff, run
from tests.support.launch import BACKENDS, mpirun

TRANSFORMER = "tests/configs/dropout_transformer.yaml"
PIPE = "tests/configs/dropout_pipeline.yaml"
FLAT = ["--set", "parallel.pipeline.stages=1", "--set", "parallel.pipeline.placement=auto"]


def gap(a, b) -> float:
    return max_abs_diff(load_weights(a / "final.safetensors"), load_weights(b / "final.safetensors"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_models_train_the_same_on_one_and_two_ranks_and_through_a_pipeline(tmp_path, backend):
    common = ["--backend", backend, "--quiet"]
    said = run(mpirun(2, "train", TRANSFORMER, "--backend", backend, "--output-dir", str(tmp_path / "np2")),
               timeout=300).stdout
    assert "dropout masks per sample" in said, said
    run(hvtrain("train", TRANSFORMER, *common, "--output-dir", str(tmp_path / "np1")))
    assert gap(tmp_path / "np1", tmp_path / "np2") <= 1e-6
    pipe = [*common, "--set", "train.max_steps=30", "--set", "train.checkpoint_every=0"]
    run(mpirun(2, "train", PIPE, *pipe, "--output-dir", str(tmp_path / "pipe")), timeout=300)
    run(hvtrain("train", PIPE, *pipe, *FLAT, "--output-dir", str(tmp_path / "flat")))
    assert gap(tmp_path / "pipe", tmp_path / "flat") <= 1e-6


def test_torch_and_tensorflow_draw_the_same_dropout_masks(tmp_path):
    def losses(config: str, backend: str, randomness: str, *extra: str) -> tuple[float, float]:
        out = tmp_path / f"{config.rsplit('/', 1)[1]}-{backend}-{randomness}"
        run(hvtrain("train", config, "--backend", backend, "--quiet", "--set", f"train.randomness={randomness}",
                    "--set", "train.max_steps=50", *extra, "--output-dir", str(out)))
        s = json.loads((out / "summary.json").read_text())
        return s["train_loss"], s["val_loss"]

    def relative(a: tuple[float, float], b: tuple[float, float]) -> float:
        return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))

    for config, extra in ((TRANSFORMER, ()), (PIPE, (*FLAT, "--set", "train.checkpoint_every=0"))):
        same = relative(losses(config, "torch", "per_sample", *extra), losses(config, "tensorflow", "per_sample", *extra))
        assert same <= 1e-4, (config, same)
    apart = relative(losses(TRANSFORMER, "torch", "per_rank"), losses(TRANSFORMER, "tensorflow", "per_rank"))
    assert apart > 1e-3, f"per-rank streams should give other masks in each framework: {apart}"
