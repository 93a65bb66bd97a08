"""`--output-dir` is a path taken as written (issue 8: it went through the YAML --set parser)."""

from pathlib import Path

import pytest

from hvtrain.runtime.experiment import prepare


@pytest.mark.parametrize("given", ["runs/a #1", "null", "on", "~", "[x]", "2024-01-01"])
def test_output_dir_is_the_string_given(given, monkeypatch):
    monkeypatch.delenv("HVTRAIN_OUTPUT_DIR", raising=False)
    p = prepare("examples/digits_mlp.yaml", output_dir=given)
    assert p.cfg.output_dir == given and p.cfg.out_dir == Path(given)


def test_output_dir_from_the_environment_is_taken_as_written_too(monkeypatch):
    monkeypatch.setenv("HVTRAIN_OUTPUT_DIR", "runs/b #2")
    assert prepare("examples/digits_mlp.yaml").cfg.out_dir == Path("runs/b #2")
