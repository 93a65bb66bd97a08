from pathlib import Path

import pytest

from hvtrain.config.load import load_config
from hvtrain.config.yaml import parse_override
from hvtrain.errors import ConfigError
from tests.support.configs import BASE

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def test_examples_load_with_defaults_filled():
    cfg = load_config(ROOT / "examples/digits_mlp.yaml")
    assert cfg.name == "digits-mlp"
    assert cfg.data.batch_size == 32 and cfg.optimizer.momentum == 0.9
    assert cfg.train.compression == "none" and cfg.horovod.cycle_time_ms == 1.0
    assert cfg.model.layers[1] == {"type": "dropout", "rate": 0.1}


def test_unknown_key_names_file_line_and_path(tmp_path):
    p = write(tmp_path, BASE + "train:\n  epocs: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).startswith(f"{p}:9: train.epocs: unknown key; expected one of epochs,")


def test_wrong_type(tmp_path):
    p = write(tmp_path, BASE.replace("dataset: sklearn:digits", "dataset: sklearn:digits\n  batch_size: big"))
    with pytest.raises(ConfigError, match=r"exp.yaml:4: data.batch_size: expected an integer, got a string 'big'"):
        load_config(p)


def test_bool_is_not_an_int(tmp_path):
    p = write(tmp_path, BASE + "seed: true\n")
    with pytest.raises(ConfigError, match=r":8: seed: expected an integer, got a boolean True"):
        load_config(p)


def test_choice_error_lists_choices(tmp_path):
    p = write(tmp_path, BASE + "optimizer: {name: lamb}\n")
    with pytest.raises(ConfigError, match=r":8: optimizer.name: expected one of sgd, adam, adamw, rmsprop; got 'lamb'"):
        load_config(p)


def test_missing_required(tmp_path):
    p = write(tmp_path, "data: {dataset: sklearn:iris}\nmodel: {input_shape: [4], layers: [{type: dense, units: 2}]}\n")
    with pytest.raises(ConfigError, match="missing required key 'name'"):
        load_config(p)


def test_missing_data_names_both_ways_in(tmp_path):
    p = write(tmp_path, "name: t\nmodel: {input_shape: [4], layers: [{type: dense, units: 2}]}\n")
    with pytest.raises(ConfigError, match=r"exp.yaml: data: expected data.dataset or data.entrypoint"):
        load_config(p)


def test_yaml_syntax_error_has_line(tmp_path):
    p = write(tmp_path, BASE + "train: {epochs: [1, 2\n")
    with pytest.raises(ConfigError, match=r"exp.yaml:\d+: invalid YAML"):
        load_config(p)


def test_duplicate_key(tmp_path):
    p = write(tmp_path, BASE + "seed: 1\nseed: 2\n")
    with pytest.raises(ConfigError, match=r":9: duplicate key 'seed'"):
        load_config(p)


def test_yaml_tags_are_not_constructed(tmp_path):
    p = write(tmp_path, BASE + "seed: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(p)


def test_missing_file():
    with pytest.raises(ConfigError, match="nope.yaml: cannot read config"):
        load_config("nope.yaml")


def test_overrides_apply_and_are_located(tmp_path):
    p = write(tmp_path, BASE)
    cfg = load_config(p, ["train.epochs=3", "model.layers.0.units=12", "optimizer.betas=[0.8, 0.9]"])
    assert cfg.train.epochs == 3 and cfg.model.layers[0]["units"] == 12 and cfg.optimizer.betas == [0.8, 0.9]
    with pytest.raises(ConfigError, match=r"\(--set train.epochs\): train.epochs: expected an integer"):
        load_config(p, ["train.epochs=many"])


@pytest.mark.parametrize("bad", ["noequals", "=3", "a..b=1", "a.$x=1"])
def test_bad_override_syntax(bad):
    with pytest.raises(ConfigError, match="expected key.path=value"):
        parse_override(bad)


def test_unknown_top_level_key(tmp_path):
    p = write(tmp_path, BASE + "x: {dataset: sklearn:digits}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).startswith(f"{p}:8: x: unknown key; expected one of name, data, model, backend,")


def test_cross_field_checks(tmp_path):
    # The data section itself (not an appended renamed copy) as a flow mapping: the range check
    # runs on it and points at its line; both ends of 0 <= value < 1.
    flow = BASE.replace("data:\n  dataset: sklearn:digits\n", "data: {dataset: sklearn:digits, validation_split: 1.5}\n")
    assert flow != BASE and flow.count("data:") == 1  # replaced, not appended
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, flow))
    assert str(e.value) == f"{tmp_path / 'exp.yaml'}:2: data.validation_split: expected 0 <= value < 1, got 1.5"
    with pytest.raises(ConfigError, match=r":2: data.validation_split: expected 0 <= value < 1, got 1.0"):
        load_config(write(tmp_path, flow.replace("1.5", "1.0")))
    assert load_config(write(tmp_path, flow.replace("1.5", "0.0"))).data.validation_split == 0.0
    p = write(tmp_path, BASE.replace("sklearn:digits", "sklearn:digits\n  validation_split: 1.5"))
    with pytest.raises(ConfigError, match=r":4: data.validation_split: expected 0 <= value < 1"):
        load_config(p)
    assert load_config(write(tmp_path, BASE + "loss: mse\n")).metrics == ["mse", "mae"]
    p = write(tmp_path, BASE + "loss: mse\nmetrics: [accuracy]\n")
    with pytest.raises(ConfigError, match=r"metrics\[0\]: accuracy needs a classification loss"):
        load_config(p)


# Scientific notation (issue 8): PyYAML resolves YAML 1.1, where a float needs a dot, so `lr: 3e-4`
# was the string '3e-4' and rejected ("expected a number, got a string '3e-4'").


@pytest.mark.parametrize("text,value", [("3e-4", 3e-4), ("1E5", 1e5), ("-2.5e+3", -2500.0), ("1.5e3", 1500.0),
                                        (".5", 0.5), ("-.5", -0.5), ("+1e-2", 0.01), ("1.", 1.0)])
def test_yaml_12_floats_are_numbers_in_files_and_set(tmp_path, text, value):
    assert parse_override(f"optimizer.weight_decay={text}")[1] == value
    if value < 0:  # a number, refused by weight_decay's range (a string would be a type error)
        with pytest.raises(ConfigError, match=rf":8: optimizer.weight_decay: expected .* >= 0, got {value}$"):
            load_config(write(tmp_path, BASE + f"optimizer: {{weight_decay: {text}}}\n"))
        return
    cfg = load_config(write(tmp_path, BASE + f"optimizer: {{weight_decay: {text}}}\n"))
    assert cfg.optimizer.weight_decay == value and isinstance(cfg.optimizer.weight_decay, float)
    assert load_config(write(tmp_path, BASE), [f"optimizer.weight_decay={text}"]).optimizer.weight_decay == value


def test_learning_rate_in_scientific_notation(tmp_path):
    assert load_config(write(tmp_path, BASE + "optimizer: {lr: 3e-4}\n")).optimizer.lr == 3e-4
    assert load_config(write(tmp_path, BASE), ["optimizer.lr=3e-4"]).optimizer.lr == 3e-4


def test_infinity_nan_and_integers_keep_their_yaml_meaning():
    import math

    assert parse_override("a=.inf")[1] == math.inf and parse_override("a=-.Inf")[1] == -math.inf
    assert math.isnan(parse_override("a=.NaN")[1])
    assert parse_override("a=10")[1] == 10 and isinstance(parse_override("a=10")[1], int)
    assert parse_override("a=0x1f")[1] == 31 and parse_override("a=1_000.5")[1] == 1000.5


@pytest.mark.parametrize("text", ["1e", "1.2.3", "e5", "1e3.5", "1e+", "3e-4x", "v1e3"])
def test_number_like_strings_stay_strings(tmp_path, text):
    assert load_config(write(tmp_path, BASE.replace("name: t", f"name: {text}"))).name == text
    assert parse_override(f"name={text}")[1] == text


def test_scientific_notation_for_an_integer_is_a_located_type_error(tmp_path):
    p = write(tmp_path, BASE + "train: {epochs: 1e3}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == f"{p}:8: train.epochs: expected an integer, got a number 1000.0"
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, BASE), ["train.epochs=1e3"])
    assert str(e.value) == f"{p} (--set train.epochs): train.epochs: expected an integer, got a number 1000.0"


def test_scientific_notation_reaches_cross_field_checks_with_its_location(tmp_path):
    p = write(tmp_path, BASE + "optimizer:\n  name: adam\n  lr: -3e-4\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == f"{p}:10: optimizer.lr: expected a finite lr > 0, got -0.0003"


def test_a_section_created_by_set_is_located_at_the_set(tmp_path):
    # `--set trian.epochs=3` creates the mapping `trian`; its error named the file but no place
    p = write(tmp_path, BASE)
    with pytest.raises(ConfigError) as e:
        load_config(p, ["trian.epochs=3"])
    assert str(e.value).startswith(f"{p} (--set trian): trian: unknown key; expected one of name, data,")
    with pytest.raises(ConfigError) as e:
        load_config(p, ["seed.x=1"])
    assert str(e.value) == f"{p} (--set seed): seed: expected an integer, got a mapping {{'x': 1}}"
