"""`images:DIR`: a folder of image files per class (the ImageFolder / ImageNet layout), decoded by
Pillow into channels-last uint8 rows of one size.

    DIR/<class>/*.jpg|jpeg|png             one folder: split by data.validation_split (seeded)
    DIR/train/<class>/..., DIR/val/<class>/...   an explicit split (both, with the same classes)

Labels are the class folders' names, sorted (what ImageFolder does); a sample's order is its class,
then its file name, so every rank and every run sees the same rows. An image is decoded only when
a batch (or the start-up pass that checks every row and fits the normalisation) reads it; a file
Pillow cannot read is a DataError naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hvtrain.data.sources import Source
from hvtrain.errors import DataError

EXTENSIONS = (".jpg", ".jpeg", ".png")
# what unzipping on macOS leaves beside the data: never a class, never an image
IGNORED = ("__MACOSX",)
# modes whose values are not 8-bit: Pillow's convert() to L or RGB clips them at 255 (a 16-bit
# grayscale PNG of 0..65535 decodes nearly all white), so they are refused, not trained on
WIDE_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")


class ImageFolderSource(Source):
    """The image files of one folder of class folders, as (H, W, C) uint8 feature rows."""

    def __init__(self, files: list[Path], labels: np.ndarray, size: tuple[int, int], channels: int,
                 name: str, root: Path) -> None:
        self.files, self._labels, self.size, self.channels = files, labels, size, channels
        self.name, self.root = name, root
        self._identity: list[Any] | None = None  # the files are stat'ed once, however often it is asked

    def __len__(self) -> int:
        return len(self.files)

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return (*self.size, self.channels)

    def features(self, indices: np.ndarray) -> np.ndarray:
        out = np.empty((len(indices), *self.feature_shape), np.uint8)
        for i, index in enumerate(np.asarray(indices, np.int64)):
            out[i] = decode(self.files[index], self.size, self.channels)
        return out

    def labels(self) -> np.ndarray:
        return self._labels

    def identity(self) -> list[Any]:
        """The files (path under the folder, size, modification time), the decoded shape and the
        Pillow that decodes them (JPEG decoding differs between libjpeg versions)."""
        if self._identity is not None:
            return self._identity
        rows = []
        for path in self.files:
            st = path.stat()
            rows.append([str(path.relative_to(self.root)), st.st_size, st.st_mtime_ns])
        self._identity = [str(self.root.resolve()), list(self.feature_shape), decoder(), rows]
        return self._identity

    def cache_dir(self) -> Path:
        return self.root


def decode(path: Path | bytes, size: tuple[int, int], channels: int, where: str | None = None) -> np.ndarray:
    """One image (a file, or its encoded bytes: a tar member, a Parquet cell) as (H, W, C) uint8:
    converted to RGB (3) or L (1), resized to `size` (H, W) with bilinear filtering when it differs
    (Pillow's resize: the same bytes on every rank). `where` names it in errors (default: the path).

    A YCbCr or grayscale JPEG decoded to RGB goes through simplejpeg when it is installed (the
    `data` extra): libjpeg-turbo's decoder called once, about 3x Pillow's chunked one, and the same
    pixels (both are libjpeg-turbo's default islow IDCT with fancy upsampling; the tests check
    it). Anything else, and any file simplejpeg refuses, is Pillow's, whose error is the one shown."""
    import io

    from PIL import Image, UnidentifiedImageError

    where = where or str(path)
    data = path if isinstance(path, (bytes, bytearray, memoryview)) else None
    if channels == 3 and _simplejpeg is not None:
        if data is None:
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                raise DataError(f"{where}: not a readable image ({type(exc).__name__}: {exc})") from None
        fast = _fast_jpeg(bytes(data) if not isinstance(data, bytes) else data)
        if fast is not None:
            if fast.shape[:2] != size:
                fast = np.asarray(Image.fromarray(fast).resize((size[1], size[0]), Image.Resampling.BILINEAR))
            return fast.reshape(*size, channels)
    try:
        with Image.open(io.BytesIO(data) if data is not None else path) as image:
            if image.mode in WIDE_MODES:
                raise DataError(f"{where}: a {image.mode} image (more than 8 bits a value); hvtrain decodes 8-bit "
                                "images: convert the files to 8 bits (PNG L/RGB or JPEG)")
            image = image.convert("RGB" if channels == 3 else "L")
            if image.size != (size[1], size[0]):
                image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
            pixels = np.asarray(image, np.uint8)
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"{where}: not a readable image ({type(exc).__name__}: {exc})") from None
    return pixels.reshape(*size, channels)


try:
    import simplejpeg as _simplejpeg
except ImportError:  # the data extra not installed: Pillow decodes every image
    _simplejpeg = None


def decoder() -> str:
    """What decodes JPEGs here, for a dataset's identity (JPEG decoding differs between libjpeg
    versions, so a cache of statistics is only reused under the same decoders)."""
    import PIL

    return f"Pillow {PIL.__version__}" + (f", simplejpeg {_simplejpeg.__version__}" if _simplejpeg else "")


def _fast_jpeg(data: bytes) -> np.ndarray | None:
    """A baseline or progressive YCbCr/grayscale JPEG as RGB uint8 by simplejpeg, or None for
    Pillow to decode (not a JPEG, CMYK, over Pillow's decompression-bomb limit, or refused)."""
    from PIL import Image

    if data[:2] != b"\xff\xd8":
        return None
    try:
        height, width, space, _ = _simplejpeg.decode_jpeg_header(data)
        limit = Image.MAX_IMAGE_PIXELS
        if space not in ("YCbCr", "Gray") or (limit is not None and height * width > limit):
            return None
        return _simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True)
    except Exception:  # noqa: BLE001 - truncated, corrupt, a sampling it has no name for (4:4:1): Pillow decides
        return None


def image_size(cfg: Any) -> tuple[tuple[int, int], int]:
    """data.image's (size, channels): the size is required for a dataset of encoded images."""
    image = cfg.data.image
    if image.size is None:
        raise cfg.fail("data.image.size", f"is required for {cfg.data.dataset}: the [height, width] every "
                                          "image is resized to")
    return (int(image.size[0]), int(image.size[1])), int(image.channels)


def _class_files(root: Path, where: str) -> tuple[list[Path], list[str]]:
    """Every image of every class folder of `root`: (files, class names), in class then file order."""
    if not root.is_dir():
        raise DataError(f"{where}: {root} is not a directory (images:DIR holds one folder per class)")
    classes = _folders(root)
    if not classes:
        raise DataError(f"{where}: {root} has no class folders (images:DIR holds DIR/<class>/*.jpg|png)")
    splits = {"valid", "validation", "test"} & set(classes)
    if "train" in classes and splits and any(p.is_dir() for p in (root / "train").iterdir()):
        raise DataError(f"{where}: {root} looks like a split (train/ and {'/, '.join(sorted(splits))}/ of class "
                        "folders), not classes: hvtrain's explicit split is DIR/train and DIR/val")
    files, labels = [], []
    for name in classes:
        found = []
        for p in sorted((root / name).rglob("*")):  # as torchvision's ImageFolder: images in subfolders too
            if any(part.startswith(".") for part in p.relative_to(root / name).parts):
                continue  # hidden files and folders (macOS's ._name files among them)
            if p.is_symlink() and not p.exists():
                raise DataError(f"{where}: {p} is a symbolic link to a missing file")
            if p.is_file() and p.suffix.lower() in EXTENSIONS:
                found.append(p)
        if not found:
            raise DataError(f"{where}: class folder {root / name} holds no {'/'.join(EXTENSIONS)} file")
        files += found
        labels += [name] * len(found)
    return files, labels


def _folders(root: Path) -> list[str]:
    """The class (or split) folders of `root`, sorted: not hidden, not macOS's __MACOSX."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and p.name not in IGNORED)


def _is_split(root: Path) -> bool:
    """DIR/train + DIR/val (+ an unused DIR/test) holding class folders: an explicit split. A
    dataset whose classes are called train or val (CIFAR-100 has a "train" class) is not one:
    it has other class folders beside them, or images directly inside them."""
    folders = set(_folders(root))
    if "train" not in folders and "val" not in folders or not folders <= {"train", "val", "test"}:
        return False
    return not any(p.is_file() and p.suffix.lower() in EXTENSIONS for p in (root / "train").iterdir()) \
        if (root / "train").is_dir() else True


def open_image_folder(cfg: Any, root: Path) -> tuple[ImageFolderSource, ImageFolderSource | None]:
    """The training source and, with DIR/train and DIR/val, the separate validation source."""
    where = cfg.where("data.dataset")
    size, channels = image_size(cfg)

    def source(folder: Path, name: str) -> tuple[ImageFolderSource, list[str]]:
        files, labels = _class_files(folder, where)
        return ImageFolderSource(files, np.array(labels), size, channels, name, folder), sorted(set(labels))

    train_dir, val_dir = root / "train", root / "val"
    if root.is_dir() and _is_split(root):
        if not (train_dir.is_dir() and val_dir.is_dir()):
            raise DataError(f"{where}: {root} has {'train' if train_dir.is_dir() else 'val'}/ but not "
                            f"{'val' if train_dir.is_dir() else 'train'}/ (an explicit split needs both)")
        train, train_classes = source(train_dir, f"{cfg.data.dataset} (train/)")
        val, val_classes = source(val_dir, f"{cfg.data.dataset} (val/)")
        if train_classes != val_classes:
            only = sorted(set(train_classes) ^ set(val_classes))
            raise DataError(f"{where}: {root}: train/ and val/ must hold the same class folders; only in one of "
                            f"them: {', '.join(only)}")
        return train, val
    return source(root, cfg.data.dataset)[0], None
