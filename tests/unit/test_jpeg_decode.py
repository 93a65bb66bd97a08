"""JPEG decoding's fast path (issue 23's decode benchmark): simplejpeg decodes what it can to the
pixels Pillow decodes, and hands Pillow everything else, so its messages stay the ones users see;
data.workers hand batches back through shared-memory slots, or the pipe when a slot cannot hold one."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

from hvtrain.data import images, loader
from hvtrain.data.images import decode
from hvtrain.errors import DataError


def photo(h: int = 37, w: int = 53) -> np.ndarray:
    """A smooth RGB picture with some noise: what JPEG is for (chroma varies, edges are soft)."""
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([np.sin(xx / 5) * 90 + 120, np.cos(yy / 7) * 80 + 120, (xx + yy) * 2.0 % 255], -1)
    return (base + np.random.default_rng(0).normal(0, 6, base.shape)).clip(0, 255).astype(np.uint8)


def jpeg(pixels: np.ndarray, mode: str | None = None, **save) -> bytes:
    out = io.BytesIO()
    image = Image.fromarray(pixels)
    (image.convert(mode) if mode else image).save(out, "JPEG", **save)
    return out.getvalue()


def by_pillow(data, size, channels, monkeypatch) -> np.ndarray:
    with monkeypatch.context() as m:
        m.setattr(images, "_simplejpeg", None)
        return decode(data, size, channels)


@pytest.mark.parametrize("save", [{}, {"subsampling": 0}, {"subsampling": 1}, {"progressive": True},
                                  {"quality": 40, "optimize": True}], ids=["420", "444", "422", "progressive", "q40"])
@pytest.mark.parametrize("size", [(37, 53), (24, 24), (64, 80)], ids=["as-is", "down", "up"])
def test_the_fast_path_decodes_the_pixels_pillow_decodes(save, size, monkeypatch):
    data = jpeg(photo(), **save)
    with monkeypatch.context() as m:  # the fast path really ran: Pillow is not asked to open the file
        m.setattr(Image, "open", lambda *a, **k: pytest.fail("Pillow opened a JPEG simplejpeg decodes"))
        fast = decode(data, size, 3)
    np.testing.assert_array_equal(fast, by_pillow(data, size, 3, monkeypatch))
    assert fast.shape == (*size, 3) and fast.dtype == np.uint8


def test_a_grayscale_jpeg_and_a_file_on_disk_decode_alike(tmp_path, monkeypatch):
    gray = jpeg(photo()[..., 0])
    np.testing.assert_array_equal(decode(gray, (37, 53), 3), by_pillow(gray, (37, 53), 3, monkeypatch))
    path = tmp_path / "a.jpg"
    path.write_bytes(jpeg(photo()))
    np.testing.assert_array_equal(decode(path, (30, 30), 3), by_pillow(path, (30, 30), 3, monkeypatch))
    # one channel is Pillow's convert("L") (ITU-R 601 luma of the RGB), not libjpeg's Y plane
    np.testing.assert_array_equal(decode(path, (30, 30), 1), by_pillow(path, (30, 30), 1, monkeypatch))


def test_what_simplejpeg_does_not_decode_as_pillow_does_is_pillows(tmp_path, monkeypatch):
    cmyk = jpeg(photo(), mode="CMYK")  # libjpeg's CMYK to RGB is not Pillow's: Pillow decodes it
    np.testing.assert_array_equal(decode(cmyk, (37, 53), 3), by_pillow(cmyk, (37, 53), 3, monkeypatch))
    png = io.BytesIO()
    Image.fromarray(photo()).save(png, "PNG")
    np.testing.assert_array_equal(decode(png.getvalue(), (37, 53), 3), photo())
    whole = jpeg(photo())
    for cut in (whole[: len(whole) // 2], whole[:-4], b"\xff\xd8 not a jpeg"):
        with pytest.raises(DataError, match=r"^x\.jpg: not a readable image \((OSError|UnidentifiedImageError)"):
            decode(cut, (37, 53), 3, where="x.jpg")
    with pytest.raises(DataError, match=r"missing\.jpg: not a readable image \(FileNotFoundError"):
        decode(tmp_path / "missing.jpg", (8, 8), 3)


def test_an_image_over_pillows_pixel_limit_is_pillows_to_refuse(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Pillow raises at twice its limit
    with pytest.raises(DataError, match="DecompressionBombError"):
        decode(jpeg(photo()), (8, 8), 3, where="big.jpg")


class Rows:
    """A split's stand-in for the workers: batch k of rows is arange-valued float32 images."""

    source = type("S", (), {"name": "rows"})()

    def features(self, idx, epoch=None):
        idx = np.asarray(idx)
        return (np.arange(len(idx) * 48, dtype=np.float32).reshape(len(idx), 4, 4, 3) + 1000 * idx[:, None, None, None]
                + (epoch or 0))


def shm_files(pid: int) -> list[str]:
    return [n for n in os.listdir(loader.SHM) if n.startswith(f"hvtrain-{pid}-")] if os.path.isdir(loader.SHM) else []


@pytest.mark.parametrize("how", ["slots", "no-shm", "shm-full"])
def test_workers_give_back_every_batch_whichever_way_it_travels(how, monkeypatch, tmp_path):
    if how == "no-shm":
        monkeypatch.setattr(loader, "SHM", str(tmp_path / "absent"))
    if how == "shm-full":  # a container's small /dev/shm: the reservation fails, never a SIGBUS later
        def full(fd, offset, size):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(os, "posix_fallocate", full)
    workers = loader.Workers(Rows(), 2)
    sizes = [8, 8, 8, 3, 8, 12, 8, 8]  # a short last batch, and one larger than the slots were sized for
    try:
        start = 0
        pending = []
        for n in sizes:
            idx = np.arange(start, start + n)
            start += n
            pending.append((idx, workers.submit(idx, 2)))
            if len(pending) == 3:
                idx, f = pending.pop(0)
                np.testing.assert_array_equal(workers.result(f), Rows().features(idx, 2))
        for idx, f in pending:
            np.testing.assert_array_equal(workers.result(f), Rows().features(idx, 2))
        used = bool(workers._slots.maps)
        assert used == (how == "slots"), f"{how}: slots {'used' if used else 'unused'}"
        if how == "slots":
            assert len(shm_files(os.getpid())) == len(workers._slots.maps) <= 5
    finally:
        workers.close()
    assert shm_files(os.getpid()) == [], "close() leaves no shared memory behind"


def test_any_failure_of_simplejpeg_is_pillows_to_decide(monkeypatch):
    """simplejpeg's header reader raises KeyError for a sampling it has no name for (4:4:1, which
    cjpeg -sample 1x4 writes and Pillow decodes): the file goes to Pillow, not a traceback."""
    def unnamed(data):
        raise KeyError(6)

    monkeypatch.setattr(images._simplejpeg, "decode_jpeg_header", unnamed)
    data = jpeg(photo())
    np.testing.assert_array_equal(decode(data, (37, 53), 3), by_pillow(data, (37, 53), 3, monkeypatch))


def test_slots_of_batches_never_read_come_back(tmp_path):
    """A prefetcher stopped mid-epoch (an elastic reset, a pre-emption) leaves batches in flight:
    their slots return to the rank, so the next epoch still travels through shared memory."""
    workers = loader.Workers(Rows(), 1)
    try:
        first = workers.submit(np.arange(8), 0)
        np.testing.assert_array_equal(workers.result(first), Rows().features(np.arange(8), 0))  # sizes the slots
        for _ in range(2):
            for k in range(3):
                workers.submit(np.arange(8) + 8 * k, 1)  # never read
            workers.release()
        np.testing.assert_array_equal(workers.result(workers.submit(np.arange(8), 2)), Rows().features(np.arange(8), 2))
        workers._pool.shutdown(wait=True)
        assert len(workers._slots.maps) <= workers._slots.count
        assert len(workers._slots.free) == len(workers._slots.maps) > 0, "every slot given back"
    finally:
        workers.close()


def test_augmenting_an_empty_batch_gives_an_empty_batch():
    from hvtrain.data.augment import Augment

    aug = Augment(seed=np.int64(3), crop_padding=2, flip=True, brightness=0.2, contrast=0.2)
    out = aug(np.zeros((0, 8, 8, 3), np.uint8), np.zeros(0, np.int64), np.int64(1))
    assert out.shape == (0, 8, 8, 3) and out.dtype == np.float32
