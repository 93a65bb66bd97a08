"""Pipeline and hybrid data x pipeline runs under real mpirun / horovodrun."""

from __future__ import annotations

import json

import pytest

from tests.conftest import hvtrain, load_weights, max_abs_diff, run, tool
from tests.support.launch import BACKENDS, mpirun

CFG = "examples/digits_pipeline.yaml"
# N plain-SGD steps. minmax: digits under `standard` has pixels that are non-zero in one or two
# samples (normalised to ~38), where a 1e-7 rounding difference of micro-batched matmuls can flip
# a ReLU and leave 4e-4 between otherwise equal runs; the comparison is about the pipeline.
PLAIN = ["--set", "train.epochs=1", "--set", "optimizer.momentum=0", "--set", "data.normalize=minmax", "--quiet"]


def summary(d) -> dict:
    return json.loads((d / "summary.json").read_text())


@pytest.fixture(scope="module", params=BACKENDS)
def runs(request, tmp_path_factory):
    backend = request.param
    base = tmp_path_factory.mktemp(f"pipe-{backend}")
    b = ["--backend", backend, *PLAIN]
    run(hvtrain("train", CFG, *b, "--set", "parallel.pipeline.stages=1", "--output-dir", str(base / "flat")))
    run(hvtrain("train", CFG, *b, "--set", "parallel.pipeline.stages=1", "--set", "data.batch_size=64",
                "--output-dir", str(base / "flat64")))
    for schedule in ("gpipe", "1f1b"):
        run(mpirun(2, "train", CFG, *b, "--set", f"parallel.pipeline.schedule={schedule}",
                   "--output-dir", str(base / schedule)), timeout=300)
    # the hybrid under one schedule per backend (gpipe and 1f1b give the same weights: the S=2 runs
    # here and tests/backends/test_stage.py); np=4 on 2 cores is the fixture's slowest run
    hybrid = "gpipe" if backend == BACKENDS[0] else "1f1b"
    run(mpirun(4, "train", CFG, *b, "--set", f"parallel.pipeline.schedule={hybrid}",
               "--output-dir", str(base / "hybrid")), timeout=300)
    return backend, base


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_equal_unpipelined_run(runs, schedule):
    backend, base = runs
    s = summary(base / schedule)
    assert s["pipeline"]["stages"] == 2 and s["pipeline"]["micro_batches"] == 4 and s["world_size"] == 2
    flat = load_weights(base / "flat/final.safetensors")
    diff = max_abs_diff(load_weights(base / schedule / "final.safetensors"), flat)
    assert diff <= 1e-5, f"{backend} {schedule}: {diff}"


def test_hybrid_two_by_two_equals_one_rank_double_batch(runs):
    backend, base = runs
    hybrid = "hybrid"
    s = summary(base / hybrid)
    assert s["world_size"] == 4 and s["pipeline"]["replicas"] == 2 and s["replicas_agree"]
    diff = max_abs_diff(load_weights(base / hybrid / "final.safetensors"), load_weights(base / "flat64/final.safetensors"))
    assert diff <= 1e-5, f"{backend} {hybrid}: {diff}"
    # validation is reduced over both replicas: all 359 samples, once
    assert s["val_samples"] == 359


def test_pipelined_weights_evaluate_on_one_process(runs, tmp_path):
    """final.safetensors of a hybrid run is the whole model: `hvtrain evaluate` of the pipeline
    config on one process (no plan needed) gives the run's own validation figures."""
    backend, base = runs
    run(hvtrain("evaluate", CFG, "--backend", backend, "--set", "data.normalize=minmax",
                "--weights", str(base / "hybrid/final.safetensors"),
                "--output-dir", str(tmp_path)))
    got = json.loads((tmp_path / "eval.json").read_text())
    s = summary(base / "hybrid")
    assert got["world_size"] == 1 and got["val_samples"] == s["val_samples"] == 359
    assert got["val_accuracy"] == s["val_accuracy"] and abs(got["val_loss"] - s["val_loss"]) < 1e-5


def test_each_rank_holds_only_its_stage(runs):
    _, base = runs
    s = summary(base / "hybrid")
    stage_params = s["pipeline"]["stage_params"]
    assert [r["params"] for r in s["pipeline"]["ranks"]] == [stage_params[0], stage_params[1]] * 2
    assert sum(stage_params) == 64 * 256 + 256 + 256 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10


def test_activation_memory_bounded_by_schedule(runs):
    backend, base = runs
    S, M = 2, 4
    gpipe = summary(base / "gpipe")["pipeline"]["ranks"]
    one = summary(base / "1f1b")["pipeline"]["ranks"]
    assert [r["peak_in_flight"] for r in gpipe] == [M, M]
    assert [r["peak_in_flight"] for r in one] == [S, S - 1]  # stage s keeps at most S - s micro-batches
    if backend == "torch":  # measured bytes saved for backward (saved-tensor hooks)
        assert one[0]["peak_activation_bytes"] * M == gpipe[0]["peak_activation_bytes"] * S


def test_hybrid_example_reaches_accuracy(tmp_path):
    out = tmp_path / "run"
    run(mpirun(4, "train", CFG, "--output-dir", str(out)), timeout=300)
    assert summary(out)["val_accuracy"] >= 0.95


@pytest.mark.parametrize("backend", BACKENDS)
def test_hybrid_with_fp16_compression_and_accumulation_learns(tmp_path, backend):
    out = tmp_path / "run"
    run(mpirun(4, "train", CFG, "--backend", backend, "--quiet", "--output-dir", str(out), "--set", "train.epochs=6",
               "--set", "train.compression=fp16", "--set", "train.grad_accumulation=2"), timeout=300)
    assert summary(out)["val_accuracy"] >= 0.9


def test_pipeline_under_gloo_is_refused(tmp_path):
    proc = run([tool("horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", *hvtrain("train", CFG)],
               check=False, timeout=120)
    assert proc.returncode != 0
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "hvtrain: error:" in ln]
    assert 1 <= len(errors) <= 2, proc.stdout + proc.stderr
    for line in errors:
        assert " of 2: " in line and "digits_pipeline.yaml:" in line
        assert "parallel.pipeline: pipeline stages exchange activations by MPI point-to-point" in line


@pytest.mark.parametrize("args,message", [
    ([], "parallel.pipeline.stages: the world size (-np 3) must be a multiple of the 2 stages"),
    (["--set", "parallel.pipeline.devices={1: 'cuda:1'}"], "device 'cuda:1' does not exist on this host"),
])
def test_bad_pipeline_input_fails_before_training(args, message):
    np_ = 3 if not args else 2
    proc = run(mpirun(np_, "train", CFG, *args), check=False, timeout=120)
    assert proc.returncode != 0
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "hvtrain: error:" in ln]
    assert 1 <= len(errors) <= np_ and all(message in e and f" of {np_}: " in e for e in errors), \
        proc.stdout + proc.stderr
    assert "epoch 1/" not in proc.stdout
