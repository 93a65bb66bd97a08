"""Property-based: any input gives a valid result or a clean hvtrain error with a location."""

import os
import re
import string
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvtrain.config.load import load_config
from hvtrain.config.yaml import parse_override
from hvtrain.errors import ConfigError, HostfileError, HvtrainError
from hvtrain.io import checkpoints as checkpoint
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
    # The parsed hosts and slots are what reaches the launcher, as one argv element that cannot be
    # read as an option, and that parses back to the same records.
    listing = ",".join(f"{h.host}:{h.slots}" for h in hosts)
    argv, _ = build_mpirun(LaunchRequest(1, ("cmd",), hosts), "openmpi", {})
    assert argv[1:] == ["-np", "1", "-H", listing, "--bind-to", "none", "--map-by", "slot", "cmd"]
    assert not argv[4].startswith("-")
    assert [(h.host, h.slots) for h in parse_hosts(argv[4])] == [(h.host, h.slots) for h in hosts]
    argv, _ = build_mpirun(LaunchRequest(1, ("cmd",), hosts), "mpich", {})
    assert argv[1:] == ["-n", "1", "-hosts", listing, "cmd"]


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


override_text = st.one_of(st.text(max_size=30), st.sampled_from([
    "train.epochs=0", "train.epochs=1e3", "model.layers=[]", "model.layers.0.units=x", "model.layers.5.units=3",
    "train={foo: 1}", "name=null", "data.validation_split=1e0", "model.entrypoint=a:b", "backend=jax",
    "model.input_shape=[0]", "seed.x=1", "optimizer.lr=-1e-3", "data=3", "loss=mse", "a.b.c=1", "model.layers.x=1",
]))


@SETTINGS
@given(st.lists(override_text, max_size=4))
def test_overrides_applied_to_a_config_total(tmp_path, overrides):
    p = tmp_path / "c.yaml"
    p.write_text("name: x\ndata: {dataset: sklearn:digits}\nmodel: {input_shape: [64], layers: [{type: dense, units: 10}]}\n")
    try:
        load_config(p, overrides)
    except ConfigError as exc:
        # located: the --set item itself, a key set by --set, or a line of the file
        message = str(exc)
        assert (any(message.startswith(f"--set {o!r}: ") for o in overrides)
                or re.match(rf"{re.escape(str(p))}(:\d+| \(--set [\w.\[\]-]+\)): ", message)), message


@SETTINGS
@given(st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_any_single_byte_flip_or_truncation_is_caught(tmp_path, position, bit):
    state = {"model.w": np.arange(12, dtype=np.float32).reshape(3, 4), "optim.meta": np.arange(5, dtype=np.uint8)}
    path = checkpoint.save(tmp_path, state, {"step": 1, "epoch": 0, "run_id": "0123abcd"}, keep=1)
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
    good = checkpoint.save(tmp_path, {"w": np.ones(3, np.float32)}, {"step": 5, "epoch": 1, "run_id": "0123abcd"}, keep=3)
    before = good.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, {"w": np.zeros(3, np.float32)}, {"step": 5, "epoch": 1, "run_id": "0123abcd"}, keep=3)
    assert good.read_bytes() == before
    assert [p.name for p in Path(tmp_path).iterdir()] == [good.name]  # no temp file left behind
    with pytest.raises(HvtrainError, match="refusing to checkpoint non-finite values in 'w' at step 6"):
        checkpoint.save(tmp_path, {"w": np.array([np.nan], np.float32)}, {"step": 6, "epoch": 1, "run_id": "0123abcd"}, keep=3)
