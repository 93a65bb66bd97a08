"""images:DIR (issue 23): a folder of class folders of JPEG/PNG files, decoded by Pillow to
channels-last uint8 rows; located errors before training for what is missing or unreadable."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from hvtrain.config.load import load_config
from hvtrain.data.dataset import load_dataset
from hvtrain.errors import ConfigError, DataError
from tests.support.data import digits_image_folder


def cfg_for(tmp_path, dataset, image="{size: [8, 8], channels: 1}", extra=""):
    p = tmp_path / "c.yaml"
    p.write_text(f"name: i\ndata: {{dataset: '{dataset}', image: {image}, normalize: none{extra}}}\n"
                 "model: {input_shape: [8, 8, 1], layers: [{type: flatten}, {type: dense, units: 10}]}\n")
    return load_config(p)


def test_a_png_folder_reads_back_the_arrays_it_was_written_from_with_sorted_class_names_as_labels(tmp_path):
    x, y = digits_image_folder(tmp_path / "digits", per_class=6)
    d = load_dataset(cfg_for(tmp_path, f"images:{tmp_path / 'digits'}"))
    assert d.feature_shape == (8, 8, 1) and d.num_outputs == 10 and list(d.classes) == [str(c) for c in range(10)]
    order = np.argsort(y, kind="stable")  # the folder's order: class, then file name (written in sample order)
    both = np.concatenate([d.train.rows, d.val.rows])
    got = np.concatenate([d.train.source.features(d.train.rows), d.val.source.features(d.val.rows)])
    np.testing.assert_array_equal(got, x[order][both])  # PNG is lossless: the very pixels
    np.testing.assert_array_equal(np.concatenate([d.train.y, d.val.y]), y[order][both])


def test_jpeg_rgb_and_resize_decode_as_pillow_does(tmp_path):
    root = tmp_path / "photos"
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 256, (20, 30, 3), np.uint8)).save(root / cls / f"{i}.jpg", quality=90)
    cfg = cfg_for(tmp_path, f"images:{root}", image="{size: [10, 12], channels: 3}", extra=", validation_split: 0")
    d = load_dataset(cfg)
    assert d.feature_shape == (10, 12, 3) and list(d.classes) == ["cat", "dog"] and d.num_outputs == 2
    want = np.asarray(Image.open(root / "dog" / "1.jpg").convert("RGB").resize((12, 10), Image.Resampling.BILINEAR))
    np.testing.assert_array_equal(d.train.source.features(np.array([4]))[0], want)


def test_train_and_val_folders_are_an_explicit_split(tmp_path):
    digits_image_folder(tmp_path / "d" / "train", per_class=4)
    digits_image_folder(tmp_path / "d" / "val", per_class=2, start=100)
    d = load_dataset(cfg_for(tmp_path, f"images:{tmp_path / 'd'}"))
    assert len(d.train) == 40 and len(d.val) == 20 and d.split is None


@pytest.mark.parametrize(("make", "error", "said"), [
    (lambda r: None, ConfigError, "dataset directory not found"),
    (lambda r: r.mkdir(), DataError, "has no class folders"),
    (lambda r: (r / "a").mkdir(parents=True), DataError, "holds no .jpg/.jpeg/.png file"),
    (lambda r: (r / "train" / "a").mkdir(parents=True), DataError, "has train/ but not val/"),
])
def test_a_folder_that_is_not_an_image_folder_is_one_located_error(tmp_path, make, error, said):
    root = tmp_path / "imgs"
    make(root)
    with pytest.raises(error) as exc:
        load_dataset(cfg_for(tmp_path, f"images:{root}"))
    assert said in str(exc.value) and str(exc.value).startswith(str(tmp_path / "c.yaml")), exc.value


def test_train_and_val_with_different_classes_are_refused(tmp_path):
    digits_image_folder(tmp_path / "d" / "train", per_class=2)
    digits_image_folder(tmp_path / "d" / "val", per_class=2, classes=9)
    with pytest.raises(DataError, match="only in one of them: 9"):
        load_dataset(cfg_for(tmp_path, f"images:{tmp_path / 'd'}"))


def test_a_corrupt_image_is_named_before_training(tmp_path):
    digits_image_folder(tmp_path / "d", per_class=3)
    bad = tmp_path / "d" / "7" / "0001.png"
    bad.write_bytes(bad.read_bytes()[:40])  # truncated
    with pytest.raises(DataError, match=rf"{bad}: not a readable image"):
        load_dataset(cfg_for(tmp_path, f"images:{tmp_path / 'd'}"))  # the start-up pass reads every row


@pytest.mark.parametrize(("image", "said"), [
    ("{channels: 1}", "data.image.size: is required for images:"),
    ("{size: [8]}", "data.image.size: expected [height, width]"),
    ("{size: [8, 8], channels: 2}", "data.image.channels: expected one of 1, 3; got 2"),
    ("{size: [0, 8]}", "data.image.size"),
])
def test_image_options_that_cannot_work_are_located_config_errors(tmp_path, image, said):
    digits_image_folder(tmp_path / "d", per_class=2)
    with pytest.raises(ConfigError, match=said.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        load_dataset(cfg_for(tmp_path, f"images:{tmp_path / 'd'}", image=image))


def test_a_16_bit_image_is_refused_not_clipped_to_white(tmp_path):
    digits_image_folder(tmp_path / "d", per_class=2)
    wide = tmp_path / "d" / "3" / "0000.png"
    Image.fromarray(np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000).save(wide)  # mode I;16
    with pytest.raises(DataError, match=rf"{wide}: a I;16 image \(more than 8 bits a value\)"):
        load_dataset(cfg_for(tmp_path, f"images:{tmp_path / 'd'}"))


def test_classes_called_train_are_classes_and_a_train_valid_split_is_refused(tmp_path):
    for cls in ("bus", "train", "tram"):  # CIFAR-100 has a "train" class
        digits_image_folder(tmp_path / "vehicles" / cls, per_class=1, classes=2)
    for folder in (tmp_path / "vehicles" / c for c in ("bus", "train", "tram")):
        for sub in list(folder.iterdir()):  # flatten: images directly in each class folder
            for f in sub.iterdir():
                f.rename(folder / f"{sub.name}-{f.name}")
            sub.rmdir()
    d = load_dataset(cfg_for(tmp_path, f"images:{tmp_path / 'vehicles'}"))
    assert list(d.classes) == ["bus", "train", "tram"] and len(d.train) + len(d.val) == 6
    digits_image_folder(tmp_path / "kaggle" / "train", per_class=2)
    digits_image_folder(tmp_path / "kaggle" / "valid", per_class=1)
    with pytest.raises(DataError, match="looks like a split .* explicit split is DIR/train and DIR/val"):
        load_dataset(cfg_for(tmp_path, f"images:{tmp_path / 'kaggle'}"))


def test_hidden_files_and_macos_folders_are_skipped_and_subfolders_are_read(tmp_path):
    digits_image_folder(tmp_path / "d", per_class=2)
    (tmp_path / "d" / "4" / "._0000.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (tmp_path / "d" / "__MACOSX").mkdir()
    (tmp_path / "d" / "2" / "more").mkdir()
    (tmp_path / "d" / "5" / "0000.png").rename(tmp_path / "d" / "2" / "more" / "x.png")
    d = load_dataset(cfg_for(tmp_path, f"images:{tmp_path / 'd'}"))
    assert d.num_outputs == 10 and len(d.train) + len(d.val) == 20  # the moved file counts for class 2
    assert int(np.sum(np.concatenate([d.train.y, d.val.y]) == 2)) == 3


def test_an_image_beyond_pillows_bomb_limit_is_a_located_error(tmp_path, monkeypatch):
    from PIL import Image as PILImage

    digits_image_folder(tmp_path / "d", per_class=2)
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 20)  # 8x8 = 64 > 2 x 20: Pillow's error, not its warning
    with pytest.raises(DataError, match="not a readable image \\(DecompressionBombError"):
        load_dataset(cfg_for(tmp_path, f"images:{tmp_path / 'd'}"))
