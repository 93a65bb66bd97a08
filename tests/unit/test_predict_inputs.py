"""`hvtrain predict` without a framework: the inputs record, readers, rounds, outputs and every
input error (one line, exit 2, before any framework is imported)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hvtrain.errors import DataError
from hvtrain.io import checkpoints as checkpoint
from hvtrain.io.reporter import NpyWriter, Reporter
from hvtrain.model.weights import describe_inputs, inputs_from, read_weights, require_inputs
from hvtrain.runtime.experiment import prepare
from hvtrain.tools.predict import ArrayRows, Collected, CsvRows, Model, NpyRows, convert, rounds, run
from tests.support.configs import NO_FRAMEWORK, write_config, write_weights

ROOT = Path(__file__).resolve().parents[2]
# ----------------------------------------------------------------------------- the inputs record


@pytest.mark.parametrize("normalize,shape", [("standard", "[64]"), ("minmax", "[8, 8, 1]"), ("none", "[64]")])
def test_inputs_record_rebuilds_the_training_transform_bitwise(tmp_path, normalize, shape):
    p = prepare(str(write_config(tmp_path, normalize=normalize, shape=shape)))
    record = json.loads(json.dumps(describe_inputs(p.cfg, p.data)))  # as stored: JSON text
    inputs = inputs_from(record, "here")
    raw = p.data.val.source.features(p.data.val.rows)
    assert inputs.features == (64,) and inputs.outputs == 10 and inputs.classes.tolist() == list(range(10))
    assert np.array_equal(inputs.transform(raw), p.data.x_val)  # what training fed the model, bit for bit
    assert (inputs.transform.shift is None) == (normalize == "none")


def test_string_labels_travel_as_the_classes(tmp_path):
    x, y = np.random.default_rng(0).standard_normal((40, 3)), np.array(["cat", "dog", "eel", "dog"] * 10)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    p = prepare(str(write_config(tmp_path, dataset=f"npz:{tmp_path}/d.npz", shape="[3]", units=3)))
    inputs = inputs_from(describe_inputs(p.cfg, p.data), "here")
    assert inputs.classes.tolist() == ["cat", "dog", "eel"]
    labels = convert("labels", "cross_entropy", np.array([[0, 5, 1], [9, 0, 0.0]]), inputs.classes)
    assert labels.tolist() == ["dog", "cat"]



def test_a_forecasters_targets_shift_and_scale_travel_and_predictions_come_back_in_series_units(tmp_path):
    """A windowed series trains on (y - shift) / scale; predict gave those normalised values (the
    record had no target statistics), a sunspot forecast of ~0.3 instead of ~70."""
    cfg = tmp_path / "s.yaml"
    cfg.write_text("name: s\ndata: {dataset: 'statsmodels:sunspots', window: 8, normalize: standard}\nloss: mse\n"
                   "model: {input_shape: [8], layers: [{type: dense, units: 1}]}\n")
    p = prepare(str(cfg))
    record = json.loads(json.dumps(describe_inputs(p.cfg, p.data)))
    inputs = inputs_from(record, "here")
    shift, scale = p.data.series["shift"], p.data.series["scale"]
    assert inputs.target == (shift, scale) and 40 < shift < 60 and 30 < scale < 50
    normalised = p.data.y_val[:5]
    got = convert("probabilities", "mse", normalised, inputs.classes, inputs.target)
    raw = p.data.val.source.features(p.data.val.rows[:5])  # inputs in sunspot units; y follows x by one year
    assert np.allclose(got[:-1, 0], raw[1:, -1], atol=1e-3) and got.dtype == np.float32
    assert np.array_equal(convert("logits", "mse", normalised, None, inputs.target), got)
    np.savez(tmp_path / "r.npz", x=np.ones((20, 3)), y=np.arange(20.0))
    plain = prepare(str(write_config(tmp_path, dataset=f"npz:{tmp_path}/r.npz", loss="mse", shape="[3]", units=1)))
    assert inputs_from(describe_inputs(plain.cfg, plain.data), "here").target is None  # raw targets: nothing to undo
    with pytest.raises(DataError, match=r"target: expected finite shift and a positive scale"):
        inputs_from({**record, "target": {"shift": 1.0, "scale": 0.0}}, "w.st")

def test_inputs_record_errors_name_the_file():
    with pytest.raises(DataError, match=r"^w.st: unreadable 'inputs' metadata .*version 1, got 7"):
        inputs_from({"version": 7}, "w.st")
    with pytest.raises(DataError, match=r"^w.st: unreadable 'inputs' metadata .*statistics of 2 values"):
        inputs_from({"version": 1, "features": [3], "dtype": "float32", "normalize": "standard",
                     "shift": "AAAAAAAAAAA=", "scale": "AAAAAAAAAAA=", "input_shape": None, "loss": "mse",
                     "outputs": 1, "classes": None}, "w.st")


def test_checkpoint_weights_and_inputs_are_read_like_final_weights(tmp_path):
    cfg = write_config(tmp_path)
    final = read_weights(write_weights(tmp_path, cfg))
    p = prepare(str(cfg))
    tensors = {"shard.model.model.0": np.ones(3, np.float32), **{f"weights.{k}": v for k, v in final.weights.items()}}
    path = checkpoint.save(tmp_path, tensors, {"step": 4, "epoch": 1, "run_id": "0123abcd",
                                               "inputs": describe_inputs(p.cfg, p.data)}, keep=1)
    got = read_weights(path)
    assert got.kind == "checkpoint" and sorted(got.weights) == sorted(final.weights)
    assert all(np.array_equal(got.weights[k], final.weights[k]) for k in final.weights)
    assert np.array_equal(got.inputs.transform.shift, final.inputs.transform.shift)
    old = checkpoint.save(tmp_path, {"shard.model.model.0": np.ones(3, np.float32)},
                          {"step": 5, "epoch": 1, "run_id": "0123abcd"}, keep=2)
    with pytest.raises(DataError, match="holds no copy of the model's weights"):
        read_weights(old)


def test_old_weights_without_the_record_are_named(tmp_path):
    wf = read_weights(write_weights(tmp_path, write_config(tmp_path), inputs=False))
    with pytest.raises(DataError, match=r"final.safetensors: no 'inputs' metadata \(the normalisation statistics"):
        require_inputs(wf)


# ----------------------------------------------------------------------------- readers and rounds


def test_csv_rows_header_blank_lines_and_streamed_ranges(tmp_path):
    x = np.random.default_rng(1).standard_normal((23, 4))
    body = "\n".join(",".join(repr(float(v)) for v in row) + ("\n" if i == 5 else "") for i, row in enumerate(x))
    (tmp_path / "h.csv").write_text("a,b,c,d\n" + body + "\n")
    (tmp_path / "n.csv").write_text("\n0,1,2,3\n" + body)  # pandas' header of integer names, after a blank line
    for name in ("h.csv", "n.csv"):
        rows = CsvRows(tmp_path / name, 4)
        assert len(rows) == 23
        got = np.concatenate([rows.read(lo, min(lo + 5, 23)) for lo in range(0, 23, 5)])
        assert np.array_equal(got, x)  # repr round-trips float64 exactly
        assert np.array_equal(rows.read(2, 4), x[2:4])  # going back restarts the stream
        assert np.array_equal(rows.read(20, 23), x[20:])  # skipping ahead
        rows.close()


@pytest.mark.parametrize("text,message", [
    ("a,b\n1,2\n\n3,x\n", r"bad.csv:4: column 2: expected a number, got 'x'"),
    ("0,1\n3,4,5\n", r"bad.csv:2: expected 2 values \(the model's features\), got 3"),
    ("a,b\n1,b\n", r"bad.csv:2: column 2: expected a number, got 'b'"),
    ("a,b,c\n1,2\n", r"bad.csv:1: expected a header line of 2 column names \(the model's features; the first line "
                     r"is always the header, as in training's CSV\), got 3 fields"),
    ("a,b\n\n", r"bad.csv: expected a header line and at least one row of numbers, got no rows"),
])
def test_csv_errors_are_located(tmp_path, text, message):
    (tmp_path / "bad.csv").write_text(text)
    with pytest.raises(DataError, match=message):
        CsvRows(tmp_path / "bad.csv", 2)


@pytest.mark.parametrize("n,size,batch", [(1, 1, 4), (10, 2, 3), (11, 3, 4), (12, 2, 6), (5, 4, 1), (100, 3, 7)])
def test_rounds_give_every_row_once_in_order_within_the_batch(n, size, batch):
    seen = []
    for blocks in rounds(n, size, batch):
        assert len(blocks) == size and blocks[0][1] > blocks[0][0]  # rank 0 always has rows
        for lo, hi in blocks:
            assert 0 <= hi - lo <= batch
            seen.extend(range(lo, hi))
    assert seen == list(range(n))


def test_npy_rows_read_only_the_asked_rows(tmp_path):
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    np.save(tmp_path / "x.npy", x)
    rows = NpyRows(tmp_path / "x.npy")
    assert len(rows) == 10 and rows.shape == (4,) and np.array_equal(rows.read(3, 7), x[3:7])
    mm = ArrayRows(np.load(tmp_path / "x.npy", mmap_mode="r"))
    assert np.array_equal(mm.read(8, 10), x[8:])


def test_npy_writer_streams_blocks_into_a_standard_file_atomically(tmp_path):
    out = tmp_path / "sub/p.npy"
    out.parent.mkdir()
    w = NpyWriter(out, 5, (2,), np.dtype(np.float32))
    w.write(np.ones((3, 2)))
    assert not out.exists()  # nothing at the final path until it is complete
    w.write(np.zeros((2, 2)))
    w.commit()
    assert np.array_equal(np.load(out), np.array([[1, 1]] * 3 + [[0, 0]] * 2, np.float32))
    w = NpyWriter(tmp_path / "q.npy", 5, (2,), np.dtype(np.float32))
    w.write(np.ones((1, 2)))
    w.discard()
    assert [p.name for p in tmp_path.iterdir()] == ["sub"] and [p.name for p in out.parent.iterdir()] == ["p.npy"]


def test_npy_files_of_a_failed_predict_leave_no_temporary_files(tmp_path):
    """Defect: predict's writers were made under `if is_main` outside the Reporter, and a failure
    while making the second left the first's `.NAME.PID.tmp`; a killed predict's temporary file
    stayed for good. The Reporter's npy_files removes its own on any exception and, when it
    opens a file, those of a dead process."""
    from hvtrain.launch.process import ProcessInfo

    dead = tmp_path / ".p.npy.999999999.tmp"  # above any pid_max: no such process
    dead.write_bytes(b"half a file")
    rep = Reporter(ProcessInfo(0, 1), tmp_path, keep_metrics=True)
    files = {"scores": (tmp_path / "p.npy", 4, (2,), np.dtype(np.float32)),
             "labels": (tmp_path / "missing/l.npy", 4, (), np.dtype(np.int64))}  # cannot be opened
    with pytest.raises(FileNotFoundError), rep.npy_files(files):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="mid-run"), rep.npy_files({"scores": files["scores"]}) as sinks:
        sinks["scores"].write(np.ones((2, 2)))
        raise RuntimeError("mid-run")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    with rep.npy_files({"scores": files["scores"]}) as sinks:
        sinks["scores"].write(np.ones((4, 2)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.npy"]
    with Reporter(ProcessInfo(1, 2), tmp_path).npy_files(files) as sinks:  # rank 1 writes nothing
        assert sinks is None


def test_convert_probabilities_logits_and_labels():
    z = np.array([[1.0, 3.0, -2.0], [800.0, 0.0, 0.0]], np.float32)  # a large logit must not overflow
    p = convert("probabilities", "cross_entropy", z, None)
    assert p.dtype == np.float32 and np.allclose(p.sum(axis=1), 1) and np.array_equal(p.argmax(1), [1, 0])
    assert np.allclose(p[0], np.exp(z[0]) / np.exp(z[0]).sum())
    assert np.array_equal(convert("logits", "cross_entropy", z, None), z)
    assert convert("labels", "cross_entropy", z, np.array([7, 8, 9])).tolist() == [8, 7]
    b = np.array([[0.0], [-1000.0], [2.0]], np.float32)
    assert np.allclose(convert("probabilities", "binary_cross_entropy", b, None)[:, 0], [0.5, 0, 1 / (1 + np.exp(-2))])
    assert convert("labels", "binary_cross_entropy", b, np.array(["no", "yes"])).tolist() == ["no", "no", "yes"]
    assert np.array_equal(convert("probabilities", "mse", z, None), z)  # regression: the outputs


# ----------------------------------------------------------------------------- CLI errors

def predict_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    blocker = tmp_path / "blocker"
    blocker.mkdir(exist_ok=True)
    for name in ("torch", "tensorflow", "horovod", "keras"):
        (blocker / f"{name}.py").write_text(NO_FRAMEWORK)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{blocker}:{ROOT}"}
    return subprocess.run([sys.executable, "-m", "hvtrain", "predict", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case,expect", [
    ("features_npy", "x65.npy: rows of shape [65] (65 values), but the model in final.safetensors was trained on "
                     "rows of shape [64] (64 values)"),
    ("features_csv", "x.csv:3: expected 64 values (the model's features), got 63"),
    ("header_csv", "x.csv:1: expected a header line of 64 column names (the model's features"),
    ("bad_csv", "x.csv:2: column 5: expected a number, got 'oops'"),
    ("shape", "final.safetensors: weight 'layers.1.kernel' has shape [64, 8], the config's model needs [64, 16]"),
    ("old_weights", "old.safetensors: no 'inputs' metadata (the normalisation statistics fitted on the training "
                    "split, the raw feature shape and the class labels)"),
    ("missing_weights", "nothere.safetensors: weights file not found"),
    ("output_suffix", "p.csv: expected a .npy output path, got .csv"),
    ("overwrite_input", "x.npy: the output would overwrite the input"),
    ("labels_regression", "predict: labels need a classification loss, the model was trained with 'mse'"),
    ("input_suffix", "x.txt: expected a .npy or .csv file of feature rows, got .txt"),
    # defect: these failed with a traceback after the framework had started
    ("output_dir_missing", "nodir/p.npy: the output directory nodir does not exist"),
    ("output_dir_file", "x.npy/p.npy: the output directory x.npy is not a directory"),
    ("output_is_dir", "d.npy: expected a .npy file path, got a directory"),
])
def test_predict_input_errors_are_one_line_exit_2_before_any_framework(tmp_path, case, expect):
    cfg = write_config(tmp_path)
    write_weights(tmp_path, cfg)
    write_weights(tmp_path, cfg, "old.safetensors", inputs=False)
    x = np.random.default_rng(0).integers(0, 16, (6, 64)).astype(np.float64)
    np.save(tmp_path / "x.npy", x)
    args = ["cfg.yaml", "--weights", "final.safetensors", "--input", "x.npy", "--output", "p.npy"]
    if case == "features_npy":
        np.save(tmp_path / "x65.npy", np.zeros((3, 65)))
        args[4] = "x65.npy"
    elif case in ("features_csv", "bad_csv"):
        lines = [",".join(f"p{j}" for j in range(64))] + [",".join(str(v) for v in row) for row in x]
        lines[1 if case == "bad_csv" else 2] = ",".join(["1"] * 4 + ["oops"] + ["1"] * 59) if case == "bad_csv" \
            else ",".join(["1"] * 63)
        (tmp_path / "x.csv").write_text("\n".join(lines) + "\n")
        args[4] = "x.csv"
    elif case == "header_csv":  # no header: the first row of numbers is read as one, and is 2 values short
        (tmp_path / "x.csv").write_text("1,2\n" + "\n".join(",".join(str(v) for v in row) for row in x) + "\n")
        args[4] = "x.csv"
    elif case == "shape":
        args += ["--set", "model.layers.1.units=16"]
    elif case == "old_weights":
        args[2] = "old.safetensors"
    elif case == "missing_weights":
        args[2] = "nothere.safetensors"
    elif case == "output_suffix":
        args[6] = "p.csv"
    elif case == "overwrite_input":
        args[6] = "x.npy"
    elif case == "labels_regression":
        reg = write_config(tmp_path, "reg.yaml", dataset="synthetic:regression", loss="mse", shape="[20]", units=1)
        write_weights(tmp_path, reg, "reg.safetensors")
        np.save(tmp_path / "x20.npy", np.zeros((3, 20)))
        args = ["reg.yaml", "--weights", "reg.safetensors", "--input", "x20.npy", "--output", "p.npy",
                "--labels", "l.npy"]
    elif case == "input_suffix":
        args[4] = "x.txt"
    elif case == "output_dir_missing":
        args[6] = "nodir/p.npy"
    elif case == "output_dir_file":
        args[6] = "x.npy/p.npy"
    elif case == "output_is_dir":
        (tmp_path / "d.npy").mkdir()
        args[6] = "d.npy"
    proc = predict_cli(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hvtrain: error: {expect}"), proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "p.npy").exists()


def test_csv_numeric_header_is_a_header_as_in_training(tmp_path):
    """Defect: predict guessed the header by content ("no field is a number"), so pandas'
    `to_csv(index=False)` header of integer column names (`0,1,2`) became a data row and every
    output row was shifted by one. The first line is the header, as training's csv: reads it."""
    (tmp_path / "x.csv").write_text("0,1,2\n0.5,1.5,2.5\n3.0,4.0,5.0\n")
    rows = CsvRows(tmp_path / "x.csv", 3)
    assert len(rows) == 2 and rows.read(0, 2).tolist() == [[0.5, 1.5, 2.5], [3.0, 4.0, 5.0]]
    rows.close()
    (tmp_path / "train.csv").write_text("0,1,label\n0.5,1.5,0\n3.0,4.0,1\n")
    from hvtrain.config.load import load_config
    from hvtrain.data.dataset import load_dataset

    cfg = load_config({"name": "t", "data": {"dataset": f"csv:{tmp_path / 'train.csv'}", "validation_split": 0.5},
                       "model": {"input_shape": [2], "layers": [{"type": "dense", "units": 2}]}})
    data = load_dataset(cfg, (2,), False)
    assert len(data.train) + len(data.val) == 2  # training read the same line as its header


def test_a_csv_without_a_header_line_is_refused_not_a_row_short(tmp_path):
    """np.savetxt writes no header: predict took the first sample as the header and wrote N-1 rows,
    every one a row off from the user's data, exit 0."""
    np.savetxt(tmp_path / "x.csv", np.array([[0.5, 1.5, 2.5], [3.0, 4.0, 5.0]]), delimiter=",")
    with pytest.raises(DataError, match=r"x.csv:1: the first line is the header \(column names\), but it holds "
                                        r"numbers \(5.000000000000000000e-01, "):
        CsvRows(tmp_path / "x.csv", 3)


# ----------------------------------------------------------------------------- the rounds, without Horovod


class _Recording(ArrayRows):
    def __init__(self, x):
        super().__init__(x)
        self.reads = []

    def read(self, lo, hi):
        self.reads.append((lo, hi))
        return super().read(lo, hi)


class _Runtime:
    """One rank of `size`: gather_bytes returns every rank's part on rank 0 (the others' faked)."""

    def __init__(self, rank, size, others):
        from hvtrain.launch.process import ProcessInfo

        self.info, self.others = ProcessInfo(rank, size), others

    def allgather_object(self, obj):
        return [obj] * self.info.size

    def gather_bytes(self, blob):
        return [blob] + [self.others.pop(0) for _ in range(self.info.size - 1)] if self.info.rank == 0 else None


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_reads_only_its_blocks_and_rank_0_writes_in_input_order(tmp_path, rank):
    from types import SimpleNamespace

    cfg_path = write_config(tmp_path, normalize="none")
    wf = read_weights(write_weights(tmp_path, cfg_path))
    m = Model(prepare(str(cfg_path)).cfg, None, wf.weights, wf.inputs, "w")
    x = np.arange(23 * 64, dtype=np.float64).reshape(23, 64)
    rows = _Recording(x)
    # the model: the first feature of each row as a 10-wide output, so the order can be checked
    backend = SimpleNamespace(predict=lambda b: np.repeat(b[:, :1], 10, axis=1).astype(np.float32))
    rank1 = [x[k * 10 + 5: k * 10 + 10, :1].repeat(10, axis=1).astype(np.float32).tobytes() for k in range(3)]
    out = {"logits": Collected()} if rank == 0 else None
    run(m, rows, out, 5, SimpleNamespace(runtime=_Runtime(rank, 2, rank1), backend=backend))
    assert rows.reads == ([(0, 5), (10, 15), (20, 23)] if rank == 0 else [(5, 10), (15, 20)])
    if rank == 0:
        assert np.array_equal(out["logits"].result()[:, 0], x[:, 0])  # rows in input order


def test_a_forecaster_saved_before_its_target_statistics_travelled_warns_once_on_rank_0(tmp_path, capsys):
    """Weights of a windowed forecaster without the `target` record (written before it existed)
    predict normalised values: rank 0 says so and how to undo it; a newer file says nothing."""
    from dataclasses import replace
    from types import SimpleNamespace

    cfg = tmp_path / "s.yaml"
    cfg.write_text("name: s\ndata: {dataset: 'statsmodels:sunspots', window: 8, normalize: standard}\nloss: mse\n"
                   "model: {input_shape: [8], layers: [{type: dense, units: 1}]}\n")
    p = prepare(str(cfg))
    inputs = inputs_from(describe_inputs(p.cfg, p.data), "here")
    backend = SimpleNamespace(predict=lambda b: b[:, :1].astype(np.float32))
    for rank, record, warned in ((0, replace(inputs, target=None), True), (1, replace(inputs, target=None), False),
                                 (0, inputs, False)):
        m = Model(p.cfg, None, {}, record, "old.safetensors")
        out = {"probabilities": Collected()} if rank == 0 else None
        others = [np.zeros((0, 1), np.float32).tobytes()]
        run(m, ArrayRows(np.ones((3, 8), np.float32)), out, 5,
            SimpleNamespace(runtime=_Runtime(rank, 2, others), backend=backend))
        err = capsys.readouterr().err
        assert ("old.safetensors was written before a forecaster's target normalisation" in err) == warned, err
        if warned:
            assert err.startswith("hvtrain: warning: rank 0 of 2: ") and "series.scale" in err
