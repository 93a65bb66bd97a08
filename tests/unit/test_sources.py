"""Sources, statistics, prefetch (issue 10): the pieces behind npy:, shards: and data entrypoints."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import hvtrain.data.dataset as data_mod
from hvtrain.config.load import load_config
from hvtrain.data.batches import Batch
from hvtrain.data.dataset import Split, Transform, _statistics, load_dataset
from hvtrain.data.loader import Prefetcher
from hvtrain.data.sources import ArraySource, NpyArray, NpyPair, ObjectSource, open_npy_dir
from hvtrain.errors import ConfigError, DataError
from hvtrain.io.checkpoints import config_differences


def arrays(n=300, f=7, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, f)) * 4 + 3).astype(np.float32), rng.integers(0, 3, n)


def cfg_for(tmp_path: Path, dataset: str, **data) -> object:
    extra = "".join(f", {k}: {v}" for k, v in data.items())
    p = tmp_path / "exp.yaml"
    p.write_text(f"name: t\ndata: {{dataset: '{dataset}'{extra}}}\n"
                 "model: {input_shape: [7], layers: [{type: dense, units: 3}]}\n")
    return load_config(p)


@pytest.mark.parametrize("compressed", [False, True])
def test_npz_members_read_like_np_load(tmp_path, compressed):
    x, y = arrays()
    (np.savez_compressed if compressed else np.savez)(tmp_path / "a.npz", x=x, y=y)
    member = NpyArray(tmp_path / "a.npz", "x.npy")
    assert member.compressed == compressed and len(member) == 300
    idx = np.array([5, 0, 299, 5])
    assert np.array_equal(member.rows(idx), x[idx])
    assert np.array_equal(NpyArray(tmp_path / "a.npz", "y.npy").whole(), y)


def test_statistics_are_chunk_independent_and_equal_numpy(tmp_path, monkeypatch):
    x, y = arrays(n=1000)
    rows = np.random.default_rng(1).permutation(1000)[200:]
    whole = _statistics("standard", ArraySource(x, y, "mem"), rows)
    monkeypatch.setattr(data_mod, "STATS_CHUNK_VALUES", 7 * 33)  # 33-row chunks: many merges
    chunked = _statistics("standard", ArraySource(x, y, "mem"), rows)
    ref = x[rows].astype(np.float64)
    assert np.allclose(chunked[0], ref.mean(0), rtol=1e-6) and np.allclose(chunked[1], ref.std(0), rtol=1e-5)
    assert np.allclose(whole[0], chunked[0], rtol=1e-6)
    lo, span = _statistics("minmax", ArraySource(x, y, "mem"), rows)
    assert np.array_equal(lo, x[rows].min(0)) and np.allclose(span, x[rows].max(0) - x[rows].min(0))


def test_npy_statistics_are_cached_and_keyed_by_the_files(tmp_path, monkeypatch):
    x, y = arrays()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    cfg = cfg_for(tmp_path, f"npy:{tmp_path}")
    first = load_dataset(cfg)
    assert len(list(tmp_path.glob(".hvtrain-norm-*.npy"))) == 1

    def no_reads(self, idx):
        raise AssertionError("features read although the statistics are cached")

    with monkeypatch.context() as m:
        m.setattr(NpyPair, "features", no_reads)
        again = load_dataset(cfg)
    assert np.array_equal(first.train.transform.shift, again.train.transform.shift)
    np.save(tmp_path / "x.npy", x * 2)  # new data: new size/mtime, new key
    changed = load_dataset(cfg)
    assert np.allclose(changed.train.transform.shift, 2 * first.train.transform.shift, rtol=1e-5)
    assert len(list(tmp_path.glob(".hvtrain-norm-*.npy"))) == 2


def test_npy_source_equals_arrays_bit_for_bit(tmp_path):
    x, y = arrays()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    mem, mapped = load_dataset(cfg_for(tmp_path, f"npz:{tmp_path}/a.npz")), load_dataset(cfg_for(tmp_path, f"npy:{tmp_path}"))
    for a, b in [(mem.x_train, mapped.x_train), (mem.x_val, mapped.x_val), (mem.y_train, mapped.y_train)]:
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert mem.fingerprint() == mapped.fingerprint()


def test_validation_files_are_the_validation_split(tmp_path):
    x, y = arrays()
    for name, arr in [("x", x[:250]), ("y", y[:250]), ("x_val", x[250:]), ("y_val", y[250:])]:
        np.save(tmp_path / f"{name}.npy", arr)
    d = load_dataset(cfg_for(tmp_path, f"npy:{tmp_path}"))
    assert len(d.train) == 250 and len(d.val) == 50 and np.array_equal(d.y_val, y[250:])
    (tmp_path / "y_val.npy").unlink()
    with pytest.raises(DataError, match="only one of x_val.npy and y_val.npy"):
        open_npy_dir(tmp_path)


def test_random_row_reads_keep_resident_memory_flat(tmp_path):
    """Defect this guards against: reading random rows through a memory map left up to a large folio
    (2 MB) resident per row touched (measured: +124 MB for 100 random 4 KB rows), so a rank's RSS
    grew toward the file's size. Rows are read with pread now."""
    rows, width = 16384, 1024  # 64 MiB of float32, 4 KiB rows
    x = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=(rows, width))
    x[:] = np.arange(rows, dtype=np.float32)[:, None]
    x.flush()
    del x
    arr = NpyArray(tmp_path / "x.npy")
    rng = np.random.default_rng(0)
    before = _rss_mb()
    for _ in range(40):
        idx = rng.integers(0, rows, 128)
        got = arr.rows(idx)
        assert np.array_equal(got[:, 0], idx.astype(np.float32)) and np.array_equal(got[:, -1], got[:, 0])
    assert _rss_mb() - before < 16, "random rows left pages resident"


def test_many_shards_never_exhaust_file_descriptors(tmp_path):
    """Defect: one descriptor (and map) per shard stayed open: 300 shards under `ulimit -n 256`
    raised a raw OSError (Too many open files) with a traceback."""
    import subprocess
    import sys

    for k in range(300):
        np.savez(tmp_path / f"s{k:03d}.npz", x=np.full((2, 3), k, np.float32), y=np.array([k % 2, 1]))
    code = (
        "import resource, sys, numpy as np\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
        "from hvtrain.data.sources import open_shards\n"
        f"s = open_shards({str(tmp_path / '*.npz')!r}, None)\n"
        "assert len(s) == 600 and s.labels().sum() == 450\n"
        "rows = s.features(np.arange(599, -1, -7))\n"
        "assert np.array_equal(rows[:, 0], np.arange(599, -1, -7) // 2)\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_one_feature_stored_one_dimensional(tmp_path):
    x, y = arrays(n=60, f=1)
    np.save(tmp_path / "x.npy", x[:, 0])
    np.save(tmp_path / "y.npy", y)
    p = tmp_path / "exp.yaml"
    p.write_text(f"name: t\ndata: {{dataset: 'npy:{tmp_path}'}}\n"
                 "model: {input_shape: [1], layers: [{type: dense, units: 3}]}\n")
    d = load_dataset(load_config(p))
    assert d.feature_shape == (1,) and d.x_train.shape == (48, 1)


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _split(n=50) -> Split:
    x, y = arrays(n)
    return Split(ArraySource(x, y, "mem"), np.arange(n), y, Transform(np.float32))


def test_prefetch_yields_what_a_plain_loop_reads():
    split = _split()
    batches = [Batch(np.arange(i, i + 5), np.full(5, 0.1, np.float32), True) for i in range(0, 50, 5)]
    got = list(Prefetcher(split, batches, depth=3))
    plain = list(Prefetcher(split, batches, depth=0))
    assert len(got) == len(plain) == 10
    for (b1, x1, y1), (b2, x2, y2) in zip(got, plain, strict=True):
        assert b1 is b2 and np.array_equal(x1, x2) and np.array_equal(y1, y2)
    only_y = list(Prefetcher(split, batches, depth=2, want_x=False))
    assert all(x is None for _, x, _ in only_y)


def test_prefetch_raises_the_loader_error_at_its_batch_and_stops_its_thread():
    class Flaky(ArraySource):
        def features(self, idx):
            if idx[0] >= 20:
                raise DataError("disk gone")
            return super().features(idx)

    x, y = arrays(50)
    split = Split(Flaky(x, y, "flaky"), np.arange(50), y, Transform(np.float32))
    batches = [Batch(np.arange(i, i + 5), np.full(5, 0.1, np.float32), True) for i in range(0, 50, 5)]
    seen = []
    with pytest.raises(DataError, match="disk gone"):
        with Prefetcher(split, batches, depth=2) as loader:
            for batch, _, _ in loader:
                seen.append(int(batch.indices[0]))
    assert seen == [0, 5, 10, 15]
    assert not [t for t in threading.enumerate() if t.name == "hvtrain-prefetch"]


def test_prefetch_stopped_early_ends_its_thread_and_loads_nothing_after():
    """Defect: after close() the thread kept loading batches, and could still be reading the source
    when evaluation (the main thread) read it next."""
    loads = []

    class Counting(ArraySource):
        def features(self, idx):
            loads.append(int(idx[0]))
            return super().features(idx)

    x, y = arrays(500)
    split = Split(Counting(x, y, "c"), np.arange(500), y, Transform(np.float32))
    batches = (Batch(np.arange(i, i + 5), np.full(5, 0.1, np.float32), True) for i in range(0, 500, 5))
    with Prefetcher(split, batches, depth=2) as loader:
        for k, _ in enumerate(loader):
            if k == 3:
                break
    assert not [t for t in threading.enumerate() if t.name == "hvtrain-prefetch"]
    settled = len(loads)
    assert settled <= 4 + 2 + 1, loads  # consumed + queue depth + the one in hand
    assert len(loads) == settled


def test_random_access_object_labels_method_spares_the_label_pass():
    calls = []

    class WithLabels:
        def __len__(self):
            return 1000

        def labels(self):
            return np.arange(1000) % 3

        def get(self, idx):
            calls.append(len(idx))
            return np.ones((len(idx), 4)), np.asarray(idx) % 3

    src = ObjectSource(WithLabels(), "obj")
    assert src.feature_shape == (4,) and np.array_equal(src.labels(), np.arange(1000) % 3)
    assert sum(calls) <= 2, "features were read for the labels"


def test_mappings_are_not_random_access_objects(tmp_path):
    cfg = cfg_for(tmp_path, "sklearn:iris")
    from hvtrain.data.dataset import _from_user

    with pytest.raises(ConfigError, match="expected \\(x, y\\) arrays or an object"):
        _from_user({"x": 1, "y": 2}, "data=", cfg, "data")
    assert len(_from_user([np.zeros((4, 2)), np.zeros(4)], "data=", cfg, "data")) == 4


def test_random_access_object_errors_name_the_object():
    class Bad:
        def __len__(self):
            return 10

        def get(self, idx):
            return np.zeros((len(idx) - 1, 2)), np.zeros(len(idx))

    with pytest.raises(DataError, match=r"data.entrypoint m:f: get\(\) of 10 indices returned 9 x rows"):
        ObjectSource(Bad(), "data.entrypoint m:f")


@pytest.mark.parametrize("text, match", [
    ("data: {dataset: sklearn:iris, prefetch: -1}", "data.prefetch: expected an integer >= 0"),
    ("data: {dataset: sklearn:iris, kwargs: {a: 1}}", "data.kwargs: only used with data.entrypoint"),
    ("data: {dataset: sklearn:iris, entrypoint: 'a.b:c'}", "data.entrypoint: give either data.dataset or"),
    ("data: {entrypoint: 'not an entrypoint'}", "data.entrypoint: expected 'package.module:function'"),
    ("data: {dataset: sklearn:iris}\ntrain: {max_steps: -2}", "train.max_steps: expected an integer >= 0"),
])
def test_data_config_errors_are_located(tmp_path, text, match):
    p = tmp_path / "exp.yaml"
    p.write_text(f"name: t\n{text}\nmodel: {{input_shape: [4], layers: [{{type: dense, units: 3}}]}}\n")
    with pytest.raises(ConfigError, match=match):
        load_config(p)


def test_resume_check_ignores_prefetch_and_keys_newer_than_the_checkpoint(tmp_path):
    old = {"data": {"dataset": "sklearn:iris", "batch_size": 32, "prefetch": 2}, "seed": 0}
    new = {"data": {"dataset": "sklearn:iris", "batch_size": 32, "prefetch": 0, "entrypoint": None}, "seed": 0}
    assert config_differences(old, new) == []
    changed = {**new, "data": {**new["data"], "entrypoint": "a.b:c"}}
    assert config_differences(old, changed) == ["data.entrypoint: checkpoint '<unset>', this run 'a.b:c'"]


def test_dict_configs_and_errors_from_python(tmp_path):
    cfg = load_config({"name": "d", "data": {"dataset": "sklearn:iris"},
                       "model": {"input_shape": [4], "layers": [{"type": "dense", "units": 3}]}},
                      ["train.epochs=2"])
    assert cfg.train.epochs == 2 and cfg.source == "<dict>"
    with pytest.raises(ConfigError, match=r"^<dict>: data.batch_size: expected an integer"):
        load_config({"name": "d", "data": {"dataset": "sklearn:iris", "batch_size": "x"},
                     "model": {"input_shape": [4], "layers": [{"type": "dense", "units": 3}]}})
