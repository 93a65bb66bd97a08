"""Real multi-process runs: horovodrun (MPI and Gloo controllers) and mpirun, 2 ranks.

Each test asserts on what the ranks computed (weights, metrics files), not on exit codes alone.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import hvtrain, load_weights, max_abs_diff, run
from tests.support.launch import BACKENDS, horovodrun, mpirun

EQUIV = "tests/configs/equiv_mlp.yaml"


# Each launcher once, each backend once (launchers are backend-neutral; the math is the backend's):
# 1409 training samples = 22 x 64 + 1, so in the last step rank 1 has no sample of its own and joins
# every allreduce with a zero-weight one (it must not hang, and the result must stay exact).
LAUNCHERS = {"torch": ("horovodrun", "gloo"), "tensorflow": ("horovodrun", "mpirun")}
TAIL = ["--set", "data.validation_split=0.2159"]


@pytest.fixture(scope="module", params=BACKENDS)
def equiv_runs(request, tmp_path_factory):
    """One epoch of the equivalence config: 1 rank x 64, and 2 ranks x 32 under two launchers."""
    backend = request.param
    base = tmp_path_factory.mktemp(f"equiv-{backend}")
    common = ["--backend", backend, "--quiet", *TAIL]
    argv = {"np1_b64": hvtrain("train", EQUIV, "--set", "data.batch_size=64", "--output-dir", str(base / "np1_b64"),
                               *common),
            "horovodrun": horovodrun(2, "train", EQUIV, "--output-dir", str(base / "horovodrun"), *common),
            "gloo": horovodrun(2, "train", EQUIV, "--output-dir", str(base / "gloo"), *common, gloo=True),
            "mpirun": mpirun(2, "train", EQUIV, "--output-dir", str(base / "mpirun"), *common),
            "hooks": horovodrun(2, "train", EQUIV, "--output-dir", str(base / "hooks"), *common,
                                "--set", "horovod.reduction=hooks")}
    out = {}
    for name in ("np1_b64", *LAUNCHERS[backend], "hooks"):
        run(argv[name], timeout=180)
        out[name] = {"weights": load_weights(base / name / "final.safetensors"),
                     "summary": json.loads((base / name / "summary.json").read_text()),
                     "manifest": json.loads((base / name / "manifest.json").read_text())}
    return backend, out


def test_two_ranks_equal_one_rank_with_double_batch_through_an_empty_tail_share(equiv_runs):
    backend, r = equiv_runs
    assert r["horovodrun"]["summary"]["world_size"] == 2 and r["np1_b64"]["summary"]["world_size"] == 1
    assert r["horovodrun"]["summary"]["val_samples"] == 1797 - 1409
    diff = max_abs_diff(r["horovodrun"]["weights"], r["np1_b64"]["weights"])
    assert diff <= 1e-5, f"{backend}: np=2 x 32 vs np=1 x 64 differ by {diff}"
    # and training really moved the weights (the comparison is not vacuous)
    from hvtrain.config.load import load_config
    from hvtrain.model.spec import build_spec
    init = build_spec(load_config(EQUIV)).init_weights(7)
    assert max_abs_diff(init, r["np1_b64"]["weights"]) > 1e-2


def test_launchers_give_the_same_weights(equiv_runs):
    backend, r = equiv_runs
    other = LAUNCHERS[backend][1]
    assert r["horovodrun"]["summary"]["controller"] == "mpi"
    assert r[other]["summary"]["controller"] == ("gloo" if other == "gloo" else "mpi")
    diff = max_abs_diff(r["horovodrun"]["weights"], r[other]["weights"])
    assert diff <= 1e-6, f"{backend}: horovodrun vs {other} differ by {diff}"
    # validation metrics are reduced globally: every launcher reports the same numbers
    assert r[other]["summary"]["val_accuracy"] == pytest.approx(r["horovodrun"]["summary"]["val_accuracy"])


def test_the_direct_reduction_equals_horovods_path_and_idles_horovod(equiv_runs):
    """On CPUs the gradients are summed on hvtrain's own MPI communicator (horovod.reduction: auto ->
    direct; Horovod idles at direct_cycle_ms); Horovod's own path (hooks) reaches the same weights."""
    backend, r = equiv_runs
    cycle = {name: r[name]["manifest"]["horovod_env"]["HOROVOD_CYCLE_TIME"] for name in ("horovodrun", "hooks")}
    assert cycle == {"horovodrun": "200", "hooks": "1"}, cycle
    diff = max_abs_diff(r["horovodrun"]["weights"], r["hooks"]["weights"])
    assert diff <= 1e-6, f"{backend}: direct vs Horovod's path differ by {diff}"
    assert r["hooks"]["summary"]["replicas_agree"] and r["horovodrun"]["summary"]["replicas_agree"]


@pytest.mark.parametrize(("backend", "example"), [("torch", "digits_mlp"), ("tensorflow", "digits_cnn")])
def test_examples_reach_accuracy_on_two_ranks_rank0_output_only(tmp_path, backend, example):
    out = tmp_path / "run"
    proc = run(hvtrain("launch", "-np", "2", "--hostfile", "hostfiles/localhost", "--", "train",
                       f"examples/{example}.yaml", "--backend", backend, "--output-dir", str(out)))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == backend
    assert summary["val_accuracy"] >= 0.95, summary
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(1, summary["epochs"] + 1))  # written once, by rank 0
    assert {"train_loss", "val_loss", "val_accuracy", "samples_per_sec", "world_size"} <= set(records[0])
    assert proc.stdout.count("epoch 1/") == 1  # printed once, by rank 0
    assert sorted(p.name for p in out.iterdir()) == ["final.safetensors", "manifest.json", "metrics.jsonl", "summary.json",
                                                     "tensorboard"]
    assert len(list((out / "tensorboard").iterdir())) == 1  # one event file: rank 0's


@pytest.mark.parametrize(("backend", "precision"), [("torch", "fp16"), ("tensorflow", "bf16")])
def test_options_fp16_compression_accumulation_scale_lr_low_precision(tmp_path, backend, precision):
    """Every training option at once on 2 ranks, and it still learns: fp16 gradient compression,
    accumulation, the lr scaled by the world size after warmup, and bf16 / fp16 (loss scaling; each
    precision of each backend also trains in tests/backends and in the pipeline tests)."""
    out = tmp_path / precision
    run(horovodrun(2, "train", "examples/digits_mlp.yaml", "--backend", backend, "--output-dir", str(out),
                   "--quiet", "--set", "train.compression=fp16", "--set", "train.grad_accumulation=2",
                   "--set", f"train.precision={precision}", "--set", "optimizer.scale_lr=true",
                   "--set", "optimizer.warmup_epochs=1", "--set", "train.epochs=6"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["lr"] == pytest.approx(0.1)  # 0.05 x 2 ranks once warmed up
    assert records[-1]["val_accuracy"] >= 0.9, (precision, records[-1])


def test_bad_config_under_launcher_fails_fast_one_line_per_rank(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndata: {dataset: sklearn:digits}\nmodel:\n  input_shape: [64]\n  layers:\n"
                   "    - {type: dense, unitz: 10}\n")
    proc = run(horovodrun(2, "train", str(bad)), check=False, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "hvtrain: error:" in line]
    # every rank that got to speak names itself (the launcher may end one before it prints)
    assert 1 <= len(errors) <= 2, proc.stdout + proc.stderr
    for line in errors:
        assert re.search(r"hvtrain: error: rank [01] of 2: .*bad.yaml:6: model.layers\[0\].unitz: unknown option "
                         r"for dense", line), line
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_batchnorm_model_on_two_ranks_agrees_on_trainable_weights(tmp_path, backend):
    """Batchnorm statistics are per replica (each rank's own batches): the run must still finish,
    with the trainable weights equal on both ranks and rank 0's statistics in the file."""
    out = tmp_path / "run"
    run(mpirun(2, "train", "tests/configs/bn_mlp.yaml", "--backend", backend, "--quiet", "--set", "train.epochs=3",
               "--output-dir", str(out)))
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2 and s["replicas_agree"] is True and s["val_accuracy"] > 0.9, s
    assert "layers.1.moving_mean" in load_weights(out / "final.safetensors")
