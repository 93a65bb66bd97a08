from pathlib import Path

import pytest

from hvtrain.config import load_config, parse_override
from hvtrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


BASE = """\
name: t
data:
  dataset: sklearn:digits
model:
  input_shape: [64]
  layers:
    - {type: dense, units: 10}
"""


def test_examples_load_with_defaults_filled():
    cfg = load_config(ROOT / "examples/digits_mlp.yaml")
    assert cfg.name == "digits-mlp"
    assert cfg.data.batch_size == 32 and cfg.optimizer.momentum == 0.9
    assert cfg.train.compression == "none" and cfg.horovod.cycle_time_ms == 5.0
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
    p = write(tmp_path, "name: t\nmodel: {input_shape: [4], layers: [{type: dense, units: 2}]}\n")
    with pytest.raises(ConfigError, match="missing required key 'data'"):
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


def test_cross_field_checks(tmp_path):
    p = write(tmp_path, BASE + "data: {dataset: sklearn:digits, validation_split: 1.5}\n".replace("data", "x"))
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(p)
    p = write(tmp_path, BASE.replace("sklearn:digits", "sklearn:digits\n  validation_split: 1.5"))
    with pytest.raises(ConfigError, match=r":4: data.validation_split: expected 0 <= value < 1"):
        load_config(p)
    assert load_config(write(tmp_path, BASE + "loss: mse\n")).metrics == ["mse", "mae"]
    p = write(tmp_path, BASE + "loss: mse\nmetrics: [accuracy]\n")
    with pytest.raises(ConfigError, match=r"metrics\[0\]: accuracy needs a classification loss"):
        load_config(p)
