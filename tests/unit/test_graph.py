"""Graph specs (issue 9): names, inputs, merges, repeat blocks, and a located error for each bad graph."""

import pytest

from hvtrain.config.load import load_config
from hvtrain.errors import ConfigError
from hvtrain.model.spec import INPUT, build_spec


def spec_of(tmp_path, layers: str, input_shape="[8, 8, 1]", extra=""):
    p = tmp_path / "m.yaml"
    p.write_text(f"name: m\ndata: {{dataset: sklearn:digits}}\nmodel:\n  input_shape: {input_shape}\n"
                 f"  layers:\n{layers}{extra}")
    return build_spec(load_config(p)), p


def error_of(tmp_path, layers: str, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        spec_of(tmp_path, layers, **kw)
    return str(info.value)


RES = ("    - {type: conv2d, filters: 16, kernel_size: 3, padding: same, name: a}\n"
       "    - {type: conv2d, filters: 16, kernel_size: 3, padding: same}\n"
       "    - {type: add, inputs: [a, 1], name: res1}\n")


def test_a_plain_list_is_the_old_sequential_spec(tmp_path):
    spec, _ = spec_of(tmp_path, "    - {type: flatten}\n    - {type: dense, units: 10}\n")
    assert spec.sequential and [layer.inputs for layer in spec.layers] == [(INPUT,), (0,)]
    assert [w.name for w in spec.weight_specs()] == ["layers.1.kernel", "layers.1.bias"]


def test_residual_graph_resolves_names_and_shapes(tmp_path):
    spec, _ = spec_of(tmp_path, RES.replace("[a, 1]", "[a, 1]").replace("inputs: [a, 1]", "inputs: [a, b]")
                      .replace("padding: same}\n", "padding: same, name: b}\n", 1)
                      + "    - {type: global_avgpool}\n    - {type: dense, units: 10}\n")
    assert not spec.sequential
    assert spec.layers[2].inputs == (0, 1) and spec.layers[2].output_shape == (8, 8, 16)
    assert spec.output_shape == (10,)


def test_shape_mismatch_at_a_merge_names_the_layer(tmp_path):
    layers = ("    - {type: conv2d, filters: 16, kernel_size: 3, padding: same, name: a}\n"
              "    - {type: conv2d, filters: 32, kernel_size: 3, padding: same, name: b}\n"
              "    - {type: add, inputs: [a, b], name: res1}\n")
    msg = error_of(tmp_path, layers)
    assert msg.endswith("m.yaml:8: model.layers[2] (res1): add: shapes (8, 8, 16) and (8, 8, 32) differ"), msg


@pytest.mark.parametrize("inputs,expected", [
    ("[nope]", "model.layers[1] (x): inputs: unknown layer 'nope'"),
    ("[later]", "model.layers[1] (x): inputs: 'later' is model.layers[2], defined later; a layer must come "
                "after its inputs"),
    ("[x]", "model.layers[1] (x): inputs: 'x' is its own output"),
])
def test_bad_input_names(tmp_path, inputs, expected):
    layers = ("    - {type: flatten}\n"
              f"    - {{type: dense, units: 4, name: x, inputs: {inputs}}}\n"
              "    - {type: dense, units: 10, name: later}\n")
    msg = error_of(tmp_path, layers)
    assert expected in msg and "m.yaml:7:" in msg, msg


def test_an_unused_branch_is_an_error(tmp_path):
    layers = ("    - {type: flatten, name: f}\n"
              "    - {type: dense, units: 4, name: side}\n"
              "    - {type: dense, units: 10, inputs: [f]}\n")
    msg = error_of(tmp_path, layers)
    assert "m.yaml:7: model.layers[1] (side): its output is never used" in msg, msg


@pytest.mark.parametrize("layers,expected", [
    ("    - {type: flatten, name: f}\n    - {type: add}\n", "add takes at least 2 input(s), got 1"),
    ("    - {type: flatten, name: f}\n    - {type: dense, units: 3, inputs: [f, f]}\n", "dense takes 1 input(s)"),
    ("    - {type: flatten, name: f~2}\n", "expected a name without dots or tildes, got 'f~2'"),
    ("    - repeat: 2\n      layers:\n        - {type: flatten, name: input}\n", "'input' names the model input"),
    ("    - {type: flatten, name: input}\n", "'input' names the model input"),
    ("    - {type: flatten}\n    - {type: concatenate, inputs: [0, input]}\n",
     "model.layers[1].inputs: expected a list of layer names (or input), got [0, 'input']"),
])
def test_more_bad_graphs(tmp_path, layers, expected):
    assert expected in error_of(tmp_path, layers)


def test_concatenate_checks_the_other_axes(tmp_path):
    layers = ("    - {type: conv2d, filters: 4, kernel_size: 3, name: a}\n"
              "    - {type: concatenate, inputs: [a, input], name: cat}\n")
    msg = error_of(tmp_path, layers)
    assert "(cat): concatenate on axis -1: shapes (6, 6, 4) and (8, 8, 1) differ outside that axis" in msg


def test_model_output_names_a_layer_and_what_follows_it_must_be_used(tmp_path):
    layers = ("    - {type: flatten, name: f}\n    - {type: dense, units: 3, name: aux}\n"
              "    - {type: dense, units: 10, inputs: [f], name: head}\n")
    with pytest.raises(ConfigError, match=r"model.layers\[1\] \(aux\): its output is never used"):
        spec_of(tmp_path, layers, extra="  output: head\n")
    spec, _ = spec_of(tmp_path, layers.replace("inputs: [f]", "inputs: [aux]"), extra="  output: head\n")
    assert spec.output_shape == (10,) and spec.output_index == 2
    assert "model.output: no layer is named 'nope'" in error_of(tmp_path, layers, extra="  output: nope\n")


def test_repeat_inlines_a_named_block(tmp_path):
    block = ("    - {type: flatten}\n"
             "    - {type: dense, units: 8, name: stem}\n"
             "    - repeat: 3\n"
             "      layers:\n"
             "        - {type: dense, units: 8, activation: relu, name: h}\n"
             "        - {type: add, inputs: [h, hh]}\n"
             "    - {type: dense, units: 10, inputs: [h]}\n")
    msg = error_of(tmp_path, block)  # 'hh' is no name: the error points into the block
    assert "m.yaml:11: model.layers[2].layers[1]: inputs: unknown layer 'hh'" in msg, msg
    good = block.replace("inputs: [h, hh]", "inputs: [h, h], name: out").replace("inputs: [h]}", "inputs: [out]}")
    spec, _ = spec_of(tmp_path, good)
    names = [layer.name for layer in spec.layers]
    assert names == ["", "stem", "h.1", "out.1", "h.2", "out.2", "h.3", "out.3", ""]
    assert spec.layers[3].inputs == (2, 2) and spec.layers[4].inputs == (3,)  # a copy reads the previous one
    assert spec.layers[-1].inputs == (7,)  # after the block, `out` is the last copy's
    assert [w.name for w in spec.layers[6].weights] == ["layers.6.kernel", "layers.6.bias"]
    assert "repeat: expected a number of copies >= 1" in error_of(tmp_path, good.replace("repeat: 3", "repeat: 0"))


def test_a_repeated_residual_block_reads_the_previous_copy(tmp_path):
    """Names bind in order: inside copy k, `x` before its redefinition is copy k-1's (the block input)."""
    layers = ("    - {type: flatten}\n"
              "    - {type: dense, units: 8, name: x}\n"
              "    - repeat: 2\n"
              "      layers:\n"
              "        - {type: dense, units: 8, activation: relu}\n"
              "        - {type: add, inputs: [x, 3], name: x}\n"
              "    - {type: dense, units: 10}\n").replace("[x, 3]", "[x, h]").replace(
        "activation: relu}", "activation: relu, name: h}")
    spec, _ = spec_of(tmp_path, layers)
    assert [layer.name for layer in spec.layers] == ["", "x", "h.1", "x.1", "h.2", "x.2", ""]
    assert spec.layers[3].inputs == (1, 2)  # copy 1: the x before the block, its own h
    assert spec.layers[5].inputs == (3, 4)  # copy 2: copy 1's x
    assert spec.layers[4].inputs == (3,)


def test_plan_lists_the_tensors_each_boundary_carries():
    from click.testing import CliRunner

    from hvtrain.cli import cli

    out = CliRunner().invoke(cli, ["plan", "tests/configs/residual_pipeline.yaml", "-np", "3"])
    assert out.exit_code == 0, out.output
    assert "  0 -> 1: input [64] 256.0 B, layer 0 (a) [32] 128.0 B, layer 1 (dense) [32] 128.0 B" in out.output
    assert ("  1 -> 2: input [64] 256.0 B, layer 0 (a) [32] 128.0 B, layer 3 (r) [32] 128.0 B, layer 4 (c) [32] "
            "128.0 B") in out.output


def test_token_ids_cannot_cross_a_stage_boundary(tmp_path):
    from hvtrain.pipeline.plan import make_plan

    p = tmp_path / "t.yaml"
    p.write_text("name: t\ndata: {dataset: sklearn:digits}\nmodel:\n  input_shape: [4]\n  layers:\n"
                 "    - {type: embedding, input_dim: 17, output_dim: 8}\n    - {type: flatten, name: f}\n"
                 "    - {type: embedding, input_dim: 17, output_dim: 4, inputs: [input]}\n"
                 "    - {type: flatten, name: g}\n    - {type: concatenate, inputs: [f, g]}\n"
                 "parallel:\n  pipeline: {stages: 2, placement: {0: [0, 1], 1: [2, 4]}}\n")
    cfg = load_config(p)
    with pytest.raises(ConfigError, match="stage 1 reads the model input"):
        make_plan(cfg, build_spec(cfg), 2)


def test_a_bad_graph_is_one_located_line_and_exit_2_before_any_framework(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\ndata: {dataset: sklearn:digits}\nmodel:\n  input_shape: [8, 8, 1]\n  layers:\n"
                   "    - {type: conv2d, filters: 16, kernel_size: 3, padding: same, name: a}\n"
                   "    - {type: conv2d, filters: 32, kernel_size: 3, padding: same, name: b}\n"
                   "    - {type: add, inputs: [a, b], name: res1}\n")
    code = ("import sys; from hvtrain.cli import main; sys.argv = ['hvtrain', 'train', sys.argv[1]]\n"
            "try:\n    main()\nfinally:\n    assert 'torch' not in sys.modules and 'tensorflow' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"hvtrain: error: {bad}:8: model.layers[2] (res1): add: shapes (8, 8, 16) and (8, 8, 32) differ"]


def test_sibling_blocks_and_top_level_rebinding_reuse_names(tmp_path):
    """Defect found in review: a second repeat block (or a top-level rebinding) of a name collided."""
    block = ("    - repeat: 2\n      layers:\n"
             "        - {type: dense, units: 8, name: branch}\n"
             "        - {type: add, inputs: [x, branch], name: x}\n")
    layers = ("    - {type: flatten}\n    - {type: dense, units: 8, name: x}\n" + block +
              "    - {type: dense, units: 8, name: x}\n" + block + "    - {type: dense, units: 10}\n")
    spec, _ = spec_of(tmp_path, layers, extra="  output: null\n")
    names = [layer.name for layer in spec.layers]
    assert names[1:6] == ["x", "branch.1", "x.1", "branch.2", "x.2"]
    assert names[6:11] == ["x~2", "branch.1~2", "x.1~2", "branch.2~2", "x.2~2"]
    assert spec.layers[8].inputs == (6, 7)  # the second block's first copy reads the rebound x
    assert len(set(names[1:11])) == 10


def test_model_output_resolves_names_bound_inside_blocks(tmp_path):
    layers = ("    - {type: flatten}\n    - repeat: 2\n      layers:\n        - {type: dense, units: 10, name: y}\n")
    spec, _ = spec_of(tmp_path, layers, extra="  output: y\n")
    assert spec.output_index == 2 and spec.layers[2].name == "y.2"


def test_only_embeddings_may_read_token_ids(tmp_path):
    layers = ("    - {type: embedding, input_dim: 17, output_dim: 8}\n    - {type: flatten, name: f}\n"
              "    - {type: dense, units: 4, inputs: [input], name: raw}\n"
              "    - {type: concatenate, inputs: [f, raw]}\n")
    msg = error_of(tmp_path, layers, input_shape="[4]")
    assert "model.layers[2] (raw): dense reads the model input, which holds token ids" in msg and "m.yaml:8:" in msg


def test_missing_stage_key_points_into_the_repeat_block(tmp_path):
    from hvtrain.pipeline.plan import make_plan

    p = tmp_path / "s.yaml"
    p.write_text("name: s\ndata: {dataset: sklearn:digits}\nmodel:\n  input_shape: [64]\n  layers:\n"
                 "    - {type: dense, units: 8, stage: 0}\n    - repeat: 2\n      layers:\n"
                 "        - {type: dense, units: 8}\n    - {type: dense, units: 10, stage: 1}\n"
                 "parallel:\n  pipeline: {stages: 2}\n")
    cfg = load_config(p)
    with pytest.raises(ConfigError, match=r"s.yaml:9: model.layers\[1\].layers\[0\]: every layer needs a `stage:`"):
        make_plan(cfg, build_spec(cfg), 2)
