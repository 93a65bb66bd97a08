"""Property-based: any input gives a valid result or a clean hvtrain error with a location."""

import os
import string
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvtrain import checkpoint
from hvtrain.config import load_config, parse_override
from hvtrain.errors import ConfigError, HostfileError, HvtrainError
from hvtrain.launch.builders import LaunchRequest, build_mpirun
from hvtrain.launch.hostfile import parse_hostfile, parse_hosts

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SAFE_HOST = set(string.ascii_letters + string.digits + "-_.")

hostfile_text = st.one_of(
    st.binary(max_size=300).map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.lists(st.sampled_from(["node1 slots=4", "node2:2", "n3", "# c", "", "  ", "x slots=", "a:b:c", "h max_slots=2",
                              "$(rm -rf /) slots=1", "h;ls:2", "-oProxy=x", "h slots=2 max_slots=1", "h\tslots=3"]),
             max_size=8).map("\n".join),
)


@SETTINGS
@given(hostfile_text)
def test_hostfile_parser_total(tmp_path, text):
    p = tmp_path / "hosts"
    p.write_bytes(text.encode("utf-8", "surrogateescape"))
    try:
        hosts = parse_hostfile(p)
    except HostfileError as exc:
        assert str(exc).startswith(str(p))  # located: file or file:line
        return
    assert hosts and all(h.slots >= 1 and set(h.host) <= SAFE_HOST and h.host[0].isalnum() for h in hosts)
    argv, _ = build_mpirun(LaunchRequest(1, ("cmd",), hosts), "openmpi", {})
    assert all(not a.startswith("-") or a in {"-np", "-H", "--bind-to", "--map-by"} for a in argv[1:6:2])


@SETTINGS
@given(st.text(max_size=60))
def test_host_list_parser_total(spec):
    try:
        hosts = parse_hosts(spec)
    except HostfileError as exc:
        assert str(exc).startswith(f"-H {spec}")
        return
    assert all(set(h.host) <= SAFE_HOST for h in hosts)


config_text = st.one_of(
    st.binary(max_size=400).map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.lists(st.sampled_from([
        "name: x", "data: {dataset: sklearn:digits}", "model: {input_shape: [64], layers: [{type: dense, units: 10}]}",
        "train: {epochs: -1}", "train: {epochs: 2.5}", "seed: [1]", "optimizer: {name: sgd, lr: 0}",
        "loss: mse", "metrics: [accuracy]", "parallel: {pipeline: {stages: 0}}", "backend: jax", "- a", "{",
        "name: !!python/object/apply:os.system [ls]", "data: 3", "model: {entrypoint: 'os:system'}", "&a [*a]",
        "output_dir: null", "horovod: {cycle_time_ms: x}", "data: {dataset: 'csv:/nonexistent'}",
    ]), max_size=8).map("\n".join),
)


@SETTINGS
@given(config_text)
def test_config_loader_total(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_bytes(text.encode("utf-8", "surrogateescape"))
    try:
        cfg = load_config(p)
    except ConfigError as exc:
        assert str(exc).startswith(str(p)), str(exc)
        return
    assert cfg.name and cfg.data.dataset


@SETTINGS
@given(st.text(max_size=60))
def test_override_parser_total(text):
    try:
        parts, _ = parse_override(text)
    except ConfigError as exc:
        assert str(exc).startswith(f"--set {text!r}")
        return
    assert parts and all(isinstance(p, int) or p for p in parts)


@SETTINGS
@given(st.lists(st.text(max_size=30), max_size=4))
def test_overrides_applied_to_a_config_total(tmp_path, overrides):
    p = tmp_path / "c.yaml"
    p.write_text("name: x\ndata: {dataset: sklearn:digits}\nmodel: {input_shape: [64], layers: [{type: dense, units: 10}]}\n")
    try:
        load_config(p, overrides)
    except ConfigError:
        pass


@SETTINGS
@given(st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_any_single_byte_flip_or_truncation_is_caught(tmp_path, position, bit):
    state = {"model.w": np.arange(12, dtype=np.float32).reshape(3, 4), "optim.meta": np.arange(5, dtype=np.uint8)}
    path = checkpoint.save(tmp_path, state, {"step": 1, "epoch": 0}, keep=1)
    blob = bytearray(path.read_bytes())
    if bit == 0:
        blob = blob[: position % len(blob)]
    else:
        blob[position % len(blob)] ^= bit
    path.write_bytes(bytes(blob))
    try:
        loaded = checkpoint.load(path)
    except checkpoint.CheckpointError:
        return
    # a flip that leaves the content valid must leave it identical (e.g. header whitespace)
    assert all(np.array_equal(loaded.tensors[k], v) for k, v in state.items())


def test_a_failed_write_never_replaces_the_previous_checkpoint(tmp_path, monkeypatch):
    good = checkpoint.save(tmp_path, {"w": np.ones(3, np.float32)}, {"step": 5, "epoch": 1}, keep=3)
    before = good.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, {"w": np.zeros(3, np.float32)}, {"step": 5, "epoch": 1}, keep=3)
    assert good.read_bytes() == before
    assert [p.name for p in Path(tmp_path).iterdir()] == [good.name]  # no temp file left behind
    with pytest.raises(HvtrainError, match="refusing to checkpoint non-finite values in 'w' at step 6"):
        checkpoint.save(tmp_path, {"w": np.array([np.nan], np.float32)}, {"step": 6, "epoch": 1}, keep=3)
