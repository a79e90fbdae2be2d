"""Label maps for token labeling (Jiang et al. 2021, "All Tokens Matter"): per training image, a
teacher's top-k class scores and class indices at every position of its output grid.

Two layouts are read, both through ``read(indices) -> (B, 2, k, H, W)`` float32 (scores, then the
class indices as floats: the TokenLabeling toolbox's combined layout):

- **shards** (written by ``vitrain label``): a folder with ``index.json`` and one sub-folder per
  shard of ``samples_per_shard`` images, ``shard-00000/scores.npy`` (n, k, H, W) float16 and
  ``shard-00000/indices.npy`` (n, k, H, W) int16, read through memory maps. A shard is written under a
  temporary name and renamed when complete, so a folder that exists is whole; an interrupted run
  skips the shards already there. Images that could not be decoded have no map: they are listed in
  ``index.json``'s ``missing`` (their slots hold index -1 and score 0).
- **published** (the toolbox's ImageNet maps): one ``.pt`` file per training image holding a
  ``[2, k, H, W]`` tensor, at ``<class folder>/<file name up to its first dot>.pt``.

Every mismatch with the training data is a :class:`~vitrain.config.ConfigError` naming the file and
what to do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitrain.config import ConfigError

FORMAT_VERSION = 1
INDEX_FILE = "index.json"
MAX_CLASSES = int(np.iinfo(np.int16).max) + 1
"""Class indices are stored as int16."""
DEFAULT_SHARD_SIZE = 10_000
MISSING_INDEX = -1
"""The class index in the slots of images without a map (undecodable files)."""


@dataclasses.dataclass(frozen=True)
class DatasetFingerprint:
    """Which training samples, in which order: their count and a sha256 of their ordered keys
    (relative paths for image folders, ``<source>:train:<index>`` for in-memory datasets)."""

    count: int
    sha256: str

    @classmethod
    def of_keys(cls, keys: Sequence[str]) -> DatasetFingerprint:
        digest = hashlib.sha256()
        for key in keys:
            digest.update(key.encode())
            digest.update(b"\n")
        return cls(len(keys), digest.hexdigest())


@dataclasses.dataclass(frozen=True)
class MapLayout:
    """What a set of label maps holds: ``count`` images of ``k`` scores and indices at ``height x width``."""

    count: int
    num_classes: int
    k: int
    height: int
    width: int
    samples_per_shard: int = DEFAULT_SHARD_SIZE

    @property
    def num_shards(self) -> int:
        return -(-self.count // self.samples_per_shard)

    def shard_range(self, shard: int) -> range:
        start = shard * self.samples_per_shard
        return range(start, min(start + self.samples_per_shard, self.count))


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


def sample_keys_of_paths(root: Path, paths: Sequence[str]) -> list[str]:
    """Keys of image files: their paths relative to ``root`` (the split's folder), with ``/``."""
    return [Path(path).relative_to(root).as_posix() for path in paths]


def in_memory_sample_keys(source: str, count: int) -> list[str]:
    """Keys of an in-memory training split (``fashion-mnist``, ``synthetic``): ``<source>:train:<index>``."""
    return [f"{source}:train:{index}" for index in range(count)]


# --- writing ------------------------------------------------------------------------------------


class LabelMapWriter:
    """Writes the shards of one folder; ``header`` is what ``index.json`` records besides the layout
    (teacher, data config, fingerprint). Construction checks that a folder already holding maps was
    made with the same layout and data (then its finished shards are kept), else raises ConfigError."""

    def __init__(self, path: Path, layout: MapLayout, header: dict[str, Any]):
        if layout.num_classes > MAX_CLASSES:
            raise ConfigError(
                f"{layout.num_classes} classes: label maps store class indices as int16 (<= {MAX_CLASSES})"
            )
        self.path, self.layout, self.header = Path(path), layout, header
        self._check_existing()

    def index(self, complete: bool, missing: Sequence[int] = ()) -> dict[str, Any]:
        layout = self.layout
        return {
            "format_version": FORMAT_VERSION,
            "complete": complete,
            "num_classes": layout.num_classes,
            "k": layout.k,
            "height": layout.height,
            "width": layout.width,
            "count": layout.count,
            "samples_per_shard": layout.samples_per_shard,
            "num_shards": layout.num_shards,
            "scores": "teacher logits (before softmax), top-k per position, float16",
            **self.header,
            "missing": sorted(int(index) for index in missing),
        }

    def _check_existing(self) -> None:
        """A folder already there must hold maps of this layout (its index and its finished shards), else
        ConfigError: before any labeling, not after it."""
        index_path = self.path / INDEX_FILE
        if not index_path.exists():
            return
        fix = "give another --out or delete the folder"
        existing = read_index(index_path, fix)
        _layout(existing, index_path, fix)
        planned = self.index(complete=False)
        keys = ("format_version", "num_classes", "k", "height", "width", "count", "samples_per_shard", "fingerprint")
        differing = [key for key in keys if existing.get(key) != planned.get(key)]
        if differing:
            details = ", ".join(f"{key} {existing.get(key)} -> {planned.get(key)}" for key in differing)
            raise ConfigError(
                f"{index_path}: this folder holds label maps made differently ({details}); "
                "give another --out or delete the folder"
            )
        for shard in range(self.layout.num_shards):
            folder = self.path / shard_name(shard)
            if folder.exists():
                expected = (len(self.layout.shard_range(shard)), self.layout.k, self.layout.height, self.layout.width)
                open_shard(folder, expected, self.path)
                self.shard_missing(shard)

    def write_header(self) -> None:
        """``index.json`` marked incomplete: the layout of a generation under way."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(
                f"--out {self.path}: cannot create the folder ({error}); choose a writable place"
            ) from None
        for partial in self.path.glob(".shard-*.partial-*"):  # left by a killed run; no rank writes yet
            shutil.rmtree(partial, ignore_errors=True)
        _write_json_atomically(self.path / INDEX_FILE, self.index(complete=False))

    def finished_shards(self) -> set[int]:
        return {shard for shard in range(self.layout.num_shards) if (self.path / shard_name(shard)).is_dir()}

    def shard_missing(self, shard: int) -> list[int]:
        path = self.path / shard_name(shard) / "missing.json"
        try:
            missing = json.loads(path.read_text())
        except (OSError, ValueError) as error:  # ValueError: not JSON, or not UTF-8
            raise ConfigError(f"{path} cannot be read ({error}); {_remake_shard(path.parent, self.path)}") from None
        if not isinstance(missing, list) or not all(isinstance(index, int) for index in missing):
            raise ConfigError(f"{path} is not a list of sample indices; {_remake_shard(path.parent, self.path)}")
        return missing

    def write_shard(self, shard: int, scores: np.ndarray, indices: np.ndarray, missing: Sequence[int]) -> None:
        """Shard ``shard`` (its ``(n, k, H, W)`` scores and indices), written to a temporary folder and
        renamed into place whole."""
        expected = (len(self.layout.shard_range(shard)), self.layout.k, self.layout.height, self.layout.width)
        if scores.shape != expected or indices.shape != expected:
            raise ValueError(f"shard {shard}: shapes {scores.shape}, {indices.shape}; expected {expected}")
        final = self.path / shard_name(shard)
        partial = self.path / f".{shard_name(shard)}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        np.save(partial / "scores.npy", scores.astype(np.float16, copy=False))
        np.save(partial / "indices.npy", indices.astype(np.int16, copy=False))
        (partial / "missing.json").write_text(json.dumps(sorted(int(index) for index in missing)))
        for file in partial.iterdir():
            _fsync(file)
        os.replace(partial, final)

    def write_index(self) -> dict[str, Any]:
        """``index.json`` marked complete, with the missing images of every shard."""
        missing = [index for shard in range(self.layout.num_shards) for index in self.shard_missing(shard)]
        index = self.index(complete=True, missing=missing)
        _write_json_atomically(self.path / INDEX_FILE, index)
        return index


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _write_json_atomically(path: Path, value: Any) -> None:
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(value, indent=1) + "\n")
    _fsync(partial)
    os.replace(partial, path)


# --- reading ------------------------------------------------------------------------------------

LAYOUT_KEYS = ("count", "num_classes", "k", "height", "width", "samples_per_shard")
NPY_MAGIC = b"\x93NUMPY"
ARRAY_ERRORS = (OSError, ValueError, EOFError)
"""What ``np.load`` raises on a file that is no ``.npy`` array: a folder, no permission, pickled or random
bytes, a header cut off, data shorter than its header says."""


def read_index(path: Path, fix: str) -> dict[str, Any]:
    """``index.json`` of a folder of label maps, as a dict; a folder in its place, an unreadable file or one
    that is not a JSON object is a ConfigError naming it, with ``fix``."""
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except OSError as error:
        raise ConfigError(f"{path} cannot be read ({error.strerror or error}); {fix}") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"{path} is not valid JSON ({error}); {fix}") from None
    if not isinstance(index, dict):
        raise ConfigError(f"{path} holds a JSON {type(index).__name__}, not the index of label maps; {fix}")
    return index


def _remake_shard(folder: Path, maps: Path) -> str:
    return f"delete {folder} and rerun `vitrain label` with --out {maps} to make it again"


def open_shard(folder: Path, expected: tuple[int, ...], maps: Path) -> tuple[np.ndarray, np.ndarray]:
    """A shard's memory-mapped scores and indices, checked for shape ``expected`` and dtype (cheap: the
    headers); a missing shard, a file in the folder's place or an array file that is not one of that shape is
    a ConfigError naming the file (``maps``: the folder of label maps)."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{folder} is a file where a shard folder belongs; {_remake_shard(folder, maps)}")
    arrays = []
    for name, dtype in (("scores", np.float16), ("indices", np.int16)):
        path = folder / f"{name}.npy"
        try:
            with open(path, "rb") as handle:
                head = handle.read(len(NPY_MAGIC))
            if head != NPY_MAGIC:  # np.load would try it as a pickle, and advise loading that unsafely
                raise ValueError("0 bytes" if not head else "not a .npy file")
            array = np.load(path, mmap_mode="r")
        except FileNotFoundError as error:
            raise ConfigError(
                f"{error.filename} is missing: the label maps are incomplete; rerun `vitrain label` with --out "
                f"{maps} to make the missing shards"
            ) from None
        except ARRAY_ERRORS as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error).splitlines()[0]
            raise ConfigError(
                f"{path} cannot be read as an array ({reason[:200] or type(error).__name__}); "
                f"{_remake_shard(folder, maps)}"
            ) from None
        if not isinstance(array, np.ndarray) or array.shape != expected or array.dtype != dtype:
            found = f"{array.dtype} {array.shape}" if isinstance(array, np.ndarray) else type(array).__name__
            raise ConfigError(f"{path}: {found}, expected {np.dtype(dtype)} {expected}; {_remake_shard(folder, maps)}")
        arrays.append(array)
    return arrays[0], arrays[1]


def _layout(index: dict[str, Any], where: Path, fix: str) -> MapLayout:
    """The layout an index records; a key missing or not a whole number is a ConfigError naming the file."""
    values = {}
    for key in LAYOUT_KEYS:
        value = index.get(key)
        smallest = 0 if key == "count" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < smallest:
            raise ConfigError(
                f"{where}: {key} is {value!r}, not a whole number >= {smallest}: not the index `vitrain label` "
                f"writes; {fix}"
            )
        values[key] = value
    missing = index.get("missing", [])
    if not isinstance(missing, list) or not all(isinstance(entry, int) for entry in missing):
        raise ConfigError(f"{where}: missing is not a list of sample indices; {fix}")
    return MapLayout(**values)


def _as_index_array(indices: Sequence[int] | torch.Tensor) -> np.ndarray:
    if isinstance(indices, torch.Tensor):
        return indices.detach().cpu().numpy().astype(np.int64).reshape(-1)
    return np.asarray(indices, dtype=np.int64).reshape(-1)


class LabelMaps:
    """The sharded label maps of a folder written by ``vitrain label``. Memory maps open lazily, once per
    process (a DataLoader worker opens its own after fork or unpickling), one pair per shard."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index_path = self.path / INDEX_FILE
        fix = f"rerun `vitrain label` with --out {self.path}"
        try:
            self.index = read_index(index_path, fix)
        except FileNotFoundError:
            raise ConfigError(
                f"{index_path} does not exist; make label maps with `vitrain label --out {self.path}`"
            ) from None
        if self.index.get("format_version") != FORMAT_VERSION:
            raise ConfigError(
                f"{index_path}: format version {self.index.get('format_version')}, this vitrain reads "
                f"{FORMAT_VERSION}; make the maps again with this version's `vitrain label`"
            )
        if not self.index.get("complete"):
            raise ConfigError(
                f"{index_path}: the label maps are incomplete (an interrupted `vitrain label`); rerun it with the "
                "same arguments to finish them"
            )
        self.layout = _layout(self.index, index_path, fix)
        self.missing = frozenset(self.index.get("missing", ()))
        self._arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.layout.count

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": {}}

    def _shard_arrays(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        if self._pid != os.getpid():  # a forked worker: its own maps
            self._arrays, self._pid = {}, os.getpid()
        if shard not in self._arrays:
            layout = self.layout
            expected = (len(layout.shard_range(shard)), layout.k, layout.height, layout.width)
            self._arrays[shard] = open_shard(self.path / shard_name(shard), expected, self.path)
        return self._arrays[shard]

    def check_layout(self) -> None:
        """Every shard is there, its arrays readable with their shape and dtype (their headers: cheap)."""
        for shard in range(self.layout.num_shards):
            self._shard_arrays(shard)

    def read(self, indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The maps of samples ``indices``: ``(B, 2, k, H, W)`` float32, scores then class indices."""
        wanted = _as_index_array(indices)
        if len(wanted) and (wanted.min() < 0 or wanted.max() >= self.layout.count):
            raise IndexError(f"sample indices must be in [0, {self.layout.count}), got {wanted.min()}..{wanted.max()}")
        layout = self.layout
        out = np.empty((len(wanted), 2, layout.k, layout.height, layout.width), dtype=np.float32)
        shards = wanted // layout.samples_per_shard
        for shard in np.unique(shards):
            rows = np.nonzero(shards == shard)[0]
            offsets = wanted[rows] - shard * layout.samples_per_shard
            scores, classes = self._shard_arrays(int(shard))
            order = np.argsort(offsets, kind="stable")  # memory maps read faster in file order
            out[rows[order], 0] = scores[offsets[order]]
            out[rows[order], 1] = classes[offsets[order]]
        return torch.from_numpy(out)

    def check(self, num_classes: int | None = None, fingerprint: DatasetFingerprint | None = None) -> None:
        """Every shard is there with its shape, scores are finite and class indices in [0, num_classes)
        (but in the slots of missing images); with ``fingerprint``, the maps were made for that data."""
        validate_header(self.index, self.path / INDEX_FILE, num_classes, fingerprint)
        for shard in range(self.layout.num_shards):
            self._check_shard(shard)

    def _check_shard(self, shard: int) -> None:
        layout = self.layout
        scores, classes = self._shard_arrays(shard)  # shapes and dtypes checked
        folder = self.path / shard_name(shard)
        start = shard * layout.samples_per_shard
        present = np.array([start + row not in self.missing for row in range(len(scores))], dtype=bool)
        if not np.isfinite(scores[present]).all():
            raise ConfigError(f"{folder / 'scores.npy'}: non-finite scores; delete the shard and rerun `vitrain label`")
        kept = classes[present]
        if kept.size and (kept.min() < 0 or kept.max() >= layout.num_classes):
            raise ConfigError(
                f"{folder / 'indices.npy'}: class indices {kept.min()}..{kept.max()} outside [0, {layout.num_classes}); "
                "delete the shard and rerun `vitrain label`"
            )


def validate_header(
    index: dict[str, Any], where: Path, num_classes: int | None, fingerprint: DatasetFingerprint | None
) -> None:
    """The maps of ``index`` fit a run of ``num_classes`` classes on data of ``fingerprint``."""
    if num_classes is not None and index["num_classes"] != num_classes:
        raise ConfigError(
            f"{where}: the label maps have {index['num_classes']} classes but the run has {num_classes}; "
            "make maps with a teacher of this data's classes (`vitrain label`)"
        )
    if fingerprint is None:
        return
    made_for = index.get("fingerprint")
    made_for = made_for if isinstance(made_for, dict) else {}
    if made_for.get("count") != fingerprint.count:
        raise ConfigError(
            f"{where}: label maps were made for {made_for.get('count')} images, the training data has "
            f"{fingerprint.count}; make maps for this data with `vitrain label` (same data.* settings)"
        )
    if made_for.get("sha256") != fingerprint.sha256:
        raise ConfigError(
            f"{where}: label maps were made for other training images (the file list differs, same count "
            f"{fingerprint.count}); make maps for this data with `vitrain label`"
        )


# --- the toolbox's published per-image maps ---------------------------------------------------------


def published_map_name(key: str) -> str:
    """The file of an image's map in the toolbox's layout: ``<class folder>/<file name up to its first
    dot>.pt`` (``n01440764/n01440764_10026.JPEG`` -> ``n01440764/n01440764_10026.pt``)."""
    return "/".join(key.split("/")[-2:]).split(".")[0] + ".pt"


class PublishedLabelMaps:
    """The toolbox's one-``.pt``-per-image maps under ``root``, by sample index: ``sample_keys`` are the
    image folder's training files in order, relative to its ``train/`` folder."""

    def __init__(self, root: str | Path, sample_keys: Sequence[str]):
        self.root, self.sample_keys = Path(root), list(sample_keys)
        self.missing: frozenset[int] = frozenset()

    def __len__(self) -> int:
        return len(self.sample_keys)

    def file(self, index: int) -> Path:
        return self.root / published_map_name(self.sample_keys[index])

    def _load(self, index: int) -> torch.Tensor:
        from vitrain.io import CheckpointError, read_torch_file

        path = self.file(index)
        if not path.exists():
            raise ConfigError(
                f"{path} is missing: the published label maps have no map for training image "
                f"{self.sample_keys[index]}; use the maps made for this training set or make them with `vitrain label`"
            )
        try:
            value = read_torch_file(path, "label map", "download or make it again", "a [2, k, H, W] tensor file")
        except CheckpointError as error:
            raise ConfigError(str(error)) from None
        if not isinstance(value, torch.Tensor) or value.ndim != 4 or value.shape[0] != 2:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ConfigError(f"{path} holds {shape}, not a [2, k, H, W] label map; it is not a token-label file")
        return value

    def read(self, indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The maps of samples ``indices``: ``(B, 2, k, H, W)`` float32, scores then class indices."""
        maps = [self._load(int(index)) for index in _as_index_array(indices)]
        return torch.stack(maps).float() if maps else torch.empty(0)

    def check(self, num_classes: int | None = None, fingerprint: DatasetFingerprint | None = None) -> None:
        """Every training image has its file, all of one shape, finite scores, indices in [0, num_classes)."""
        shape = self._load(0).shape if self.sample_keys else None
        for index in range(len(self)):
            value = self._load(index)
            if value.shape != shape:
                raise ConfigError(f"{self.file(index)}: shape {tuple(value.shape)}, the first map's is {tuple(shape)}")
            _check_published_values(value, self.file(index), num_classes)


def _check_published_values(value: torch.Tensor, path: Path, num_classes: int | None) -> None:
    if not torch.isfinite(value[0]).all():
        raise ConfigError(f"{path}: non-finite scores; download or make this map again")
    classes = value[1]
    if classes.min() < 0 or (num_classes is not None and classes.max() >= num_classes):
        raise ConfigError(
            f"{path}: class indices {int(classes.min())}..{int(classes.max())} outside [0, {num_classes}); "
            "these maps were made for another class list: use maps made with a teacher of this data's classes"
        )


def open_label_maps(path: str | Path, sample_keys: Sequence[str], num_classes: int) -> LabelMaps | PublishedLabelMaps:
    """The label maps at ``path`` for training images ``sample_keys`` (in dataset order) of a run of
    ``num_classes`` classes: shards when ``index.json`` is there, else the published per-image layout.
    Checks what is cheap (header, count, fingerprint, the first published file); ``check()`` does the rest."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path} is not a folder of label maps; make them with `vitrain label --out {path}`")
    if (path / INDEX_FILE).exists():
        maps = LabelMaps(path)
        validate_header(maps.index, path / INDEX_FILE, num_classes, DatasetFingerprint.of_keys(sample_keys))
        maps.check_layout()  # a missing or damaged shard stops the run now, not at the step that reads it
        return maps
    published = PublishedLabelMaps(path, sample_keys)
    if not sample_keys:
        raise ConfigError(f"{path}: no training images to read label maps for")
    first = published._load(0)
    _check_published_values(first, published.file(0), num_classes)
    if not published.file(len(published) - 1).is_file():
        raise ConfigError(
            f"{published.file(len(published) - 1)} is missing: {path} has no {INDEX_FILE} and does not hold a map "
            f"per training image ({len(published)}); make label maps for this data with `vitrain label`"
        )
    return published
