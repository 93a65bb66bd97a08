"""Bring your own data (issue 10): memory-mapped npy:DIR, shards:GLOB, data entrypoints, the
Python API, prefetch failures and train.max_steps, in real single- and multi-rank runs.

Every way in reads the same generated arrays (tests.fixtures.user_data.generated), so each run
must give the in-memory run's weights exactly: the split, statistics and batches are computed by
the same code whatever the source.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hvtrain.io.checkpoints import list_checkpoints, step_of
from tests.conftest import hvtrain, load_weights, max_abs_diff, run, tool
from tests.fixtures.user_data import generated
from tests.support.launch import mpirun_command

CFG = "tests/configs/user_data.yaml"
FILE = ["--set", "data.entrypoint=null", "--quiet"]


def write_sources(root: Path) -> dict[str, str]:
    """The generated arrays as an .npz, an npy:DIR and two shard layouts (uneven shards, one of a
    single row; stored and compressed .npz members; .npy pairs)."""
    x, y = generated()
    np.savez(root / "all.npz", x=x, y=y)
    (root / "npy").mkdir()
    np.save(root / "npy/x.npy", x)
    np.save(root / "npy/y.npy", y)
    (root / "npz_shards").mkdir()
    (root / "npy_shards").mkdir()
    cuts = [0, 100, 333, 334, 700]
    for k in range(4):
        a, b = cuts[k], cuts[k + 1]
        save = np.savez_compressed if k % 2 else np.savez
        save(root / f"npz_shards/part-{k}.npz", x=x[a:b], y=y[a:b])
        np.save(root / f"npy_shards/x_{k:03d}.npy", x[a:b])
        np.save(root / f"npy_shards/y_{k:03d}.npy", y[a:b])
    return {"npz": f"npz:{root}/all.npz", "npy": f"npy:{root}/npy",
            "npz_shards": f"shards:{root}/npz_shards/*.npz", "npy_shards": f"shards:{root}/npy_shards/*.npy"}


def data_files(root: Path) -> dict[str, tuple[str, int]]:
    """Content hash and mtime of every data file (not the statistics cache hvtrain may add)."""
    return {str(p): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(".hvtrain-")}


def summary(d: Path) -> dict:
    return json.loads((d / "summary.json").read_text())


def test_npy_and_shards_equal_the_in_memory_run(tmp_path):
    """Every file kind trains to the in-memory run's weights on 2 ranks (each rank reads its own
    rows; one rank reads them all by the same code, tests/unit/test_sources.py)."""
    ranks = 2
    data = tmp_path / "data"
    data.mkdir()
    sources = write_sources(data)
    before = data_files(data)
    out = {}
    for name, dataset in sources.items():
        out[name] = tmp_path / name
        argv = hvtrain("train", CFG, *FILE, "--set", f"data.dataset={dataset}", "--output-dir", str(out[name]))
        run(mpirun_command(2, *argv) if ranks == 2 else argv, timeout=300)
    ref = load_weights(out["npz"] / "final.safetensors")
    for name in ("npy", "npz_shards", "npy_shards"):
        gap = max_abs_diff(ref, load_weights(out[name] / "final.safetensors"))
        assert gap <= 1e-6, f"{name} on {ranks} rank(s) differs from the in-memory run by {gap}"
        s = summary(out[name])
        assert s["val_accuracy"] == summary(out["npz"])["val_accuracy"] and s["world_size"] == ranks
    assert summary(out["npz"])["val_accuracy"] > 0.8
    assert data_files(data) == before, "training wrote to a data file"
    # statistics were cached beside the file data (one pass), keyed by the files
    assert len(list((data / "npy").glob(".hvtrain-norm-*.npy"))) == 1


def test_data_entrypoints_arrays_and_random_access_train_on_two_ranks(tmp_path):
    arrays, access, ref = tmp_path / "arrays", tmp_path / "access", tmp_path / "ref"
    x, y = generated()
    np.savez(tmp_path / "all.npz", x=x, y=y)
    run(mpirun_command(2, *hvtrain("train", CFG, "--quiet", "--output-dir", str(arrays))), timeout=300)
    run(mpirun_command(2, *hvtrain("train", CFG, "--quiet", "--set", "data.entrypoint=tests.fixtures.user_data:random_access",
                           "--output-dir", str(access))), timeout=300)
    run(mpirun_command(2, *hvtrain("train", CFG, *FILE, "--set", f"data.dataset=npz:{tmp_path}/all.npz",
                           "--output-dir", str(ref))), timeout=300)
    weights = load_weights(ref / "final.safetensors")
    for d in (arrays, access):
        s = summary(d)
        assert s["world_size"] == 2 and s["val_accuracy"] > 0.8 and s["replicas_agree"]
        assert max_abs_diff(weights, load_weights(d / "final.safetensors")) <= 1e-6
        assert s["peak_rss_mb"]["max"] >= s["peak_rss_mb"]["rank0"] > 50
        assert s["data_wait_seconds"]["max"] >= 0


def test_loader_error_on_rank_1_ends_the_job_naming_rank_and_entrypoint(tmp_path):
    """A user loader that fails on rank 1 after the label pass (inside the prefetch thread): the job
    must end quickly with that rank's message, not hang in the next allreduce."""
    t = time.monotonic()
    proc = run(mpirun_command(2, *hvtrain("train", CFG, "--quiet", "--set", "train.epochs=50",
                                  "--set", "data.entrypoint=tests.fixtures.user_data:random_access",
                                  "--set", "data.kwargs={fail_rank: 1, fail_after: 30}",
                                  "--output-dir", str(tmp_path))), timeout=120, check=False)
    took = time.monotonic() - t
    assert proc.returncode != 0 and took < 60, (proc.returncode, took)
    err = proc.stderr
    assert "rank 1 of 2" in err and "data.entrypoint tests.fixtures.user_data:random_access" in err, err[-3000:]
    assert "storage node unreachable" in err and "Traceback" not in err, err[-3000:]
    assert not (tmp_path / "final.safetensors").exists()


def test_max_steps_stops_where_it_says_and_resumes_exactly(tmp_path):
    """On 2 ranks with accumulation 2 (the one-rank, unaccumulated cases and more: max_steps in
    tests/unit/test_loop.py on simulated worlds)."""
    ranks, accumulation = 2, 2
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["--quiet", "--set", "train.checkpoint_every=5", "--set", "train.checkpoint_unit=step",
              "--set", f"train.grad_accumulation={accumulation}"]

    def train(*args: str) -> None:
        argv = hvtrain("train", CFG, *common, *args)
        run(mpirun_command(2, *argv) if ranks == 2 else argv, timeout=300)

    train("--output-dir", str(full))
    per_epoch = summary(full)["steps"] // 6  # 560 training samples: 18 steps (1 rank), 5 (2 ranks x 2)
    limit = per_epoch + 2  # inside epoch 2
    train("--set", f"train.max_steps={limit}", "--output-dir", str(part))
    s = summary(part)
    assert s["steps"] == limit and s["stopped_at_max_steps"] and not summary(full)["stopped_at_max_steps"]
    assert max(step_of(p) for p in list_checkpoints(part)) == limit, "a checkpoint at the stop"
    lines = [json.loads(ln) for ln in (part / "metrics.jsonl").read_text().splitlines()]
    assert [ln["epoch"] for ln in lines] == [1, 2] and lines[-1]["partial"] and "partial" not in lines[0]
    train("--resume", "auto", "--output-dir", str(part))
    assert summary(part)["steps"] == summary(full)["steps"] == 6 * per_epoch
    assert max_abs_diff(load_weights(full / "final.safetensors"), load_weights(part / "final.safetensors")) == 0
    lines = [json.loads(ln) for ln in (part / "metrics.jsonl").read_text().splitlines()]
    assert [ln["epoch"] for ln in lines] == [1, 2, 3, 4, 5, 6] and not any(ln.get("partial") for ln in lines)


API_SCRIPT = """
import json, os, sys
sys.path.insert(0, os.getcwd())  # the repository (tests.fixtures); the script itself lives elsewhere
import numpy as np
import hvtrain
from tests.fixtures.user_data import generated

out = sys.argv[1]
summary = hvtrain.train("tests/configs/user_data.yaml", output_dir=out + "/api", overrides=["train.epochs=2"],
                        quiet=True)
# the same experiment from a dict, with arrays and a native model handed over from Python
x, y = generated()
def model():
    from torch import nn
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 3))
cfg = {"name": "api", "seed": 5, "data": {"batch_size": 32}, "optimizer": {"name": "adam", "lr": 0.01},
       "train": {"epochs": 6}}
native = hvtrain.train(cfg, model=model, data=(x, y), output_dir=out + "/native", quiet=True)
preds = hvtrain.predict(cfg, out + "/native/final.safetensors", x, model=model, data=(x, y))
ev = hvtrain.evaluate(cfg, out + "/native/final.safetensors", model=model, data=(x, y), output_dir=out + "/native")
errors = {}
for name, call in [("no data", lambda: hvtrain.train({"name": "x", "model": {"input_shape": [12],
                                                                               "layers": [{"type": "dense", "units": 3}]}})),
                   ("bad key", lambda: hvtrain.train({**cfg, "trian": {}}, model=model, data=(x, y))),
                   ("bad data", lambda: hvtrain.train(cfg, model=model, data=(x, y[:5])))]:
    try:
        call()
        errors[name] = None
    except hvtrain.HvtrainError as exc:
        errors[name] = [type(exc).__name__, str(exc)]
rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
with open(f"{out}/result-{rank}.json", "w") as fh:
    json.dump({"summary": summary, "native": native, "eval": ev, "errors": errors,
                            "pred_shape": list(preds.shape), "pred_argmax": preds.argmax(1).tolist(), "y": y.tolist()}, fh)
"""


def test_python_api_under_horovodrun_equals_the_cli(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(API_SCRIPT)
    cli = tmp_path / "cli"
    run([tool("horovodrun"), "-np", "2", *hvtrain("train", CFG, "--quiet", "--set", "train.epochs=2",
                                                   "--output-dir", str(cli))], timeout=300)
    run([tool("horovodrun"), "-np", "2", sys.executable, str(script), str(tmp_path)], timeout=400)
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]  # every rank returns
    r = results[0]
    assert max_abs_diff(load_weights(cli / "final.safetensors"), load_weights(tmp_path / "api/final.safetensors")) == 0
    assert r["summary"]["world_size"] == 2 and r["summary"]["val_accuracy"] == summary(cli)["val_accuracy"]
    assert results[1]["summary"]["val_accuracy"] == r["summary"]["val_accuracy"]
    # a native model and arrays from Python train, evaluate and predict on 2 ranks
    assert r["native"]["val_accuracy"] > 0.8 and r["native"]["world_size"] == 2
    assert r["pred_shape"] == [700, 3] and results[1]["pred_argmax"] == r["pred_argmax"]
    accuracy = np.mean(np.array(r["pred_argmax"]) == np.array(r["y"]))
    assert accuracy > 0.8 and r["eval"]["val_accuracy"] == r["native"]["val_accuracy"]
    e = r["errors"]
    assert e["no data"][0] == "ConfigError" and "expected data.dataset or data.entrypoint" in e["no data"][1]
    assert e["bad key"][0] == "ConfigError" and "<dict>: trian: unknown key" in e["bad key"][1]
    assert e["bad data"][0] == "DataError" and "700 samples but y has 5" in e["bad data"][1]


@pytest.mark.parametrize("case, expect", [
    ("missing_y", "its label file"),
    ("truncated", "truncated"),
    ("garbage", "not a valid .npy array"),
    ("features", "features [5] float32 differ"),
    ("nothing", "no shard files match"),
])
def test_bad_shards_are_located_errors_before_training(tmp_path, case, expect):
    d = tmp_path / "shards"
    d.mkdir()
    x, y = generated(n=40)
    for k in range(2):
        np.save(d / f"x_{k}.npy", x[k * 20:(k + 1) * 20])
        np.save(d / f"y_{k}.npy", y[k * 20:(k + 1) * 20])
    bad = d / "x_1.npy"
    if case == "missing_y":
        (d / "y_1.npy").unlink()
    elif case == "truncated":
        bad.write_bytes(bad.read_bytes()[:-7])
    elif case == "garbage":
        bad.write_bytes(b"not numpy at all" * 10)
    elif case == "features":
        np.save(bad, x[20:40, :5])
    pattern = f"{d}/x_*.npy" if case != "nothing" else f"{d}/nothing_*.npy"
    proc = run(hvtrain("train", CFG, *FILE, "--set", f"data.dataset=shards:{pattern}",
                       "--output-dir", str(tmp_path / "out")), check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "data.dataset" in proc.stderr and expect in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    if case not in ("nothing",):
        assert str(d) in proc.stderr
    assert not (tmp_path / "out").exists(), "nothing may be written before the data is checked"


def test_an_image_folder_trains_to_the_weights_of_its_decoded_arrays_on_two_ranks(tmp_path):
    """images:DIR (issue 23): a folder of PNGs trains, on 2 ranks, to the weights of the in-memory
    run of the same pixels (each rank decodes only its own batches' files)."""
    from tests.support.data import digits_image_folder

    x, y = digits_image_folder(tmp_path / "digits", per_class=170)
    order = np.argsort(y, kind="stable")  # the folder's order: class, then file name
    np.savez(tmp_path / "digits.npz", x=x[order], y=y[order])
    args = ["train", "examples/digits_mlp.yaml", "--quiet", "--set", "train.epochs=3",
            "--set", "data.image.size=[8, 8]", "--set", "data.image.channels=1"]
    for name, dataset in (("images", f"images:{tmp_path / 'digits'}"), ("npz", f"npz:{tmp_path / 'digits.npz'}")):
        run(mpirun_command(2, *hvtrain(*args, "--set", f"data.dataset={dataset}", "--output-dir",
                                       str(tmp_path / name))), timeout=300)
    gap = max_abs_diff(load_weights(tmp_path / "npz/final.safetensors"), load_weights(tmp_path / "images/final.safetensors"))
    assert gap <= 1e-6, f"images: differs from the in-memory run of its pixels by {gap}"
    s = summary(tmp_path / "images")
    assert s["world_size"] == 2 and s["val_accuracy"] == summary(tmp_path / "npz")["val_accuracy"] > 0.8, s


def test_augmented_file_datasets_are_world_size_independent(tmp_path):
    """webdataset: with augmentation and 2 data workers per rank on 2 ranks equals 1 rank with the
    doubled batch, and parquet: and npz: of the same pixels on 2 ranks (issue 23): the draws are
    per sample, so neither the rank count nor the file kind changes what is trained on."""
    from tests.support.data import digits_parquet, digits_webdataset

    x, y = digits_webdataset(tmp_path / "wds", 600, shards=4)
    digits_parquet(tmp_path / "pq", 600, files=3, row_group=64, layout="image")
    np.savez(tmp_path / "digits.npz", x=x, y=y)
    cfg = "tests/configs/augmented_digits.yaml"
    runs = {"wds2": (2, 16, f"webdataset:{tmp_path}/wds/*.tar", ["--set", "data.workers=2"]),
            "wds1": (1, 32, f"webdataset:{tmp_path}/wds/*.tar", []),
            "pq2": (2, 16, f"parquet:{tmp_path}/pq/*.parquet", ["--set", "data.image.column=image"]),
            "npz2": (2, 16, f"npz:{tmp_path}/digits.npz", [])}
    for name, (ranks, batch, dataset, extra) in runs.items():
        argv = hvtrain("train", cfg, "--quiet", "--set", f"data.dataset={dataset}", "--set",
                       f"data.batch_size={batch}", *extra, "--output-dir", str(tmp_path / name))
        run(mpirun_command(2, *argv) if ranks == 2 else argv, timeout=300)
    ref = load_weights(tmp_path / "wds2/final.safetensors")
    for name in ("wds1", "pq2", "npz2"):
        gap = max_abs_diff(ref, load_weights(tmp_path / name / "final.safetensors"))
        assert gap <= 1e-6, f"{name} differs from webdataset on 2 ranks by {gap}"
    s = summary(tmp_path / "wds2")
    assert s["world_size"] == 2 and s["replicas_agree"] and s["val_accuracy"] > 0.5, s
