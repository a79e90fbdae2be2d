"""Data sources. Every source yields ``(uint8 image CHW, int label)``; decoding is separate from
augmentation. Small built-in datasets live in memory as one uint8 tensor."""

from __future__ import annotations

import functools
import gzip
import math
import os
import struct
import urllib.request
from pathlib import Path

import torch

from vitrain.config import ConfigError, DataConfig, DatasetInfo

FASHION_MNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "eval": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
# Channel statistics of the Fashion-MNIST training set (computed from the 60k images).
FASHION_MNIST_MEAN, FASHION_MNIST_STD = (0.2860,), (0.3530,)

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
"""Fashion-MNIST's labels 0-9 (Xiao et al. 2017)."""
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".tif", ".tiff")


class InMemoryDataset:
    """Images as one uint8 tensor ``(N, C, H, W)`` with int64 labels."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, num_classes: int):
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"expected uint8 (N, C, H, W) images, got {images.dtype} {tuple(images.shape)}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels, self.num_classes = images, labels.long(), num_classes

    def __len__(self) -> int:
        return len(self.labels)

    def limit(self, count: int | None) -> InMemoryDataset:
        if count is None:
            return self
        return InMemoryDataset(self.images[:count], self.labels[:count], self.num_classes)

    def to(self, device: torch.device | str) -> InMemoryDataset:
        return InMemoryDataset(self.images.to(device), self.labels.to(device), self.num_classes)


# --- Fashion-MNIST (IDX files, Xiao et al. 2017) ------------------------------------------------


def _missing_fashion_mnist(root: Path, name: str) -> ConfigError:
    return ConfigError(
        f"data.root: Fashion-MNIST file {root / name} is missing; install it with "
        "`sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu) or put the four *-ubyte.gz files "
        "from github.com/zalandoresearch/fashion-mnist in a folder and set data.root to it"
    )


def _idx_shape(data: bytes, path: Path) -> tuple[int, ...]:
    """Shape from an IDX header of unsigned bytes (magic 0x0000 0x08 ndim, then ndim big-endian sizes)."""
    if len(data) < 4:
        raise ValueError(f"{path}: too short to be an IDX file")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08 or len(data) < 4 + 4 * ndim:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (header {data[:4].hex()})")
    return struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])


def _open_idx(path: Path):
    with open(path, "rb") as handle:
        gzipped = handle.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def read_idx(path: Path) -> torch.Tensor:
    """Read an IDX file (gzip or raw) of unsigned bytes into a uint8 tensor."""
    try:
        with _open_idx(path) as handle:
            data = handle.read()
    except (EOFError, gzip.BadGzipFile) as error:
        raise ValueError(f"{path}: corrupt or truncated gzip ({error})") from None
    shape = _idx_shape(data, path)
    payload = data[4 + 4 * len(shape) :]
    expected = math.prod(shape)
    if len(payload) != expected:
        raise ValueError(f"{path}: header promises {expected} bytes of data, file holds {len(payload)} (truncated?)")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).reshape(shape)


def idx_length(path: Path) -> int:
    """Number of items (first dimension) in an IDX file, reading only its header."""
    try:
        with _open_idx(path) as handle:
            header = handle.read(4 + 4 * 255)  # the longest possible header
    except (EOFError, gzip.BadGzipFile) as error:
        raise ValueError(f"{path}: corrupt or truncated gzip ({error})") from None
    return _idx_shape(header, path)[0]


def fashion_mnist_root(config: DataConfig) -> Path:
    root = config.root or FASHION_MNIST_ROOT
    for names in FASHION_MNIST_FILES.values():
        for name in names:
            if not (root / name).is_file():
                raise _missing_fashion_mnist(root, name)
    return root


def download_fashion_mnist(root: Path, base_url: str = FASHION_MNIST_URL) -> list[Path]:
    """Fetch the four IDX files into ``root`` (each checked, then renamed into place)."""
    root.mkdir(parents=True, exist_ok=True)
    written = []
    for names in FASHION_MNIST_FILES.values():
        for name in names:
            target = root / name
            if target.is_file():
                continue
            partial = target.with_name(name + ".part")
            try:
                urllib.request.urlretrieve(base_url + name, partial)
                read_idx(partial)  # refuse to install a truncated or foreign file
            except BaseException:
                partial.unlink(missing_ok=True)
                raise
            os.replace(partial, target)
            written.append(target)
    return written


def load_fashion_mnist(root: Path, split: str) -> InMemoryDataset:
    image_file, label_file = FASHION_MNIST_FILES[split]
    images, labels = read_idx(root / image_file), read_idx(root / label_file)
    return InMemoryDataset(images.unsqueeze(1), labels.long(), num_classes=10)


# --- Image folders and CSV lists -----------------------------------------------------------------
#
# data.root is one of: an ImageNet-layout folder (train/<class>/*, val/<class>/*); a folder of class
# folders (<class>/*), or train/ alone; a CSV file of path,label rows. Where there is no val/, the
# evaluation split is held out of the training images (data.val_fraction, per class, stable).


def scan_image_folder(root: Path, classes: list[str] | None = None) -> tuple[list[tuple[str, int]], list[str]]:
    """``root/<class>/<image>`` -> sorted ``(path, class index)`` pairs and the class names."""
    if classes is None:
        classes = sorted(entry.name for entry in root.iterdir() if entry.is_dir())
    index = {name: position for position, name in enumerate(classes)}
    samples = []
    for class_dir in sorted(entry for entry in root.iterdir() if entry.is_dir()):
        if class_dir.name not in index:
            raise ConfigError(
                f"data.root: class folder {class_dir} has no counterpart in train/; "
                "val/ must use the class names of train/"
            )
        for path in sorted(class_dir.rglob("*")):
            if path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file():
                samples.append((str(path), index[class_dir.name]))
    return samples, classes


def image_folder_base(root: Path) -> Path:
    """The folder the training images' paths are relative to: train/ of an ImageNet-layout root, the folder of
    a CSV file, else the root."""
    root = Path(root)
    if root.is_file():
        return root.parent
    return root / "train" if (root / "train").is_dir() else root


def _class_sort_key(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def read_csv_samples(path: Path) -> tuple[list[tuple[str, int]], list[str], list[str] | None]:
    """A CSV of ``path,label`` rows (a header row naming them is optional; a third column ``split`` of train/val
    splits it): the ``(path, class index)`` pairs, the class names (integers in numeric order, else sorted) and
    each row's split (None without the column). Paths are relative to the CSV's folder unless absolute."""
    import csv

    with open(path, newline="") as handle:
        rows = [row for row in csv.reader(handle) if row and any(cell.strip() for cell in row)]
    if rows and [cell.strip().lower() for cell in rows[0][:2]] == ["path", "label"]:
        rows = rows[1:]
    bad = next((number for number, row in enumerate(rows, 1) if len(row) < 2 or not row[0].strip()), None)
    if bad is not None or not rows:
        where = f"row {bad} has no path,label" if bad else "it lists no images"
        raise ConfigError(f"data.root={path}: {where}; write one image per row as path,label (a header is optional)")
    classes = sorted({row[1].strip() for row in rows}, key=_class_sort_key)
    index = {name: position for position, name in enumerate(classes)}
    samples = [(str(path.parent / row[0].strip()), index[row[1].strip()]) for row in rows]
    splits = [row[2].strip().lower() for row in rows] if all(len(row) > 2 for row in rows) else None
    if splits is not None and not set(splits) <= {"train", "val"}:
        raise ConfigError(f"data.root={path}: the third column (split) takes train or val, got {sorted(set(splits))}")
    return samples, classes, splits


def hold_out(samples: list[tuple[str, int]], base: Path, fraction: float) -> tuple[list, list]:
    """(training, evaluation) samples: of each class of two images or more, ``fraction`` of its images (at least
    one) go to evaluation, chosen by a hash of their path relative to ``base``, so the split is the same in
    every process and every run, whatever the order of the files or where the folder was moved."""
    by_class: dict[int, list[tuple[str, int]]] = {}
    for sample in samples:
        by_class.setdefault(sample[1], []).append(sample)
    held = set()
    for members in by_class.values():
        if len(members) < 2:
            continue
        count = max(1, round(fraction * len(members)))
        ranked = sorted(members, key=lambda sample: _path_hash(sample[0], base))
        held.update(path for path, _ in ranked[:count])
    return [s for s in samples if s[0] not in held], [s for s in samples if s[0] in held]


def _path_hash(path: str, base: Path) -> str:
    import hashlib

    relative = os.path.relpath(path, base)
    return hashlib.sha256(relative.encode()).hexdigest()


def _all_splits(root: Path, val_fraction: float) -> tuple[list, list, list[str], bool]:
    """(training samples, evaluation samples, class names, whether evaluation was held out); scanned once per
    process and version of the root (a CSV rewritten is read again)."""
    return _scanned_splits(root, val_fraction, root.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _scanned_splits(root: Path, val_fraction: float, version: int) -> tuple[list, list, list[str], bool]:
    base = image_folder_base(root)
    if root.is_file():
        samples, classes, splits = read_csv_samples(root)
        if splits is not None:
            pairs = list(zip(samples, splits, strict=True))
            return [s for s, k in pairs if k == "train"], [s for s, k in pairs if k == "val"], classes, False
        return (*hold_out(samples, base, val_fraction), classes, True)
    samples, classes = scan_image_folder(base)
    if (root / "val").is_dir() and base != root:
        return samples, scan_image_folder(root / "val", classes)[0], classes, False
    return (*hold_out(samples, base, val_fraction), classes, True)


def image_folder_samples(root: Path, split: str, val_fraction: float) -> tuple[list[tuple[str, int]], list[str]]:
    """Samples of one split (``train`` or ``eval``) of an image folder or CSV list, and the class names
    (scanned once per process)."""
    train, evaluation, classes, _ = _all_splits(Path(root), val_fraction)
    return (train if split == "train" else evaluation), classes


def held_out_split(config: DataConfig) -> list[str] | None:
    """The evaluation images held out of the training images (paths relative to the training folder), or None
    where the source has its own evaluation split."""
    root = image_folder_root(config)
    _, evaluation, _, held = _all_splits(root, config.val_fraction)
    base = image_folder_base(root)
    return [os.path.relpath(path, base) for path, _ in evaluation] if held else None


def image_folder_root(config: DataConfig) -> Path:
    """data.root of an image-folder source, checked: a folder of images in class folders or a CSV file."""
    root = config.root
    if root is None:
        raise ConfigError(
            "data.root is required for data.name=imagefolder; set it to a folder with a subfolder per class "
            "(train/ and val/ inside, or not) or to a CSV file of path,label rows"
        )
    root = Path(root)
    if root.is_file():
        if root.suffix.lower() != ".csv":
            raise ConfigError(f"data.root={root} is a file but not a .csv; give a folder of class folders or a CSV")
        return root
    if not root.is_dir():
        raise ConfigError(f"data.root={root} does not exist; give a folder with a subfolder per class or a CSV file")
    if not any(entry.is_dir() for entry in image_folder_base(root).iterdir()):
        raise ConfigError(
            f"data.root={root} has no class folders; put each class's images in a subfolder named after the class"
        )
    return root


# --- Synthetic (benchmarks and tests) --------------------------------------------------------------


def build_synthetic(config: DataConfig, channels: int, split: str) -> InMemoryDataset:
    """Seeded, learnable random data: each class has a smooth random prototype image, each
    sample adds noise. Labels are learnable, so it serves smoke tests as well as throughput benchmarks."""
    size, num_classes = config.image_size, config.synthetic_num_classes
    count = config.synthetic_num_train if split == "train" else config.synthetic_num_eval
    generator = torch.Generator().manual_seed(1234)
    # Smooth prototypes (4x4 upsampled) keep their identity under crops and flips.
    coarse = torch.rand(num_classes, channels, 4, 4, generator=generator) * 255
    prototypes = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    generator.manual_seed(1 if split == "train" else 2)
    labels = torch.randint(num_classes, (count,), generator=generator)
    images = torch.empty(count, channels, size, size, dtype=torch.uint8)
    for start in range(0, count, 1024):
        chunk = labels[start : start + 1024]
        noise = torch.randn(len(chunk), channels, size, size, generator=generator) * 40
        images[start : start + len(chunk)] = (prototypes[chunk] + noise).clamp_(0, 255).to(torch.uint8)
    return InMemoryDataset(images, labels, num_classes)


SYNTHETIC_CHANNELS = 3


# --- Describe: cheap metadata for resolve() ----------------------------------------------------------


def _limited(count: int, limit: int | None) -> int:
    return count if limit is None else min(count, limit)


IMAGENET_TRAIN_IMAGES, IMAGENET_EVAL_IMAGES, IMAGENET_CLASSES = 1_281_167, 50_000, 1000
FASHION_MNIST_TRAIN_IMAGES, FASHION_MNIST_EVAL_IMAGES = 60_000, 10_000


def nominal_source_info(config: DataConfig) -> DatasetInfo:
    """What :func:`~vitrain.data.build.describe_source` would say of a source whose files are not here (a job's
    data on its cluster, a recipe's data not installed), without reading anything: image folders and shards have
    ImageNet-1k's shape (1,281,167 training and 50,000 evaluation images, 1000 classes, 3 channels, ImageNet
    mean/std: the config names no class count, and a generous training set refuses no batch that the real
    one may take), Fashion-MNIST its own (60,000/10,000 images, 10 classes, 1 channel); synthetic data is
    described as ever (it reads no files). data.limit_train/limit_eval apply."""
    if config.name == "synthetic":
        return describe_unsharded_source(config)
    if config.name == "fashion-mnist":
        sizes = (FASHION_MNIST_TRAIN_IMAGES, FASHION_MNIST_EVAL_IMAGES, 10, 1, FASHION_MNIST_MEAN, FASHION_MNIST_STD)
    else:
        sizes = (IMAGENET_TRAIN_IMAGES, IMAGENET_EVAL_IMAGES, IMAGENET_CLASSES, 3, IMAGENET_MEAN, IMAGENET_STD)
    return source_info(config, sizes)


SourceSizes = tuple[int, int, int, int, tuple[float, ...], tuple[float, ...]]
"""(training images, evaluation images, classes, channels, mean, std) of a source, before any limit."""


def source_info(config: DataConfig, sizes: SourceSizes) -> DatasetInfo:
    """The :class:`DatasetInfo` of a source of these sizes, data.limit_train/limit_eval applied."""
    num_train, num_eval, num_classes, channels, mean, std = sizes
    return DatasetInfo(
        num_train=_limited(num_train, config.limit_train),
        num_eval=_limited(num_eval, config.limit_eval),
        num_classes=num_classes,
        channels=channels,
        mean=mean,
        std=std,
    )


def describe_unsharded_source(config: DataConfig) -> DatasetInfo:
    """What resolve() needs of Fashion-MNIST, an image folder or synthetic data, read without loading the data;
    ConfigError if it is missing. Shards are described by :func:`vitrain.data.build.describe_source`: reading
    them takes :mod:`vitrain.data.shards`, which builds on this module."""
    if config.name == "fashion-mnist":
        root = fashion_mnist_root(config)
        num_train = idx_length(root / FASHION_MNIST_FILES["train"][1])
        num_eval = idx_length(root / FASHION_MNIST_FILES["eval"][1])
        return source_info(config, (num_train, num_eval, 10, 1, FASHION_MNIST_MEAN, FASHION_MNIST_STD))
    if config.name == "imagefolder":
        root = image_folder_root(config)
        train, classes = image_folder_samples(root, "train", config.val_fraction)
        evaluation, _ = image_folder_samples(root, "eval", config.val_fraction)
        if not train or not evaluation:
            split = "training" if not train else "evaluation"
            raise ConfigError(
                f"data.root={root}: no {split} images (extensions {', '.join(IMAGE_EXTENSIONS)}); a held-out "
                "evaluation split needs a class with two images or more"
            )
        return source_info(config, (len(train), len(evaluation), len(classes), 3, IMAGENET_MEAN, IMAGENET_STD))
    if config.name != "synthetic":
        raise ValueError(f"data.name={config.name}: not described here")
    channels = SYNTHETIC_CHANNELS
    sizes = (config.synthetic_num_train, config.synthetic_num_eval, config.synthetic_num_classes, channels)
    return source_info(config, (*sizes, (0.5,) * channels, (0.25,) * channels))
