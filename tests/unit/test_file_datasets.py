"""webdataset:GLOB and parquet:GLOB (issue 23): each layout reads back exactly the arrays it was
written from, by index; what is missing or malformed is a located error before training.
And data.augment: per-sample draws keyed by (seed, epoch, sample), whatever the batch."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest

from hvtrain.config.load import load_config
from hvtrain.data.augment import Augment
from hvtrain.data.dataset import load_dataset
from hvtrain.errors import ConfigError, DataError
from tests.support.data import digits_parquet, digits_webdataset

IMAGE = "image: {size: [8, 8], channels: 1}, "


def cfg_for(tmp_path, dataset: str, data: str = "", shape: str = "[64]"):
    p = tmp_path / "c.yaml"
    p.write_text(f"name: f\nseed: 3\ndata: {{dataset: '{dataset}', normalize: none, {data}}}\n"
                 f"model: {{input_shape: {shape}, layers: [{{type: flatten}}, {{type: dense, units: 10}}]}}\n")
    return load_config(p)


def read_all(d):
    """Every row of both splits (split order) and the positions they came from."""
    both = np.concatenate([d.train.rows, d.val.rows])
    x = np.concatenate([d.train.source.features(d.train.rows), d.val.source.features(d.val.rows)])
    return both, x, np.concatenate([d.train.y, d.val.y])


@pytest.mark.parametrize("layout", ["columns", "list", "image"])
def test_parquet_layouts_read_back_their_arrays(tmp_path, layout):
    x, y = digits_parquet(tmp_path / "pq", 90, files=3, row_group=7, layout=layout)
    data = "image: {size: [8, 8], channels: 1, column: image}" if layout == "image" else ""
    d = load_dataset(cfg_for(tmp_path, f"parquet:{tmp_path}/pq/*.parquet", data,
                             "[8, 8, 1]" if layout == "image" else "[64]"))
    assert d.feature_shape == ((8, 8, 1) if layout == "image" else (64,))
    both, got, labels = read_all(d)
    np.testing.assert_array_equal(got, x[both])
    np.testing.assert_array_equal(labels, y[both])


def test_parquet_named_columns_and_label(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "t").mkdir()
    rng = np.random.default_rng(0)
    a, b, c = rng.normal(size=40), rng.integers(0, 9, 40), rng.normal(size=40)
    kind = np.arange(40) % 3
    pq.write_table(pa.table({"a": a, "b": b, "c": c, "kind": kind}), tmp_path / "t/x.parquet", row_group_size=9)
    d = load_dataset(cfg_for(tmp_path, f"parquet:{tmp_path}/t/*.parquet",
                             "features: [c, a], label: kind, validation_split: 0", "[2]"))
    both, got, labels = read_all(d)
    np.testing.assert_allclose(got, np.stack([c, a], 1)[both].astype(got.dtype))
    np.testing.assert_array_equal(labels, kind[both])
    assert d.num_outputs == 3


def _pq(tmp_path, tables):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "bad").mkdir(exist_ok=True)
    for k, cols in enumerate(tables):
        pq.write_table(pa.table(cols), tmp_path / f"bad/p{k}.parquet")
    return f"parquet:{tmp_path}/bad/*.parquet"


@pytest.mark.parametrize(("tables", "data", "said"), [
    ([{"a": [1.0, 2.0], "label": [0, 1]}], "features: [a, zz]", "no column 'zz'"),
    ([{"a": [1.0, 2.0], "label": [0, 1]}, {"a": ["x", "y"], "label": [0, 1]}], "", "column types differ"),
    ([{"a": [1.0, 2.0, 3.0], "label": [0, None, 1]}], "", "row 1: the label column 'label' is empty"),
    ([{"a": [[1.0, 2.0], [3.0]], "label": [0, 1]}], "", "row 1 has 1 values, row 0 has 2"),
    ([{"a": [1.0, 2.0], "y": [0, 1]}], "", "no column 'label'"),
])
def test_parquet_errors_are_located(tmp_path, tables, data, said):
    with pytest.raises((DataError, ConfigError)) as e:
        load_dataset(cfg_for(tmp_path, _pq(tmp_path, tables), data, "[1]"))
    assert said in str(e.value) and str(tmp_path / "bad") in str(e.value), str(e.value)


def test_parquet_image_stored_by_path_only_and_no_files(tmp_path):
    import pyarrow as pa

    struct = pa.array([{"bytes": None, "path": "a.png"}], pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    with pytest.raises(DataError, match="no image bytes"):
        load_dataset(cfg_for(tmp_path, _pq(tmp_path, [{"image": struct, "label": [0]}]),
                             IMAGE.replace("}, ", ", column: image}, ") + "validation_split: 0", "[8, 8, 1]"))
    with pytest.raises((DataError, ConfigError), match="(?i)no parquet files match"):
        load_dataset(cfg_for(tmp_path, f"parquet:{tmp_path}/none/*.parquet"))


@pytest.mark.parametrize("kind", ["png", "npy"])
def test_webdataset_shards_read_back_by_index_and_cache_their_index(tmp_path, kind):
    x, y = digits_webdataset(tmp_path / "wds", 70, shards=3, kind=kind)
    data, shape = (IMAGE, "[8, 8, 1]") if kind == "png" else ("", "[64]")
    cfg = cfg_for(tmp_path, f"webdataset:{tmp_path}/wds/*.tar", data, shape)
    both, got, labels = read_all(load_dataset(cfg))
    np.testing.assert_array_equal(got, x[both])
    np.testing.assert_array_equal(labels, y[both])
    assert len(list((tmp_path / "wds").glob(".hvtrain-index-*.json"))) == 3
    # a shard rewritten in place (another size and mtime) is indexed again, not read by the stale index
    digits_webdataset(tmp_path / "wds", 40, shards=3, kind=kind)
    _, again, _ = read_all(load_dataset(cfg))
    assert len(again) == 40


def _tar(path, members, mode="w"):
    with tarfile.open(path, mode) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def _npy(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(a, np.float32))
    return buf.getvalue()


@pytest.mark.parametrize(("members", "mode", "said"), [
    ([("a.npy", _npy([1, 2])), ("a.cls", b"0")], "w:gz", "a compressed tar"),
    ([("a.npy", _npy([1, 2]))], "w", "has no label member"),
    ([("a.cls", b"1")], "w", "has no input member"),
    ([("a.npy", _npy([1, 2])), ("a.cls", b"cat")], "w", "not a class"),
    ([("a.npy", _npy([1, 2])), ("a.png", b"x"), ("a.cls", b"0")], "w", "has two inputs"),
    ([("a.npy", _npy([1, 2])), ("a.cls", b"0"), ("b.npy", _npy([1, 2, 3])), ("b.cls", b"1")], "w",
     "an array of shape [3]"),
])
def test_bad_shards_are_located_errors(tmp_path, members, mode, said):
    (tmp_path / "s").mkdir()
    _tar(tmp_path / "s/shard-0.tar", members, mode)
    with pytest.raises(DataError) as e:
        load_dataset(cfg_for(tmp_path, f"webdataset:{tmp_path}/s/*.tar", "validation_split: 0", "[2]"))
    assert said in str(e.value) and "shard-0.tar" in str(e.value), str(e.value)


def test_keys_with_dots_in_folders_group_as_webdataset_groups_them(tmp_path):
    (tmp_path / "s").mkdir()
    # the key is the path up to the first dot of the file name: v1.2/x, with members npy, cls, meta.json
    _tar(tmp_path / "s/a.tar", [("v1.2/x.npy", _npy([1, 2])), ("v1.2/x.cls", b"1"), ("v1.2/x.meta.json", b"{}"),
                                ("v1.2/z.npy", _npy([3, 4])), ("v1.2/z.cls", b"0")])
    d = load_dataset(cfg_for(tmp_path, f"webdataset:{tmp_path}/s/*.tar", "validation_split: 0", "[2]"))
    assert sorted(d.train.y.tolist()) == [0, 1] and len(d.train) == 2


def augmented(tmp_path, data="", **augment):
    x, _ = digits_webdataset(tmp_path / "wds", 60, shards=2)
    spec = ", ".join(f"{k}: {v}" for k, v in augment.items())
    return x, load_dataset(cfg_for(tmp_path, f"webdataset:{tmp_path}/wds/*.tar",
                                   IMAGE + f"augment: {{{spec}}}, " + data, "[8, 8, 1]"))


def test_augmentation_is_per_sample_whatever_the_batch_and_never_on_validation(tmp_path):
    x, d = augmented(tmp_path, flip="horizontal", crop_padding=1, brightness=0.3, contrast=0.3,
                     resized_crop="[0.5, 1.0]")
    idx = np.arange(len(d.train))
    whole = d.train.features(idx, epoch=2)
    # any split of the same samples into batches (ranks, micro-batches) gives the same rows
    parts = np.concatenate([d.train.features(idx[k::3], epoch=2) for k in range(3)])
    order = np.concatenate([idx[k::3] for k in range(3)])
    np.testing.assert_array_equal(parts, whole[order])
    assert whole.dtype == np.float32 and whole.min() >= 0 and whole.max() <= 255
    assert not np.array_equal(whole, d.train.features(idx, epoch=3)), "another epoch draws again"
    np.testing.assert_array_equal(whole, d.train.features(idx, epoch=2))
    raw = x[d.train.rows].astype(np.float32)
    assert not np.allclose(whole, raw)
    # no epoch (a probe batch, predict) and the validation split are never augmented
    np.testing.assert_array_equal(d.train.features(idx), x[d.train.rows])
    vi = np.arange(len(d.val))
    np.testing.assert_array_equal(d.val.features(vi, epoch=2), x[d.val.rows])


def test_flip_alone_mirrors_about_half_the_samples(tmp_path):
    x, d = augmented(tmp_path, flip="horizontal")
    got = d.train.features(np.arange(len(d.train)), epoch=0)
    raw = x[d.train.rows].astype(np.float32)
    mirrored = np.array([np.array_equal(g, r[:, ::-1]) and not np.array_equal(g, r) for g, r in zip(got, raw, strict=True)])
    same = np.array([np.array_equal(g, r) for g, r in zip(got, raw, strict=True)])
    assert (mirrored | same).all() and 0.25 < mirrored.mean() < 0.75


def test_crop_padding_shifts_within_the_padding(tmp_path):
    x, d = augmented(tmp_path, crop_padding=2)
    got = d.train.features(np.arange(len(d.train)), epoch=1)
    raw = x[d.train.rows].astype(np.float32)
    for g, r in zip(got, raw, strict=True):
        padded = np.pad(r, ((2, 2), (2, 2), (0, 0)))
        assert any(np.array_equal(g, padded[i:i + 8, j:j + 8]) for i in range(5) for j in range(5))


def test_augment_draws_do_not_depend_on_the_rows_beside(tmp_path):
    aug = Augment(seed=1, crop_padding=2, flip=True, brightness=0.5)
    rows = np.random.default_rng(0).integers(0, 255, (6, 8, 8, 3)).astype(np.uint8)
    np.testing.assert_array_equal(aug(rows, np.arange(6), 4)[[1, 4]], aug(rows[[1, 4]], np.array([1, 4]), 4))
    assert not np.array_equal(aug(rows, np.arange(6), 4), Augment(seed=2, crop_padding=2, flip=True,
                                                                   brightness=0.5)(rows, np.arange(6), 4))


def test_channel_normalisation_uses_per_channel_statistics(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "s").mkdir()
    images = rng.integers(0, 255, (30, 4, 5, 3)).astype(np.float32) * np.array([1.0, 0.5, 0.1], np.float32)
    members = []
    for i, im in enumerate(images):
        members += [(f"k{i:03d}.npy", _npy(im)), (f"k{i:03d}.cls", str(i % 2).encode())]
    _tar(tmp_path / "s/a.tar", members)
    cfg = cfg_for(tmp_path, f"webdataset:{tmp_path}/s/*.tar", "validation_split: 0", "[4, 5, 3]")
    cfg.data.normalize = "channel"
    d = load_dataset(cfg)
    got = d.train.features(np.arange(30))
    want = (images[d.train.rows] - images.mean((0, 1, 2))) / images.std((0, 1, 2))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("data", "key", "said"), [
    ("augment: {resized_crop: [0.9, 0.5]}", "data.augment.resized_crop", "min <= max"),
    ("augment: {flip: vertical}", "data.augment.flip", ""),
    ("features: [a, b]", "data.features", "parquet:GLOB"),
    ("label: y", "data.label", "parquet:GLOB"),
    ("workers: -1", "data.workers", ""),
])
def test_config_checks_for_the_new_keys(tmp_path, data, key, said):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        cfg_for(tmp_path, "npz:x.npz", data)
    assert said in str(e.value) and "c.yaml:" in str(e.value)


def test_augment_and_channel_need_image_rows(tmp_path):
    x, _ = digits_webdataset(tmp_path / "wds", 20, shards=1, kind="npy")
    for data, key in (("augment: {flip: horizontal}", "data.augment"), ("normalize: channel", "data.normalize")):
        cfg = cfg_for(tmp_path, f"webdataset:{tmp_path}/wds/*.tar", data.replace("normalize: channel", ""))
        if "channel" in data:
            cfg.data.normalize = "channel"
        with pytest.raises(ConfigError, match=key):
            load_dataset(cfg)


# ---------------------------------------------------------------- review findings (issue 23)


def test_a_null_in_an_integer_feature_is_refused_not_a_huge_number(tmp_path):
    """Before: the first row group fixed int64; a later group's null became -2**63 (no NaN, no error)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "n").mkdir()
    table = pa.table({"count": pa.array([1, 2, 3, 4, None, 6], pa.int64()), "label": [0, 1, 0, 1, 0, 1]})
    pq.write_table(table, tmp_path / "n/a.parquet", row_group_size=3)
    with pytest.raises(DataError, match=r"row group 1\): row 1 of column 'count' is empty \(null\)"):
        load_dataset(cfg_for(tmp_path, f"parquet:{tmp_path}/n/*.parquet", "validation_split: 0", "[1]"))


def test_pandas_index_columns_are_not_features_and_lists_beside_numbers_are_not_guessed(tmp_path):
    import pandas as pd

    (tmp_path / "p").mkdir()
    frame = pd.DataFrame({"a": np.arange(8.0), "b": np.arange(8.0) * 2, "label": np.arange(8) % 2}).sample(8, random_state=0)
    frame.to_parquet(tmp_path / "p/x.parquet")  # writes __index_level_0__ (the sampled index)
    d = load_dataset(cfg_for(tmp_path, f"parquet:{tmp_path}/p/*.parquet", "validation_split: 0", "[2]"))
    assert d.feature_shape == (2,)
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "q").mkdir()
    pq.write_table(pa.table({"id": [1, 2], "emb": pa.array([[0.1, 0.2], [0.3, 0.4]]), "label": [0, 1]}),
                   tmp_path / "q/x.parquet")
    with pytest.raises(ConfigError, match=r"data\.features: .* has numeric columns \(id\) and list columns \(emb\)"):
        load_dataset(cfg_for(tmp_path, f"parquet:{tmp_path}/q/*.parquet", "validation_split: 0", "[2]"))


def test_augmentation_refuses_rows_that_are_not_8_bit_images(tmp_path):
    """Before: float images in [0, 1] were zeroed by resized_crop and standardised values clipped at 0."""
    (tmp_path / "s").mkdir()
    members = []
    for i in range(6):
        members += [(f"k{i}.npy", _npy(np.full((4, 4, 3), 0.5))), (f"k{i}.cls", str(i % 2).encode())]
    _tar(tmp_path / "s/a.tar", members)
    with pytest.raises(ConfigError, match=r"data\.augment: augments 8-bit images .* has float32 values"):
        load_dataset(cfg_for(tmp_path, f"webdataset:{tmp_path}/s/*.tar", "augment: {flip: horizontal}, "
                             "validation_split: 0", "[4, 4, 3]"))
    (tmp_path / "c").mkdir()
    _tar(tmp_path / "c/a.tar", [(f"k{i}.{e}", _npy(np.ones((3, 4, 8))) if e == "npy" else str(i % 2).encode())
                                for i in range(3) for e in ("npy", "cls")])
    cfg = cfg_for(tmp_path, f"webdataset:{tmp_path}/c/*.tar", "validation_split: 0", "[3, 4, 8]")
    cfg.data.normalize = "channel"
    with pytest.raises(ConfigError, match=r"data\.normalize: channel .* shape \[3, 4, 8\]"):
        load_dataset(cfg)


def test_a_key_seen_again_later_or_two_labels_are_refused_as_webdataset_would_split_them(tmp_path):
    (tmp_path / "s").mkdir()
    _tar(tmp_path / "s/a.tar", [("a.npy", _npy([1, 2])), ("a.cls", b"0"), ("b.npy", _npy([1, 2])), ("b.cls", b"1"),
                                ("a.cls", b"1")])
    with pytest.raises(DataError, match="sample 'a' appears again after other samples"):
        load_dataset(cfg_for(tmp_path, f"webdataset:{tmp_path}/s/*.tar", "validation_split: 0", "[2]"))
    _tar(tmp_path / "s/a.tar", [("a.npy", _npy([1, 2])), ("a.cls", b"0"), ("a.cls.txt", b"1")])
    with pytest.raises(DataError, match="sample 'a' has two labels"):
        load_dataset(cfg_for(tmp_path, f"webdataset:{tmp_path}/s/*.tar", "validation_split: 0", "[2]"))


def test_the_index_cache_is_not_trusted_when_malformed_or_the_shard_was_replaced(tmp_path):
    import json
    import os

    (tmp_path / "s").mkdir()
    shard = tmp_path / "s/a.tar"

    def write(labels):
        _tar(shard, [(f"k{i}.{e}", _npy([i, i]) if e == "npy" else str(c).encode())
                     for i, c in enumerate(labels) for e in ("npy", "cls")])

    def labels():
        d = load_dataset(cfg_for(tmp_path, f"webdataset:{tmp_path}/s/*.tar", "validation_split: 0, shuffle: false",
                                 "[2]"))
        return sorted(zip(d.train.rows.tolist(), d.train.y.tolist(), strict=True))

    write([0, 1, 0, 1])
    assert [c for _, c in labels()] == [0, 1, 0, 1]
    cache = tmp_path / "s/.hvtrain-index-a.tar.json"
    saved = json.loads(cache.read_text())
    saved["cls"] = saved["cls"][:2]  # a short (or crafted) cache with a matching stamp
    cache.write_text(json.dumps(saved))
    assert [c for _, c in labels()] == [0, 1, 0, 1]
    st = shard.stat()
    write([1, 0, 1, 0])  # relabelled in place, the same size; its mtime put back (touch -r, rsync -t)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert [c for _, c in labels()] == [1, 0, 1, 0]
    assert not list((tmp_path / "s").glob("*.tmp"))


def test_data_workers_ignore_the_jobs_signals_their_rank_acts_on(tmp_path):
    """Slurm signals every process of a step: a worker killed by that SIGTERM turned a pre-emption
    (checkpoint, exit 75) into 'a data worker process died'."""
    import os
    import signal
    import time

    from hvtrain.data.loader import Workers

    x, d = augmented(tmp_path, flip="horizontal")
    workers = Workers(d.train, 1)
    try:
        first = workers.result(workers.submit(np.arange(8), 0))
        for pid in list(workers._pool._processes):
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        np.testing.assert_array_equal(workers.result(workers.submit(np.arange(8), 0)), first)
    finally:
        workers.close()


def test_keys_that_would_be_silently_ignored_are_refused(tmp_path):
    """A duplicated feature column, a model.output_key on a catalogue model and data.image on .npy
    shards did nothing: each is a located error now."""
    with pytest.raises(ConfigError, match=r"c\.yaml:.*data\.features.*names a more than once"):
        cfg_for(tmp_path, "parquet:x/*.parquet", "features: [a, b, a]")
    p = tmp_path / "k.yaml"
    p.write_text("name: k\ndata: {dataset: 'sklearn:digits'}\nmodel: {input_shape: [64], output_key: logits, "
                 "layers: [{type: dense, units: 10}]}\n")
    with pytest.raises(ConfigError, match=r"k\.yaml:.*model\.output_key.*native model"):
        load_config(p)
    digits_webdataset(tmp_path / "wds", 20, shards=1, kind="npy")
    with pytest.raises(DataError, match=r"\.npy arrays.*data\.image\.size is for encoded images"):
        load_dataset(cfg_for(tmp_path, f"webdataset:{tmp_path}/wds/*.tar", IMAGE))
