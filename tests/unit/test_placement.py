from pathlib import Path

import pytest
from click.testing import CliRunner

from hvtrain.cli import cli
from hvtrain.config.load import load_config
from hvtrain.errors import ConfigError
from hvtrain.model.spec import build_spec
from hvtrain.pipeline.plan import make_plan
from hvtrain.pipeline.schedule import bubble_fraction, peak_in_flight, stage_ops

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/digits_pipeline.yaml"


@pytest.mark.parametrize("S,M", [(2, 4), (4, 8), (3, 2), (4, 1)])
def test_schedules_run_every_micro_batch_once_and_bound_memory(S, M):
    for s in range(S):
        for kind in ("gpipe", "1f1b"):
            ops = stage_ops(kind, S, s, M)
            assert sorted(m for k, m in ops if k == "F") == list(range(M))
            assert sorted(m for k, m in ops if k == "B") == list(range(M))
            for m in range(M):
                assert ops.index(("F", m)) < ops.index(("B", m))
        assert peak_in_flight(stage_ops("gpipe", S, s, M)) == M
        assert peak_in_flight(stage_ops("1f1b", S, s, M)) == min(S - s, M) <= S


def test_1f1b_order_stage0():
    assert stage_ops("1f1b", 2, 0, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)


DEFAULT_LAYERS = ("    - {type: dense, units: 256, activation: relu}\n"
                  "    - {type: dense, units: 256, activation: relu}\n"
                  "    - {type: dense, units: 128, activation: relu}\n"
                  "    - {type: dense, units: 10}\n")


def plan_for(tmp_path, pipeline: str, np_: int, layers: str = DEFAULT_LAYERS, devices=None):
    p = tmp_path / "p.yaml"
    p.write_text("name: p\ndata: {dataset: sklearn:digits}\nmodel:\n  input_shape: [64]\n  layers:\n" + layers +
                 "parallel:\n  pipeline:\n" + pipeline)
    cfg = load_config(p)
    return make_plan(cfg, build_spec(cfg), np_, devices)


def test_rank_layout_and_groups(tmp_path):
    plan = plan_for(tmp_path, "    stages: 2\n    micro_batches: 4\n    placement: {0: [0, 1], 1: [2, 3]}\n", 4)
    assert [plan.stage_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert [plan.replica_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert plan.dp_group(0) == [0, 2] and plan.dp_group(1) == [1, 3]
    assert [(s.first, s.last) for s in plan.stages] == [(0, 1), (2, 3)]
    assert plan.stages[0].params == 64 * 256 + 256 + 256 * 256 + 256


def test_auto_placement_balances_parameters(tmp_path):
    plan = plan_for(tmp_path, "    stages: 2\n", 2)
    # params: 16,640 | 65,792 | 32,896 | 1,290 -> half of 116,618 is reached inside layer 1
    assert [(s.first, s.last) for s in plan.stages] == [(0, 1), (2, 3)]
    plan = plan_for(tmp_path, "    stages: 4\n", 4)
    assert [(s.first, s.last) for s in plan.stages] == [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_stage_keys_on_layers(tmp_path):
    layers = ("    - {type: dense, units: 32, activation: relu, stage: 0}\n"
              "    - {type: dense, units: 32, activation: relu, stage: 1}\n"
              "    - {type: dense, units: 10, stage: 1}\n")
    plan = plan_for(tmp_path, "    stages: 2\n", 2, layers)
    assert [(s.first, s.last) for s in plan.stages] == [(0, 0), (1, 2)]


@pytest.mark.parametrize("pipeline,np_,message", [
    ("    stages: 2\n", 3, "parallel.pipeline.stages: the world size (-np 3) must be a multiple of the 2 stages"),
    ("    stages: 2\n    placement: {0: [0, 1], 1: [3, 3]}\n", 2, "gap: layers 2..2 are in no stage (stage 1 starts at 3)"),
    ("    stages: 2\n    placement: {0: [0, 2], 1: [2, 3]}\n", 2, "overlap: stage 1 starts at layer 2"),
    ("    stages: 2\n    placement: {0: [0, 3]}\n", 2, "stage 1 is empty (no layers)"),
    ("    stages: 2\n    placement: {0: [0, 1], 1: [2, 2]}\n", 2, "gap: layers 3..3 are in no stage"),
    ("    stages: 2\n    placement: {0: [0, 1], 1: [3, 2]}\n", 2, "stage 1: [3, 2] is empty"),
    ("    stages: 5\n", 5, "5 stages for 4 layers"),
    ("    stages: 2\n    placement: middle\n", 2, "expected 'auto' or {stage: [first, last]}"),
    ("    stages: 2\n    devices: {1: cuda:1}\n", 2, "parallel.pipeline.devices.1: device 'cuda:1' does not exist on "
                                                  "this host (0 GPU(s) visible)"),
    ("    stages: 2\n    devices: {0: tpu}\n", 2, "expected cpu, cuda:N or /GPU:N, got 'tpu'"),
])
def test_plan_errors_are_located(tmp_path, pipeline, np_, message):
    with pytest.raises(ConfigError) as e:
        plan_for(tmp_path, pipeline, np_, devices={"gpu": 0})
    assert "p.yaml:" in str(e.value) and message in str(e.value), str(e.value)


def test_shape_mismatch_at_stage_boundary_is_named(tmp_path):
    layers = ("    - {type: dense, units: 32, stage: 0}\n"
              "    - {type: lstm, units: 8, stage: 1}\n"
              "    - {type: dense, units: 10, stage: 1}\n")
    with pytest.raises(ConfigError, match=r"p.yaml:7: model.layers\[1\].type: lstm expects \(T, F\) sequence input, "
                                          r"got shape \[32\].*\(stage boundary 0 -> 1: stage 0 outputs \[32\]\)"):
        plan_for(tmp_path, "    stages: 2\n", 2, layers)


def test_plan_command_prints_layout_and_bubble():
    r = CliRunner().invoke(cli, ["plan", str(EXAMPLE), "-np", "4"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "2 stages x 2 replica(s) = 4 ranks" in r.output and "bubble (S-1)/(M+S-1) = 0.200" in r.output
    assert "data-parallel (allreduce) groups: stage 0: ranks [0, 2]; stage 1: ranks [1, 3]" in r.output
    assert "cpu" in r.output
    r = CliRunner().invoke(cli, ["plan", str(EXAMPLE), "-np", "3"])
    assert r.exit_code == 2 and "must be a multiple of the 2 stages" in r.output


@pytest.mark.parametrize("placement", ["auto", "{0: [0, 0], 1: [1, 1], 2: [2, 3]}"])
def test_a_stage_without_a_trainable_weight_is_refused_at_the_plan(tmp_path, placement):
    """Cold review (issue 24): auto placement put a dropout alone in a stage; torch then failed
    after Horovod's start on an empty optimizer (and sharding blamed the model), on that stage's
    ranks only. The plan refuses it, naming the stage and its layers."""
    layers = ("    - {type: dense, units: 256, activation: relu}\n    - {type: dropout, rate: 0.2}\n"
              "    - {type: activation, activation: relu}\n    - {type: dense, units: 10}\n")
    with pytest.raises(ConfigError, match=r"stage 1 holds no trainable weight \(layers 1: dropout"):
        plan_for(tmp_path, f"    stages: 3\n    placement: {placement}\n", 3, layers)
