"""WebDataset tar shards: ``vitrain shard`` writes an ImageNet-layout folder as shards, ``data.name=webdataset``
trains and evaluates from them.

Writing (:func:`shard_folder`): each split's images go, as the bytes of their files, into tar shards
``DIR/train-000000.tar ...`` and ``DIR/val-000000.tar ...`` (webdataset's ``TarWriter``). A sample is
``KEY.<ext>`` (the image, ``ext`` from its real format), ``KEY.cls`` (the class index as text) and ``KEY.json``
(``{"path": ..., "class": ...}``, the file's path relative to the root and its class name). Every image is
decoded on the way with the rules of :func:`~vitrain.data.decode.decode_image`: bad files are left out and
counted, odd ones are kept as they are and converted when read. Training samples are shuffled across shards
with a fixed seed. ``DIR/index.json`` holds the classes, each shard's sample count and size; the sharding
resumes from ``DIR/progress.json`` (the finished shards, rewritten atomically after each).

Reading (:class:`ShardLoader`): per training epoch the shards are put in an order seeded by (seed, epoch) and
dealt to the ``ranks x workers`` streams (with fewer shards than streams every stream reads all shards and
keeps every n-th sample); each stream passes a seeded shuffle buffer and yields a fixed number of batches, so
every rank takes the same number of steps per epoch (streams start over at their first shard when they run
short). Evaluation reads every validation sample once across the ranks. Bad samples (no image, no label, an
image that does not decode, an unreadable shard) are skipped and counted in the loader's ``bad_images`` log,
as for image folders.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import random
import re
import tarfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm import tqdm

from vitrain.config import ConfigError, DataConfig, DataPlan
from vitrain.data import sources
from vitrain.data.decode import DEFAULT_MAX_IMAGE_PIXELS, BadImage, decode_image
from vitrain.data.device_decode import encoded_tensor
from vitrain.data.loader import (
    BadImageLog,
    ReadCounts,
    TooManyBadImages,
    derive_seed,
    draft_size,
    epoch_permutation,
)
from vitrain.data.transforms import (
    build_eval_transform,
    build_train_transform,
    draws_python_rngs,
    seeded_sample_rngs,
)

INDEX_NAME = "index.json"
PROGRESS_NAME = "progress.json"
SHARD_FORMAT = "vitrain-shards/1"
SPLIT_PREFIXES = {"train": "train", "eval": "val"}
"""image-folder split -> shard file prefix."""
SHUFFLE_SEED = 0
"""Seed of the training samples' order across shards (fixed: a resumed sharding must plan the same shards)."""
SAMPLE_OVERHEAD_BYTES = 2048
"""Tar bytes per sample besides the image (three 512-byte headers, the cls and json entries, padding)."""
FORMAT_EXTENSIONS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp", "TIFF": "tiff"}
log = logging.getLogger("vitrain")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def require_webdataset():
    """The ``webdataset`` module, or a ConfigError saying how to install it."""
    try:
        import webdataset
    except ImportError:
        raise ConfigError(
            "webdataset shards need the webdataset package, which is not installed; "
            "install it with `pip install 'vitrain[webdataset]'` (or `pip install webdataset`)"
        ) from None
    return webdataset


def parse_size(text: str) -> int:
    """Bytes from a size such as ``1GB``, ``500MB``, ``64KiB`` or ``1000000`` (KB/MB/GB decimal, KiB/MiB/GiB binary)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).upper()
    if not match or unit not in _SIZE_UNITS or float(match.group(1)) * _SIZE_UNITS[unit] < 1:
        raise ConfigError(f"--shard-size {text!r}: give a positive size such as 1GB, 500MB or 64KiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


# --- writing -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardTask:
    """One shard to write: its file name and its samples ``(key, image path, class index)``."""

    name: str
    samples: tuple[tuple[str, str, int], ...]


def plan_split(samples: list[tuple[str, int]], prefix: str, shard_bytes: int, shuffle: bool) -> list[ShardTask]:
    """Deal a split's samples to shards of about ``shard_bytes`` (by file size, before any decoding, so that a
    resumed sharding plans the same shards); the training split in a fixed shuffled order."""
    order = epoch_permutation(len(samples), SHUFFLE_SEED, 0).tolist() if shuffle else range(len(samples))
    groups: list[list[tuple[str, str, int]]] = []
    size = shard_bytes
    for position, index in enumerate(order):
        path, label = samples[index]
        cost = os.path.getsize(path) + SAMPLE_OVERHEAD_BYTES
        if size + cost > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((f"{position:09d}", path, label))
        size += cost
    return [ShardTask(f"{prefix}-{number:06d}.tar", tuple(group)) for number, group in enumerate(groups)]


def _sample_entries(path: str, root: Path, classes: list[str], label: int, max_pixels: int) -> dict[str, Any]:
    """The tar entries of one image file (raises BadImage for a file that does not decode)."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise BadImage("unreadable", f"{type(error).__name__}: {error}") from None
    decoded = decode_image(data, None, max_pixels, name=Path(path).name)
    extension = FORMAT_EXTENSIONS.get(decoded.format or "", (decoded.format or "bin").lower())
    relative = Path(path).relative_to(root).as_posix()
    return {extension: data, "cls": label, "json": {"path": relative, "class": classes[label]}}


def write_shard(task: ShardTask, out: Path, root: Path, classes: list[str], max_pixels: int) -> dict[str, Any]:
    """Write one shard (to a temporary name, then renamed): its record ``{name, samples, bytes, bad}``."""
    wds = require_webdataset()
    temporary = out / f"{task.name}.partial"
    bad, count, extensions = [], 0, set()
    with open(temporary, "wb") as handle:
        writer = wds.TarWriter(handle)
        for key, path, label in task.samples:
            try:
                entries = _sample_entries(path, root, classes, label, max_pixels)
            except BadImage as error:
                bad.append([Path(path).relative_to(root).as_posix(), error.reason, error.detail])
                continue
            writer.write({"__key__": key, **entries})
            extensions.update(entries.keys() - {"cls", "json"})
            count += 1
        writer.close()
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, out / task.name)
    size = (out / task.name).stat().st_size
    return {"name": task.name, "samples": count, "bytes": size, "bad": bad, "image_keys": sorted(extensions)}


def write_json_atomically(path: Path, value: Any) -> None:
    """Write JSON to a temporary file and rename it over ``path``: a reader sees the old file or the new one."""
    temporary = path.with_name(path.name + ".partial")
    temporary.write_text(json.dumps(value, indent=1))
    os.replace(temporary, path)


def _load_progress(out: Path, plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The finished shards recorded by an earlier sharding into ``out`` with the same plan (whose files exist)."""
    path = out / PROGRESS_NAME
    if not path.is_file():
        return {}
    progress = json.loads(path.read_text())
    if progress.get("plan") != plan:
        raise ConfigError(
            f"--out {out}: it holds shards of another sharding (other root, shard size or files: {path}); "
            "give an empty folder, or delete it to start again"
        )
    return {name: record for name, record in progress["shards"].items() if (out / name).is_file()}


def _run_tasks(tasks: list[ShardTask], write: Callable, workers: int) -> Iterator[tuple[ShardTask, dict[str, Any]]]:
    """Each task with its record, in order (written in ``workers`` processes; 0 or 1: in this one)."""
    if workers <= 1 or len(tasks) < 2:
        yield from ((task, write(task)) for task in tasks)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(write, task) for task in tasks]
        yield from ((task, future.result()) for task, future in zip(tasks, futures, strict=True))


def _split_index(tasks: list[ShardTask], done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    records = [done[task.name] for task in tasks]
    bad = [entry for record in records for entry in record["bad"]]
    reasons: dict[str, int] = {}
    for _, reason, _ in bad:
        reasons[reason] = reasons.get(reason, 0) + 1
    return {
        "samples": sum(record["samples"] for record in records),
        "bad": dict(sorted(reasons.items())),
        "bad_files": bad,
        "image_keys": sorted({key for record in records for key in record["image_keys"]}),
        "shards": [{key: record[key] for key in ("name", "samples", "bytes")} for record in records],
    }


def shard_folder(
    root: str | Path,
    out: str | Path,
    shard_bytes: int = 10**9,
    workers: int | None = None,
    progress: bool = False,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> dict[str, Any]:
    """Write an ImageNet-layout folder (``train/<class>/*``, ``val/<class>/*``) as tar shards of about
    ``shard_bytes`` into ``out`` and return the index it writes to ``out/index.json``. Shards finished by an
    earlier call with the same arguments are kept; ``workers`` processes write shards side by side (default:
    one per CPU core)."""
    require_webdataset()
    source = DataConfig(name="imagefolder", root=Path(root))
    root = sources.image_folder_root(source)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    splits = {split: sources.image_folder_samples(root, split, source.val_fraction) for split in SPLIT_PREFIXES}
    classes = splits["train"][1]
    if not splits["train"][0]:
        raise ConfigError(f"ROOT {root}: no images under {root}/train (extensions {sources.IMAGE_EXTENSIONS})")
    tasks = {
        split: plan_split(samples, SPLIT_PREFIXES[split], shard_bytes, shuffle=split == "train")
        for split, (samples, _) in splits.items()
    }
    plan = {"root": str(root.resolve()), "shard_bytes": shard_bytes, "files": {s: len(v[0]) for s, v in splits.items()}}
    done = _load_progress(out, plan)
    todo = [task for split_tasks in tasks.values() for task in split_tasks if task.name not in done]
    write = functools.partial(write_shard, out=out, root=root, classes=classes, max_pixels=max_image_pixels)
    total = sum(len(task.samples) for split_tasks in tasks.values() for task in split_tasks)
    with tqdm(total=total, disable=not progress, unit="img", desc="shard") as bar:
        bar.update(total - sum(len(task.samples) for task in todo))
        for task, record in _run_tasks(todo, write, (os.cpu_count() or 1) if workers is None else workers):
            done[record["name"]] = record
            write_json_atomically(out / PROGRESS_NAME, {"plan": plan, "shards": done})
            for path, reason, detail in record["bad"]:
                log.warning("bad image left out of the shards: %s (%s: %s)", root / path, reason, detail)
            bar.update(len(task.samples))
    index = {"format": SHARD_FORMAT, "classes": classes}
    index["splits"] = {SPLIT_PREFIXES[split]: _split_index(tasks[split], done) for split in SPLIT_PREFIXES}
    index["total_bytes"] = sum(record["bytes"] for record in done.values())
    write_json_atomically(out / INDEX_NAME, index)
    return index


# --- finding the shards ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardSet:
    """One split's shards: their URLs (local paths, ``pipe:`` commands) and sample counts."""

    urls: tuple[str, ...]
    counts: tuple[int, ...]

    @property
    def num_samples(self) -> int:
        return sum(self.counts)


@dataclasses.dataclass(frozen=True)
class ShardSource:
    """The training and evaluation shards of ``data.root`` and what resolve needs to know of them."""

    train: ShardSet
    eval: ShardSet
    num_classes: int
    classes: tuple[str, ...] | None
    """Class names (from index.json; None for shards without one)."""
    counted: bool
    """True when the counts were found by reading every shard (no index.json)."""


def _is_remote(url: str) -> bool:
    return url.startswith("pipe:") or "://" in url


def expand_pattern(pattern: str, what: str) -> list[str]:
    """The URLs of a brace pattern (``train-{000000..000127}.tar``); local files must all exist."""
    import braceexpand

    urls = list(braceexpand.braceexpand(pattern))
    local = [url for url in urls if not _is_remote(url)]
    missing = [url for url in local if not Path(url).is_file()]
    if local and len(missing) == len(local):
        raise ConfigError(
            f"{what}: the pattern {pattern!r} matches no file (e.g. {missing[0]}); check the folder and the brace "
            "range, e.g. DIR/train-{000000..000127}.tar"
        )
    if missing:
        raise ConfigError(
            f"{what}: {len(missing)} of the {len(urls)} shards of {pattern!r} are missing (e.g. {missing[0]}); "
            "copy them or narrow the brace range"
        )
    return urls


def _eval_pattern(config: DataConfig, pattern: str) -> str:
    if config.wds_eval_shards:
        return config.wds_eval_shards
    head, _, name = pattern.rpartition("/")
    if "train" not in name:
        raise ConfigError(
            f"data.root: {pattern!r} names no 'train' to replace by 'val' for the evaluation shards; "
            "set data.wds_eval_shards to their pattern"
        )
    at = name.rindex("train")
    return f"{head}/" * bool(head) + name[:at] + "val" + name[at + len("train") :]


def _check_index_shards(folder: Path, split: dict[str, Any]) -> ShardSet:
    """A split of index.json as a ShardSet, each shard checked to exist with the size the index gives."""
    for shard in split["shards"]:
        path = folder / shard["name"]
        size = path.stat().st_size if path.is_file() else None
        if size != shard["bytes"]:
            found = "is missing" if size is None else f"has {size} bytes, index.json says {shard['bytes']}"
            raise ConfigError(
                f"data.root: shard {path} {found} (truncated or incomplete copy); copy it again, or rerun "
                f"`vitrain shard ROOT --out {folder}` (it rewrites only what is not finished)"
            )
    return ShardSet(
        tuple(str(folder / s["name"]) for s in split["shards"]), tuple(s["samples"] for s in split["shards"])
    )


def _source_from_index(folder: Path, config: DataConfig) -> ShardSource:
    index = json.loads((folder / INDEX_NAME).read_text())
    train, evaluation = (_check_index_shards(folder, index["splits"][prefix]) for prefix in ("train", "val"))
    keys = config.wds_image_keys.split(";")
    unread = sorted({key for split in index["splits"].values() for key in split["image_keys"]} - set(keys))
    if unread:
        raise ConfigError(
            f"data.root: the shards of {folder} hold images as {unread}, not in data.wds_image_keys="
            f"{config.wds_image_keys!r}; add them: data.wds_image_keys='{';'.join(keys + unread)}'"
        )
    return ShardSource(train, evaluation, len(index["classes"]), tuple(index["classes"]), counted=False)


def _count_shards(urls: list[str], config: DataConfig) -> tuple[ShardSet, int]:
    """Count the samples (and the largest class index) of shards without an index, by reading them all."""
    counts, top = [], -1
    for url in urls:
        count = 0
        for _, sample in read_shard(url):
            if "__error__" in sample:
                raise ConfigError(
                    f"data.root: shard {url} cannot be read ({sample['__error__']}); it is truncated or no tar: "
                    "copy it again or write it again"
                )
            label = sample_label(sample, config.wds_label_key)
            top = max(top, label if isinstance(label, int) else -1)
            count += 1
        counts.append(count)
    return ShardSet(tuple(urls), tuple(counts)), top


def _find_source(config: DataConfig) -> ShardSource:
    root = config.root
    if root is None:
        raise ConfigError(
            "data.root is required for data.name=webdataset; set it to a folder written by `vitrain shard` or to "
            "the training shards' pattern, e.g. DIR/train-{000000..000127}.tar"
        )
    folder = Path(root) if not _is_remote(str(root)) else None
    if folder is not None and folder.is_dir() and (folder / INDEX_NAME).is_file():
        return _source_from_index(folder, config)
    if folder is not None and folder.is_dir():
        train_pattern = str(folder / "train-*.tar")
        train, evaluation = sorted(folder.glob("train-*.tar")), sorted(folder.glob("val-*.tar"))
        if not train or not evaluation:
            raise ConfigError(
                f"data.root: {folder} holds no index.json and no train-*.tar and val-*.tar shards; "
                f"write them with `vitrain shard IMAGE_ROOT --out {folder}` or give a shard pattern"
            )
        train_urls, eval_urls = [str(path) for path in train], [str(path) for path in evaluation]
    else:
        train_pattern = str(root)
        train_urls = expand_pattern(train_pattern, "data.root")
        eval_urls = expand_pattern(_eval_pattern(config, train_pattern), "data.wds_eval_shards")
    log.info(
        "data.root %s has no %s: reading its %d shards to count them", root, INDEX_NAME, len(train_urls + eval_urls)
    )
    (train, top), (evaluation, _) = _count_shards(train_urls, config), _count_shards(eval_urls, config)
    if top < 0:
        raise ConfigError(
            f"data.root: no training sample of {train_pattern} has a label in its {config.wds_label_key!r} entry; "
            "set data.wds_label_key to the entry holding the class index (e.g. cls, or json:label)"
        )
    return ShardSource(train, evaluation, top + 1, None, counted=True)


@functools.lru_cache(maxsize=8)
def _cached_source(root: str, eval_shards: str | None, image_keys: str, label_key: str) -> ShardSource:
    config = DataConfig(
        name="webdataset", root=root, wds_eval_shards=eval_shards, wds_image_keys=image_keys, wds_label_key=label_key
    )
    return _find_source(config)


def shard_source(config: DataConfig) -> ShardSource:
    """The shards of ``data.root`` with their sample counts: from index.json, or by reading every shard when
    there is none (once per process). ConfigError when webdataset is missing or the shards are not usable."""
    require_webdataset()
    source = _cached_source(str(config.root), config.wds_eval_shards, config.wds_image_keys, config.wds_label_key)
    if not source.train.urls or not source.eval.urls or not source.train.num_samples or not source.eval.num_samples:
        raise ConfigError(f"data.root: {config.root} has no training or no evaluation samples; shard both splits")
    return source


# --- reading ---------------------------------------------------------------------------------------------


def read_shard(url: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(url#key, sample)`` for each sample of a shard (a dict of its entries' bytes by extension). A shard
    that cannot be read to its end (truncated, no tar, a failing pipe) ends with ``(url, {"__error__": why})``."""
    wds = require_webdataset()
    try:
        with contextlib.closing(wds.gopen(url)) as stream:
            files = ({**entry, "__url__": url} for entry in wds.tariterators.tar_file_iterator(stream))
            for sample in wds.tariterators.group_by_keys(files):
                yield f"{url}#{sample['__key__']}", sample
    except (tarfile.TarError, OSError, EOFError, ValueError) as error:
        yield url, {"__error__": f"{type(error).__name__}: {error}"}


def sample_label(sample: dict[str, Any], label_key: str) -> int | str:
    """The class index of a sample by ``data.wds_label_key`` (``cls``, or ``KEY:FIELD`` of a JSON entry), or
    why it has none."""
    key, _, field = label_key.partition(":")
    if key not in sample:
        return f"no '{key}' entry (data.wds_label_key={label_key!r}); entries: {sorted(sample.keys() - {'__key__', '__url__'})}"
    try:
        value = json.loads(sample[key])
        value = value[field] if field else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{value!r} is no class index")
    except (ValueError, KeyError, TypeError) as error:
        return f"entry '{label_key}' holds no class index ({type(error).__name__}: {error})"
    return value


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """What a loader worker needs to produce its batches of one epoch (pickled to each worker)."""

    shards: ShardSet
    train: bool
    transform: Callable | None
    """The per-sample transform; None: send the image bytes (data.decode=gpu decodes them on the device)."""
    draft_side: int
    max_image_pixels: int
    image_keys: tuple[str, ...]
    label_key: str
    num_classes: int
    batch: int
    """Images per batch of this process."""
    rank: int
    ranks: int
    seed: int = 0
    epoch: int = 0
    batches: int = 0
    """Training: batches of this process in the epoch."""
    start_batch: int = 0
    """Training: batches of the epoch this process already took (a resumed epoch)."""
    buffer: int = 0
    limit: int | None = None
    python_rngs: bool = True
    """The transform draws from Python's or NumPy's generators too (seeded per sample then)."""
    known_bad: frozenset[str] = frozenset()
    """Samples found bad before: skipped without decoding (the same samples are skipped when a resumed epoch
    replays its streams)."""


def _decode_sample(spec: StreamSpec, name: str, sample: dict[str, Any], seed: int) -> tuple:
    """``(image tensor, label, bytes of the image entry)``, or the bad event ``(name, reason, detail)`` of a sample
    that has none (:func:`_is_bad` tells them apart)."""
    if "__error__" in sample:
        return name, "unreadable_shard", f"{sample['__error__']}; copy or write the shard again"
    key = next((key for key in spec.image_keys if key in sample), None)
    if key is None:
        entries = sorted(sample.keys() - {"__key__", "__url__"})
        return name, "no_image", f"none of data.wds_image_keys={';'.join(spec.image_keys)} in {entries}"
    label = sample_label(sample, spec.label_key)
    if isinstance(label, str) or label >= spec.num_classes:
        return name, "no_label", label if isinstance(label, str) else f"class {label} >= {spec.num_classes} classes"
    if spec.transform is None:  # data.decode=gpu: the main process decodes on the device
        return (encoded_tensor(sample[key]), seed), label, len(sample[key])
    try:
        decoded = decode_image(sample[key], spec.draft_side, spec.max_image_pixels, name=f"{name}.{key}")
    except BadImage as error:
        return name, error.reason, error.detail
    with seeded_sample_rngs(seed, spec.python_rngs):
        return spec.transform(decoded.image), label, len(sample[key])


def _is_bad(result: tuple) -> bool:
    return isinstance(result[0], str)


def _shuffled(items: Iterator, size: int, rng: random.Random) -> Iterator:
    """``items`` through a shuffle buffer of ``size`` (webdataset's rule: each new item takes the place of a
    randomly drawn one)."""
    if size <= 1:
        yield from items
        return
    buffer: list = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        at = rng.randrange(size)
        yield buffer[at]
        buffer[at] = item
    rng.shuffle(buffer)
    yield from buffer


def _stream_samples(urls: list[str], keep: Callable[[int], bool]) -> Iterator[tuple[str, dict]]:
    """The samples of ``urls`` in order whose running number passes ``keep``."""
    running = 0
    for url in urls:
        for name, sample in read_shard(url):
            if keep(running):
                yield name, sample
            running += 1


def _passes(urls: list[str], keep: Callable[[int], bool], buffer: int, rng: random.Random) -> Iterator:
    """Shuffled passes over the samples, each followed by None, over and over (until a pass has none): a stream
    whose shards fall short of its share starts them over, and only after its last sample of the pass."""
    while True:
        kept = 0
        for item in _shuffled(_stream_samples(urls, keep), buffer, rng):
            kept += 1
            yield item
        if not kept:
            return
        yield None


def deal_shards(order: list[int], counts: tuple[int, ...], needs: list[int]) -> list[list[int]]:
    """Shards (in ``order``) dealt to streams that need ``needs`` samples each: each shard to the stream that
    still needs the most, so every stream gets its share to within a part of one shard."""
    dealt: list[list[int]] = [[] for _ in needs]
    remaining = list(needs)
    for shard in order:
        stream = max(range(len(needs)), key=remaining.__getitem__)
        dealt[stream].append(shard)
        remaining[stream] -= counts[shard]
    return dealt


class _Batcher:
    """Collects decoded samples into batches of ``size``; the bad events and names ride along."""

    def __init__(self, size: int):
        self.size = size
        self.images, self.labels, self.events, self.names, self.bytes_read = [], [], [], [], 0

    def add(self, name: str, result: tuple) -> bool:
        """Add a decoded sample or a bad event; True when the batch is full."""
        if _is_bad(result):
            self.events.append(result)
            return False
        self.images.append(result[0])
        self.labels.append(result[1])
        self.bytes_read += result[2]
        self.names.append(name)
        return len(self.images) == self.size

    def take(self) -> tuple:
        """``(images or None, labels or None, bad events, sample names, ReadCounts)``, and start a new batch; the
        read counts are the bytes of the image entries decoded and their number."""
        images = None
        if self.images:  # data.decode=gpu: (encoded bytes, seed) pairs, as they are
            images = torch.stack(self.images) if isinstance(self.images[0], torch.Tensor) else list(self.images)
        labels = torch.tensor(self.labels, dtype=torch.int64) if self.labels else None
        batch = images, labels, self.events, self.names, (self.bytes_read, len(self.images))
        self.images, self.labels, self.events, self.names, self.bytes_read = [], [], [], [], 0
        return batch


def worker_batches(spec: StreamSpec, worker: int, workers: int) -> Iterator[tuple]:
    """The batches loader worker ``worker`` of ``workers`` produces: ``(images, labels, bad events, names)``."""
    return _train_batches(spec, worker, workers) if spec.train else _eval_batches(spec, worker, workers)


def _keep_all(running: int) -> bool:
    return True


def _in_batches_of(running: int, batch: int, rank: int, ranks: int, stream: int, workers: int) -> bool:
    """Whether sample ``running`` of the epoch falls in this rank's share of a global batch that this stream
    produces (global batch k: rank r's share from stream k % workers), as the image-folder loader deals them."""
    global_batch = batch * ranks
    return (running % global_batch) // batch == rank and (running // global_batch) % workers == stream


def _stream_shards(spec: StreamSpec, stream: int, workers: int) -> tuple[list[str], Callable[[int], bool]]:
    """The shards a training stream reads this epoch and which of their samples it keeps."""
    order = epoch_permutation(len(spec.shards.urls), spec.seed, spec.epoch).tolist()
    if len(order) >= spec.ranks * workers:
        needs = [(spec.batches // workers + (other < spec.batches % workers)) * spec.batch for other in range(workers)]
        dealt = deal_shards(order, spec.shards.counts, needs * spec.ranks)[spec.rank * workers + stream]
        return [spec.shards.urls[i] for i in dealt], _keep_all
    # fewer shards than streams: every stream reads them all and keeps the samples of its batches
    keep = functools.partial(_in_batches_of, batch=spec.batch, rank=spec.rank, ranks=spec.ranks, stream=stream)
    return [spec.shards.urls[i] for i in order], functools.partial(keep, workers=workers)


def _train_batches(spec: StreamSpec, worker: int, workers: int) -> Iterator[tuple]:
    # The DataLoader takes batches from its workers in turn, starting with worker 0: a resumed epoch renumbers
    # them so that worker 0 plays the stream whose batch is due next.
    stream = (worker + spec.start_batch) % workers
    remaining = spec.batches // workers + (stream < spec.batches % workers)
    taken = spec.start_batch // workers + (stream < spec.start_batch % workers)
    rng = random.Random(derive_seed(spec.seed, spec.epoch, spec.rank, stream))
    samples = _passes(*_stream_shards(spec, stream, workers), spec.buffer, rng)
    remaining, skip, position, batcher, useful = remaining - taken, taken * spec.batch, 0, _Batcher(spec.batch), False
    for item in samples if remaining > 0 else ():
        if item is None:  # the end of a pass: go on only if it held a usable sample
            if not useful:
                break
            useful = False
            continue
        name, sample = item
        if name in spec.known_bad:
            continue
        position += 1
        if position <= skip:  # replaying what a resumed epoch already took: no decoding
            useful = True
            continue
        result = _decode_sample(spec, name, sample, derive_seed(spec.seed, spec.epoch, spec.rank, stream, position))
        useful = useful or not _is_bad(result)
        position -= _is_bad(result)
        if batcher.add(name, result):
            yield batcher.take()
            remaining -= 1
            if not remaining:
                return
    yield None, None, batcher.take()[2], [], (0, 0)  # no decodable samples left: the events, no partial batch


def _eval_batches(spec: StreamSpec, worker: int, workers: int) -> Iterator[tuple]:
    # sample p of the split (counted across the shards in order) goes to rank p % ranks: each sample once
    starts = [sum(spec.shards.counts[:i]) for i in range(len(spec.shards.counts))]
    limit = spec.shards.num_samples if spec.limit is None else spec.limit
    batcher = _Batcher(spec.batch)
    for shard in range(worker, len(spec.shards.urls), workers):
        for position, (name, sample) in enumerate(read_shard(spec.shards.urls[shard]), starts[shard]):
            if position >= limit:
                break
            mine = position % spec.ranks == spec.rank and name not in spec.known_bad
            if mine and batcher.add(name, _decode_sample(spec, name, sample, 0)):
                yield batcher.take()
    if batcher.images or batcher.events:
        yield batcher.take()


class ShardStream(IterableDataset):
    """One epoch of a loader's batches; each DataLoader worker plays its own streams (:func:`worker_batches`)."""

    def __init__(self, spec: StreamSpec):
        self.spec = spec

    def __iter__(self) -> Iterator[tuple]:
        info = get_worker_info()
        return worker_batches(self.spec, info.id if info else 0, info.num_workers if info else 1)


def _as_is(batch: tuple) -> tuple:
    return batch


class ShardLoader:
    """Batches ``(uint8 images, int64 labels)`` from tar shards, like :class:`~vitrain.data.loader.FileLoader`:
    shaped with ``configure(image_size, batch_size)``, positioned with ``start_epoch(epoch, start_sample)``,
    bad samples counted in ``bad_images``. A training epoch is ``num_samples // batch`` global batches."""

    def __init__(self, source: ShardSource, data: DataPlan, train: bool):
        self.source, self.data, self.train = source, data, train
        self.shards = source.train if train else source.eval
        limit = data.source.limit_train if train else data.source.limit_eval
        self.num_samples = min(self.shards.num_samples, limit or self.shards.num_samples)
        split = "training" if train else "evaluation"
        self.bad_images = BadImageLog([], data.source.max_bad_fraction, split, total=self.num_samples)
        self.read_counts: ReadCounts = (0, 0)  # image bytes decoded, images decoded: the loop's read_mb_s, files_s
        self.epoch, self.start_sample, self.image_size, self.batch_size = 0, 0, 0, 0
        self.configure(data.source.image_size, data.batch.global_batch if train else data.batch.eval_batch)

    def configure(self, image_size: int, batch_size: int) -> None:
        """Set the image size and the global batch (a curriculum stage)."""
        config = self.data.source
        self.image_size, self.batch_size = image_size, batch_size
        self.decoder = None
        if config.decode == "gpu":
            from vitrain.data.device_decode import DeviceDecoder

            self.transform, self.decoder = None, DeviceDecoder(config, image_size, self.train, self.data.device)
        elif self.train:
            self.transform = build_train_transform(config, self.data.mean, image_size)
        else:
            self.transform = build_eval_transform(config, image_size)

    def start_epoch(self, epoch: int, start_sample: int = 0) -> None:
        """Position the next iteration: epoch ``epoch``, after its first ``start_sample`` images (all ranks)."""
        self.epoch, self.start_sample = epoch, start_sample

    def __len__(self) -> int:
        share = self.data.batch.per_process(self.batch_size)
        if self.train:
            return self.num_samples // self.batch_size
        world = self.data.world
        return -(-len(range(world.data_rank, self.num_samples, world.data_size)) // share)

    def stream_spec(self) -> StreamSpec:
        """What the workers of the next iteration need."""
        config, world = self.data.source, self.data.world
        share = self.data.batch.per_process(self.batch_size)
        return StreamSpec(
            shards=self.shards,
            train=self.train,
            transform=self.transform,
            draft_side=draft_size(config, self.image_size, self.train),
            max_image_pixels=config.max_image_pixels,
            image_keys=tuple(config.wds_image_keys.split(";")),
            label_key=config.wds_label_key,
            num_classes=self.source.num_classes,
            batch=share,
            rank=world.data_rank,
            ranks=world.data_size,
            seed=self.data.seed,
            epoch=self.epoch,
            batches=len(self) if self.train else 0,
            start_batch=self.start_sample // self.batch_size if self.train else 0,
            buffer=config.wds_shuffle_buffer,
            limit=self.num_samples,
            known_bad=frozenset(self.bad_images.bad),
            python_rngs=draws_python_rngs(self.transform),
        )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        workers = self.data.source.num_workers
        loader = DataLoader(
            ShardStream(self.stream_spec()),
            batch_size=None,
            collate_fn=_as_is,
            num_workers=workers,
            pin_memory=self.data.device.startswith("cuda"),
            prefetch_factor=4 if workers > 0 else None,
        )
        yielded = 0
        for images, labels, events, names, (num_bytes, num_samples) in loader:
            self.read_counts = (self.read_counts[0] + num_bytes, self.read_counts[1] + num_samples)
            if self.decoder is not None and images is not None:
                encoded, seeds = zip(*images, strict=True)
                images, labels, decode_events = self.decoder(encoded, labels, seeds, names)
                events = [*events, *decode_events]
            if events:
                self.bad_images.record(events)  # raises past data.max_bad_fraction
            if images is not None:
                yielded += 1
                yield images, labels
        if self.train and not yielded and len(self) > self.start_sample // self.batch_size:
            raise TooManyBadImages(self.bad_images.describe_abort(no_image_decodes=True))


def build_shard_loaders(data: DataPlan) -> tuple[ShardLoader, ShardLoader]:
    """Train and eval loaders of ``data.name=webdataset``."""
    source = shard_source(data.source)
    return ShardLoader(source, data, train=True), ShardLoader(source, data, train=False)
