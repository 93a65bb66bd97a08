from pathlib import Path

import numpy as np
import pytest

from hvtrain.config.load import load_config
from hvtrain.data.batches import epoch_permutation, shard_batches, shard_eval, steps_per_epoch
from hvtrain.data.dataset import load_dataset
from hvtrain.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[2]


def test_shards_union_equals_single_rank_batches():
    order = epoch_permutation(203, seed=1, epoch=0, shuffle=True)
    single = list(shard_batches(order, 64, rank=0, size=1))
    per_rank = [list(shard_batches(order, 32, rank=r, size=2)) for r in range(2)]
    assert len(single) == len(per_rank[0]) == len(per_rank[1]) == 4
    for k, batch in enumerate(single):
        union = np.concatenate([per_rank[r][k].indices[per_rank[r][k].weights > 0] for r in range(2)])
        assert sorted(union) == sorted(batch.indices)
        total = sum(per_rank[r][k].weights.sum() for r in range(2))
        assert total == pytest.approx(1.0) and batch.weights.sum() == pytest.approx(1.0)


def test_every_sample_once_per_epoch_and_tail_never_empty():
    n, size = 65, 4  # last global batch: 1 sample for 4 ranks
    order = epoch_permutation(n, 3, 2, True)
    seen = []
    counts = set()
    for r in range(size):
        batches = list(shard_batches(order, 8, r, size))
        counts.add(len(batches))
        for b in batches:
            assert len(b.indices) >= 1  # every rank joins every step's allreduce
            seen.extend(b.indices[b.weights > 0])
    assert counts == {steps_per_epoch(n, 8, size)}
    assert sorted(seen) == list(range(n))


def test_accumulation_weights_cover_the_whole_step():
    order = np.arange(100)
    batches = list(shard_batches(order, 10, rank=0, size=1, accumulation=3))
    assert [b.apply for b in batches] == [False, False, True] * 3 + [True]
    assert sum(b.weights.sum() for b in batches[:3]) == pytest.approx(1.0)
    assert batches[-1].weights.sum() == pytest.approx(1.0)  # last step: one micro-batch of 10


def test_permutation_depends_on_seed_and_epoch_only():
    a = epoch_permutation(50, 1, 0, True)
    assert np.array_equal(a, epoch_permutation(50, 1, 0, True))
    assert not np.array_equal(a, epoch_permutation(50, 1, 1, True))
    assert np.array_equal(epoch_permutation(5, 1, 0, False), np.arange(5))


def test_eval_shards_partition():
    parts = [shard_eval(11, r, 3) for r in range(3)]
    assert sorted(np.concatenate(parts)) == list(range(11))


def test_digits_split_and_normalisation():
    cfg = load_config(ROOT / "examples/digits_cnn.yaml")
    d = load_dataset(cfg, (8, 8, 1))
    assert d.x_train.shape[1:] == (8, 8, 1) and len(d.x_train) + len(d.x_val) == 1797
    assert len(d.x_val) == round(1797 * 0.2) and d.num_outputs == 10
    flat = d.x_train.reshape(len(d.x_train), -1)
    assert np.allclose(flat.mean(0), 0, atol=1e-5)
    assert d.y_train.dtype == np.int64


def write_cfg(tmp_path, dataset, extra=""):
    p = tmp_path / "c.yaml"
    p.write_text(f"name: c\ndata: {{dataset: '{dataset}'}}\nmodel: {{input_shape: [2], layers: "
                 f"[{{type: dense, units: 2}}]}}\n{extra}")
    return load_config(p)


def test_csv_and_npz(tmp_path):
    (tmp_path / "d.csv").write_text("a,b,label\n1,2,x\n3,4,y\n5,6,x\n7,8,y\n9,10,x\n")
    d = load_dataset(write_cfg(tmp_path, f"csv:{tmp_path / 'd.csv'}"))
    assert d.num_outputs == 2 and len(d.x_train) + len(d.x_val) == 5
    np.savez(tmp_path / "d.npz", x=np.ones((6, 2)), y=np.arange(6) % 3)
    assert load_dataset(write_cfg(tmp_path, "npz:d.npz")).num_outputs == 3  # relative to the config


def test_dataset_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"c.yaml:2: data.dataset: dataset file not found: missing.csv"):
        load_dataset(write_cfg(tmp_path, "csv:missing.csv"))
    with pytest.raises(ConfigError, match="unknown sklearn dataset 'mnist'"):
        load_dataset(write_cfg(tmp_path, "sklearn:mnist"))
    (tmp_path / "bad.csv").write_text("a,label\n1,0\nzz,1\n")
    with pytest.raises(DataError, match=r"bad.csv:3: expected numbers"):
        load_dataset(write_cfg(tmp_path, "csv:bad.csv"))
    np.savez(tmp_path / "bad.npz", x=np.ones((3, 2)))
    with pytest.raises(DataError, match=r"expected arrays 'x' and 'y', missing \['y'\]"):
        load_dataset(write_cfg(tmp_path, "npz:bad.npz"))
