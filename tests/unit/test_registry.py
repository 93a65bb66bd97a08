"""The backend registry (hvtrain.backends.registry.BACKENDS) is the one list of backends: config validation,
every CLI `--backend` and `hvtrain doctor` follow it, so adding a backend there is enough."""

import subprocess
import sys
import typing

import pytest
from click.testing import CliRunner

from hvtrain.backends.registry import BACKENDS
from hvtrain.cli import cli
from hvtrain.config import load as config
from hvtrain.errors import ConfigError
from hvtrain.tools import doctor


def test_config_accepts_exactly_the_registered_backends():
    assert typing.get_args(typing.get_type_hints(config.Config)["backend"]) == tuple(BACKENDS)


REGISTER_ONE_MORE = """
import typing
import hvtrain.backends.registry
hvtrain.backends.registry.BACKENDS["jax"] = "hvtrain.backends.jax.backend:JaxBackend"
from hvtrain.cli import cli
from hvtrain.config.schema import Config
assert typing.get_args(typing.get_type_hints(Config)["backend"])[-1] == "jax"
for command in ("train", "evaluate", "doctor"):
    option = next(o for o in cli.commands[command].params if o.name == "backend")
    assert "jax" in option.type.choices, (command, option.type.choices)
"""


def test_a_backend_added_to_the_registry_reaches_config_and_cli():
    proc = subprocess.run([sys.executable, "-c", REGISTER_ONE_MORE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_an_unregistered_backend_is_a_located_config_error(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: x\nbackend: jax\ndata: {dataset: sklearn:digits}\n"
                 "model: {input_shape: [64], layers: [{type: dense, units: 10}]}\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: backend: expected one of torch, tensorflow; got 'jax'"):
        config.load_config(p)


@pytest.mark.parametrize("command", ["train", "evaluate", "doctor"])
def test_cli_backend_choices_are_the_registry(command):
    option = next(o for o in cli.commands[command].params if o.name == "backend")
    assert list(option.type.choices) == list(BACKENDS)
    r = CliRunner().invoke(cli, [command, "--backend", "nosuch"])
    assert r.exit_code == 2 and "Invalid value for '--backend': 'nosuch' is not one of 'torch', 'tensorflow'" \
        in r.output, r.output


def test_doctor_covers_exactly_the_registered_backends():
    assert list(doctor.FRAMEWORKS) == list(BACKENDS)
