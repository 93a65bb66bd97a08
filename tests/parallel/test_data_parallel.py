"""Real multi-process runs: horovodrun (MPI and Gloo controllers) and mpirun, 2 ranks.

Each test asserts on what the ranks computed (weights, metrics files), not on exit codes alone.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests.conftest import hvtrain, load_weights, max_abs_diff, run, tool

BACKENDS = ["torch", "tensorflow"]
EQUIV = "tests/configs/equiv_mlp.yaml"


def horovodrun(*args: str, gloo: bool = False) -> list[str]:
    return [tool("horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo" if gloo else "--mpi", *hvtrain(*args)]


def mpirun(*args: str) -> list[str]:
    return [tool("mpirun"), "-np", "2", "--bind-to", "none", "--oversubscribe", *hvtrain(*args)]


@pytest.fixture(scope="module", params=BACKENDS)
def equiv_runs(request, tmp_path_factory):
    """One epoch of the equivalence config: 1 rank x 64, and 2 ranks x 32 under each launcher."""
    backend = request.param
    base = tmp_path_factory.mktemp(f"equiv-{backend}")
    common = ["--backend", backend, "--quiet"]
    runs = {
        "np1_b64": hvtrain("train", EQUIV, "--set", "data.batch_size=64", "--output-dir", str(base / "np1"), *common),
        "np1_b32_acc2": hvtrain("train", EQUIV, "--set", "train.grad_accumulation=2", "--output-dir",
                                str(base / "acc"), *common),
        "horovodrun": horovodrun("train", EQUIV, "--output-dir", str(base / "hr"), *common),
        "gloo": horovodrun("train", EQUIV, "--output-dir", str(base / "gloo"), *common, gloo=True),
        "mpirun": mpirun("train", EQUIV, "--output-dir", str(base / "mpirun"), *common),
    }
    out = {}
    dirs = {"np1_b64": "np1", "np1_b32_acc2": "acc", "horovodrun": "hr", "gloo": "gloo", "mpirun": "mpirun"}
    for name, argv in runs.items():
        run(argv)
        d = base / dirs[name]
        out[name] = {"weights": load_weights(d / "final.safetensors"),
                     "summary": json.loads((d / "summary.json").read_text())}
    return backend, out


def test_two_ranks_equal_one_rank_with_double_batch(equiv_runs):
    backend, r = equiv_runs
    assert r["horovodrun"]["summary"]["world_size"] == 2 and r["np1_b64"]["summary"]["world_size"] == 1
    diff = max_abs_diff(r["horovodrun"]["weights"], r["np1_b64"]["weights"])
    assert diff <= 1e-5, f"{backend}: np=2 x 32 vs np=1 x 64 differ by {diff}"
    # and training really moved the weights (the comparison is not vacuous)
    from hvtrain.config.load import load_config
    from hvtrain.model.spec import build_spec
    init = build_spec(load_config(EQUIV)).init_weights(7)
    assert max_abs_diff(init, r["np1_b64"]["weights"]) > 1e-2


def test_gradient_accumulation_equals_larger_batch(equiv_runs):
    backend, r = equiv_runs
    diff = max_abs_diff(r["np1_b32_acc2"]["weights"], r["np1_b64"]["weights"])
    assert diff <= 1e-5, f"{backend}: batch 32 x 2 accumulation vs batch 64 differ by {diff}"


def test_launchers_give_the_same_weights(equiv_runs):
    backend, r = equiv_runs
    assert r["horovodrun"]["summary"]["controller"] == "mpi"
    assert r["gloo"]["summary"]["controller"] == "gloo"
    assert r["mpirun"]["summary"]["controller"] == "mpi"
    for other in ("gloo", "mpirun"):
        diff = max_abs_diff(r["horovodrun"]["weights"], r[other]["weights"])
        assert diff <= 1e-6, f"{backend}: horovodrun vs {other} differ by {diff}"
    # validation metrics are reduced globally: every launcher reports the same numbers
    assert r["gloo"]["summary"]["val_accuracy"] == pytest.approx(r["mpirun"]["summary"]["val_accuracy"])
    assert r["horovodrun"]["summary"]["val_samples"] == 359


@pytest.mark.parametrize("backend", BACKENDS)
def test_tail_with_an_empty_rank_share_never_hangs_and_stays_exact(tmp_path, backend):
    """1409 training samples = 22 x 64 + 1: in the last step rank 1 has no sample of its own."""
    split = ["--set", "data.validation_split=0.2159", "--backend", backend, "--quiet"]
    run(hvtrain("train", EQUIV, "--set", "data.batch_size=64", "--output-dir", str(tmp_path / "one"), *split))
    run(horovodrun("train", EQUIV, "--output-dir", str(tmp_path / "two"), *split), timeout=180)
    one = json.loads((tmp_path / "one/summary.json").read_text())
    assert one["val_samples"] == 1797 - 1409
    diff = max_abs_diff(load_weights(tmp_path / "one/final.safetensors"),
                        load_weights(tmp_path / "two/final.safetensors"))
    assert diff <= 1e-5, diff


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("example", ["digits_mlp", "digits_cnn"])
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


@pytest.mark.parametrize("backend,entrypoint", [("torch", "torch_mlp"), ("tensorflow", "keras_mlp")])
def test_native_entrypoint_trains_data_parallel(tmp_path, backend, entrypoint):
    out = tmp_path / "run"
    run(horovodrun("train", "tests/configs/entrypoint.yaml", "--backend", backend, "--output-dir", str(out),
                   "--set", f"model.entrypoint=tests.fixtures.native_models:{entrypoint}"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["val_accuracy"] >= 0.9, summary
    # native models are initialised per rank (seeded by rank): the initial broadcast made them equal
    assert summary["replicas_agree"] is True
    weights = load_weights(out / "final.safetensors")
    assert sum(v.size for v in weights.values()) == 64 * 48 + 48 + 48 * 10 + 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_options_fp16_compression_accumulation_scale_lr_low_precision(tmp_path, backend):
    """Every training option runs on 2 ranks and still learns (bf16 and fp16 loss scaling too)."""
    for precision in ("bf16", "fp16"):
        out = tmp_path / precision
        run(horovodrun("train", "examples/digits_mlp.yaml", "--backend", backend, "--output-dir", str(out),
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
    proc = run(horovodrun("train", str(bad)), check=False, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "hvtrain: error:" in line]
    # every rank that got to speak names itself (the launcher may end one before it prints)
    assert 1 <= len(errors) <= 2, proc.stdout + proc.stderr
    for line in errors:
        assert re.search(r"hvtrain: error: rank [01] of 2: .*bad.yaml:6: model.layers\[0\].unitz: unknown option "
                         r"for dense", line), line
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss,dataset,features,metric,target", [
    ("binary_cross_entropy", "sklearn:breast_cancer", 30, "val_accuracy", 0.9),
    ("mse", "synthetic:regression", 10, "val_mse", 0.01),
    ("mae", "synthetic:regression", 10, "val_mae", 0.1),
])
def test_every_loss_trains_end_to_end_on_two_ranks(tmp_path, backend, loss, dataset, features, metric, target):
    """binary_cross_entropy, mse and mae (a regression dataset) on 2 ranks, both frameworks."""
    cfg = tmp_path / "loss.yaml"
    cfg.write_text(f"""name: {loss}
seed: 3
data: {{dataset: "{dataset}", samples: 2000, features: {features}, batch_size: 32}}
model:
  input_shape: [{features}]
  layers: [{{type: dense, units: 32, activation: relu}}, {{type: dense, units: 1}}]
optimizer: {{name: adam, lr: 1e-2}}
loss: {loss}
train: {{epochs: 15}}
""")
    out = tmp_path / "run"
    run(mpirun("train", str(cfg), "--backend", backend, "--quiet", "--output-dir", str(out)))
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2 and s["replicas_agree"]
    if metric == "val_accuracy":
        assert s[metric] >= target, s
    else:  # regression: the error is a small fraction of the target's spread (variance for mse, std for mae)
        from hvtrain.config.load import load_config
        from hvtrain.data.dataset import load_dataset

        y = load_dataset(load_config(cfg)).y_val
        spread = float(np.var(y)) if metric == "val_mse" else float(np.std(y))
        assert s[metric] <= target * spread, (s, spread)
        assert "val_accuracy" not in s and {"val_mse", "val_mae"} <= set(s)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batchnorm_model_on_two_ranks_agrees_on_trainable_weights(tmp_path, backend):
    """Batchnorm statistics are per replica (each rank's own batches): the run must still finish,
    with the trainable weights equal on both ranks and rank 0's statistics in the file."""
    out = tmp_path / "run"
    run(mpirun("train", "tests/configs/bn_mlp.yaml", "--backend", backend, "--quiet", "--set", "train.epochs=3",
               "--output-dir", str(out)))
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2 and s["replicas_agree"] is True and s["val_accuracy"] > 0.9, s
    assert "layers.1.moving_mean" in load_weights(out / "final.safetensors")
