"""Resumable, epoch-seeded loaders.

Each loader yields ``(uint8 images (B, C, H, W), int64 labels)``, is shaped with
``configure(image_size, batch_size)`` (a curriculum stage) and positioned with
``start_epoch(epoch, start_sample)``. Data order and augmentation are pure functions of
``(seed, epoch, position)``, so a resumed run sees exactly the images the uninterrupted run
would have seen, whatever the worker count, restarts or stage changes. An epoch drops the
remainder that does not fill a training batch.

With several processes (``plan.world``), batch sizes are global: every rank walks the same global
batches and takes its contiguous slice of each (rank r: images r*b .. (r+1)*b - 1 of the batch,
b = global / world size), so the ranks together see exactly what one process would see. Evaluation
shards the eval set (rank r: samples r, r + world, ...); the accuracy sums are reduced across ranks.

Image files that cannot be decoded (``vitrain.data.decode``) are skipped: in training replaced by the
next decodable file, in evaluation left out. Each loader counts them by reason in its ``bad_images``
log (in the main process: the workers send them with the batch) and stops the run past
``data.max_bad_fraction`` of its split.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from vitrain.config import ConfigError, DataConfig, DataPlan
from vitrain.data import sources
from vitrain.data.decode import DEFAULT_MAX_IMAGE_PIXELS, BadImage, decode_image
from vitrain.data.transforms import (
    augment_each_image,
    batch_eval_resize,
    batch_random_erase,
    batch_random_resized_crop,
    batch_random_translate,
    build_eval_transform,
    build_per_image_augment,
    build_train_transform,
    draws_python_rngs,
    eval_resize_size,
    last_crop_geometry,
    seeded_sample_rngs,
)
from vitrain.seeds import derive_seed

Batch = tuple[torch.Tensor, torch.Tensor]
"""``(uint8 images, int64 labels)``; training batches of a plan with ``crop_geometry`` add a third member,
the float64 ``(B, 6)`` geometry: each sample's index in the training set (the one actually used, after a bad
file's replacement), then its :data:`~vitrain.data.transforms.CropGeometry` ``(x1, y1, x2, y2, flipped)``."""
ReadCounts = tuple[int, int]
"""What a data loader read: (bytes of the files decoded, files opened)."""
log = logging.getLogger("vitrain")


def epoch_permutation(count: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(count, generator=torch.Generator().manual_seed(derive_seed(seed, epoch)))


def epoch_order(count: int, seed: int, epoch: int, repeats: int = 1) -> torch.Tensor:
    """The sample index at each position of a training epoch: the epoch's permutation; with repeated
    augmentation (``repeats`` > 1; Hoffer et al. 2020, DeiT's RASampler) each of its first
    ceil(count / repeats) samples ``repeats`` times in a row, cut to ``count`` positions, so an epoch
    keeps its length and the copies of an image fall in the same or the next global batch. Position p
    holds copy ``p % repeats`` of its sample."""
    order = epoch_permutation(count, seed, epoch)
    if repeats == 1:
        return order
    return order[: -(-count // repeats)].repeat_interleave(repeats)[:count]


def sample_seed(seed: int, epoch: int, index: int, copy: int = 0) -> int:
    """The augmentation seed of one occurrence of a sample in an epoch (``copy``: which of its repeats);
    the first copy's is the seed the sample has without repeated augmentation."""
    return derive_seed(seed, epoch, index, copy) if copy else derive_seed(seed, epoch, index)


class InMemoryLoader:
    """Batches of an in-memory dataset, augmented per batch on the dataset's device."""

    def __init__(self, dataset: sources.InMemoryDataset, data: DataPlan, train: bool):
        self.dataset, self.train = dataset, train
        self.rank, self.batches = data.world.data_rank, data.batch
        self.config, self.mean, self.channels = data.source, data.mean, data.in_chans
        self.seed = data.seed
        self.repeats = self.config.repeated_aug if train else 1
        self.geometry = data.crop_geometry and train
        self.epoch, self.start_sample = 0, 0
        self.bad_images = BadImageLog([], 1.0, "in-memory")  # decoded once, nothing to skip
        self.read_counts: ReadCounts | None = None  # no files read while training
        self.configure(self.config.image_size, data.batch.global_batch if train else data.batch.eval_batch)

    def configure(self, image_size: int, batch_size: int) -> None:
        self.image_size, self.batch_size = image_size, batch_size
        augment = build_per_image_augment(self.config, image_size, self.mean, self.channels)
        self.per_image = augment if self.train else None

    def __len__(self) -> int:
        if self.train:
            return len(self.dataset) // self.batch_size
        return -(-len(self._eval_indices()) // self.batches.per_process(self.batch_size))

    def start_epoch(self, epoch: int, start_sample: int = 0) -> None:
        self.epoch, self.start_sample = epoch, start_sample

    def _eval_indices(self) -> torch.Tensor:
        return torch.arange(self.rank, len(self.dataset), self.batches.data_slices)

    def __iter__(self) -> Iterator[Batch]:
        return self._train_batches() if self.train else self._eval_batches()

    def _train_batches(self) -> Iterator[Batch]:
        count, batch = len(self.dataset), self.batch_size
        order = epoch_order(count, self.seed, self.epoch, self.repeats)
        device = self.dataset.images.device
        share = self.batches.per_process(batch)
        local = slice(self.rank * share, (self.rank + 1) * share)
        for start in range(self.start_sample, count - batch + 1, batch):  # drops the partial batch
            indices = order[start : start + batch].to(device)
            images, labels = self.dataset.images[indices], self.dataset.labels[indices]
            generator = torch.Generator(device).manual_seed(derive_seed(self.seed, self.epoch, start))
            # the whole global batch draws its crops (cheap at in-memory sizes), so every image gets
            # the crop it gets in a one-process run; this rank keeps its slice
            crop = batch_random_resized_crop(
                images,
                self.image_size,
                self.config.scale,
                self.config.ratio,
                self.config.hflip,
                generator,
                self.geometry,
            )
            images, where = crop if self.geometry else (crop, None)
            images = batch_random_translate(images, self.config.translate, generator)
            if self.per_image is not None:
                # seeded per image, so only this rank's slice needs the (slow, per-image) work
                positions = range(start + local.start, start + local.stop)
                images[local] = augment_each_image(images[local], self.per_image, self._seeds(order, positions))
            images = batch_random_erase(images, self.config.random_erase, generator)
            if where is None:
                yield images[local], labels[local]
            else:
                geometry = torch.cat([order[start : start + batch, None].double(), where], 1)
                yield images[local], labels[local], geometry[local]

    def _seeds(self, order: torch.Tensor, positions: range) -> list[int]:
        return [
            sample_seed(self.seed, self.epoch, int(order[position]), position % self.repeats) for position in positions
        ]

    def _eval_batches(self) -> Iterator[Batch]:
        indices = self._eval_indices().to(self.dataset.images.device)
        batch = self.batches.per_process(self.batch_size)
        for start in range(0, len(indices), batch):
            chunk = indices[start : start + batch]
            images = batch_eval_resize(self.dataset.images[chunk], self.image_size, self.config.crop_pct)
            yield images, self.dataset.labels[chunk]


class SeededSampler(Sampler):
    """Yields ``(index, sample_seed)``: an epoch-seeded permutation (or identity), from a start.

    With ``world_size`` > 1, training positions go by global batches of ``batch_size`` and this rank
    yields its slice of each; evaluation (no shuffle) yields every ``world_size``-th sample. With
    ``repeats`` > 1 (training) the order repeats each sample (:func:`epoch_order`), each copy with its
    own seed."""

    def __init__(self, count: int, seed: int, shuffle: bool, rank: int = 0, world_size: int = 1, repeats: int = 1):
        self.count, self.seed, self.shuffle = count, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.repeats = repeats if shuffle else 1
        self.epoch, self.start, self.batch_size, self.share = 0, 0, 1, 1

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def set_batch_size(self, batch_size: int, share: int) -> None:
        """``batch_size``: the global batch; ``share``: this rank's part of it."""
        self.batch_size, self.share = batch_size, share

    def positions(self) -> range | list[int]:
        if self.world_size == 1:
            return range(self.start, self.count)
        if not self.shuffle:
            return range(self.start + self.rank, self.count, self.world_size)
        local = self.share
        return [
            batch_start + self.rank * local + offset
            for batch_start in range(self.start, self.count - self.batch_size + 1, self.batch_size)
            for offset in range(local)
        ]

    def __len__(self) -> int:
        return len(self.positions())

    def __iter__(self):
        if self.shuffle:
            order = epoch_order(self.count, self.seed, self.epoch, self.repeats)
        else:
            order = torch.arange(self.count)
        for position in self.positions():
            index = int(order[position])
            yield index, sample_seed(self.seed, self.epoch, index, position % self.repeats)


def draft_size(config: DataConfig, image_size: int, train: bool) -> int:
    """The smallest decoded side that loses no detail in the output: the eval resize, or for
    training the side at which the smallest RandomResizedCrop still has ``image_size`` pixels."""
    if train:
        return math.ceil(image_size / math.sqrt(config.scale[0]))
    return eval_resize_size(image_size, config.crop_pct)


class TooManyBadImages(ConfigError):
    """More of a split's image files failed to decode than ``data.max_bad_fraction`` allows (CLI exit 2)."""


BadEvent = tuple[int, str, str]
"""A sample that failed to decode: (index, reason code, detail)."""


class BadImageLog:
    """The bad image files one loader met (in this process): path -> (reason, detail). Each is logged
    once, with its reason; past ``max_fraction`` of the split's files, :class:`TooManyBadImages`."""

    EXAMPLES = 3

    def __init__(self, samples: list[tuple[str, int]], max_fraction: float, split: str, total: int | None = None):
        self.samples, self.max_fraction, self.split = samples, max_fraction, split
        self.total = len(samples) if total is None else total  # the denominator of the bad fraction
        self.bad: dict[str, tuple[str, str]] = {}

    def record(self, events: list[BadEvent] | list[tuple[str, str, str]]) -> None:
        """Log and count bad samples, each ``(index into samples, reason, detail)`` or ``(name, reason, detail)``
        where the loader has no sample list (shards: ``url#key``)."""
        for index, reason, detail in events:
            path = index if isinstance(index, str) else self.samples[index][0]
            if path not in self.bad:
                self.bad[path] = (reason, detail)
                log.warning("bad %s image skipped: %s (%s: %s)", self.split, path, reason, detail)
        if len(self.bad) > self.max_fraction * self.total:
            raise TooManyBadImages(self.describe_abort())

    def counts(self) -> dict[str, int]:
        """Bad files by reason code."""
        counts: dict[str, int] = {}
        for reason, _ in self.bad.values():
            counts[reason] = counts.get(reason, 0) + 1
        return dict(sorted(counts.items()))

    def describe_abort(self, no_image_decodes: bool = False) -> str:
        """One line: how many files are bad, by reason with example paths, and the two ways on."""
        examples = {
            reason: [path for path, (other, _) in self.bad.items() if other == reason] for reason in self.counts()
        }
        listing = "; ".join(
            f"{reason} {len(paths)} (e.g. {', '.join(paths[: self.EXAMPLES])})" for reason, paths in examples.items()
        )
        if no_image_decodes:
            headline = f"none of the {self.total} {self.split} images decodes"
        else:
            headline = (
                f"{len(self.bad)} of the {self.total} {self.split} images cannot be decoded "
                f"({100 * len(self.bad) / max(self.total, 1):.1f}% > data.max_bad_fraction={self.max_fraction:g})"
            )
        return (
            f"data.root: {headline}: {listing}; list them all with `vitrain check-data <data.root>` and repair "
            "or remove them, or raise data.max_bad_fraction to train without them"
        )

    def state_dict(self) -> dict[str, list[str]]:
        return {path: [reason, detail] for path, (reason, detail) in self.bad.items()}

    def load_state_dict(self, state: dict[str, list[str]]) -> None:
        self.bad = {path: (reason, detail) for path, (reason, detail) in state.items()}


class ImageFileDataset(Dataset):
    """Decodes ``(path, label)`` samples to RGB (``decode_image``) and applies a seeded v2 transform.

    JPEGs decode at a reduced scale (Pillow ``draft``: 1/2, 1/4 or 1/8 in the DCT) when the
    output is small, so low-resolution curriculum stages also make decoding cheaper.

    A file that cannot be decoded is reported with the item (``BadEvent``s, collected in the main
    process) and, with ``replace_bad`` (training), replaced by the next sample in file order that
    decodes (usually one of the same class), transformed with the original slot's seed: the same
    slot always gets the same replacement, whatever the workers, the epoch order or a restart.
    Without ``replace_bad`` (evaluation) the item has no image and the batch drops it.

    With ``geometry`` (the transform from :func:`~vitrain.data.transforms.build_train_transform`), an item
    also carries the index of the file used and its crop box and flip (:data:`Batch`'s geometry row).
    """

    def __init__(
        self,
        samples: list[tuple[str, int]],
        transform,
        draft_side: int,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        replace_bad: bool = True,
        geometry: bool = False,
    ):
        self.samples, self.transform, self.draft_side = samples, transform, draft_side
        self.max_image_pixels, self.replace_bad, self.geometry = max_image_pixels, replace_bad, geometry
        self.python_rngs = draws_python_rngs(transform)
        self.known_bad: dict[int, BadEvent] = {}  # per worker process: a bad file is decoded once
        self.bytes_read, self.files_opened = 0, 0  # per process, since the last take_read_counts()

    def __len__(self) -> int:
        return len(self.samples)

    def _try_decode(self, index: int) -> Image.Image | BadEvent:
        if index in self.known_bad:
            return self.known_bad[index]
        path = self.samples[index][0]
        self.files_opened += 1
        try:
            image = decode_image(path, self.draft_side, self.max_image_pixels).image
            self.bytes_read += os.path.getsize(path)
            return image
        except BadImage as error:
            self.known_bad[index] = (index, error.reason, error.detail)
            return self.known_bad[index]

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor | None, int, list[BadEvent], tuple | None]:
        index, seed = key
        events: list[BadEvent] = []
        attempts = len(self.samples) if self.replace_bad else 1
        for candidate in (index + offset for offset in range(attempts)):
            used = candidate % len(self.samples)
            decoded = self._try_decode(used)
            if isinstance(decoded, tuple):
                events.append(decoded)
                continue
            # The transform draws from the global RNGs; seeded per sample, without disturbing the
            # caller's streams, augmentation is independent of workers and restarts.
            with seeded_sample_rngs(seed, self.python_rngs):
                tensor = self.transform(decoded)
            geometry = (float(used), *last_crop_geometry(self.transform)) if self.geometry else None
            return tensor, self.samples[used][1], events, geometry
        return None, self.samples[index][1], events, None

    def take_read_counts(self) -> ReadCounts:
        """Bytes decoded and files opened in this process since the last call; the counters restart at 0."""
        counts = self.bytes_read, self.files_opened
        self.bytes_read, self.files_opened = 0, 0
        return counts


class CountedReads(Dataset):
    """An :class:`ImageFileDataset` whose items also carry the :data:`ReadCounts` of their reading (the last
    member), so the counts reach the main process with the batch, as the bad events do."""

    def __init__(self, files: ImageFileDataset):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, key: tuple[int, int]):
        return *self.files[key], self.files.take_read_counts()


def collate_counted(items: list) -> tuple:
    """:func:`collate_decoded` of :class:`CountedReads` items, then their summed :data:`ReadCounts`."""
    reads = (sum(item[-1][0] for item in items), sum(item[-1][1] for item in items))
    return *collate_decoded([item[:-1] for item in items]), reads


def collate_decoded(items: list[tuple[torch.Tensor | None, int, list[BadEvent], tuple | None]]):
    """``(images, labels, bad events, geometry)`` of a batch; items without an image are left out (images,
    labels and geometry are None when none is left; geometry also when the items carry none)."""
    kept = [item for item in items if item[0] is not None]
    images, labels = default_collate([(image, label) for image, label, *_ in kept]) if kept else (None, None)
    rows = [item[3] for item in kept if item[3] is not None]
    geometry = torch.tensor(rows, dtype=torch.float64) if rows else None
    return images, labels, [event for _, _, events, _ in items for event in events], geometry


class EncodedFiles(Dataset):
    """The files' bytes, for decoding on the device (``data.decode=gpu``): ``(uint8 tensor, label, seed, index,
    ReadCounts)`` per sample."""

    def __init__(self, samples: list[tuple[str, int]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: tuple[int, int]):
        from vitrain.data.device_decode import encoded_tensor

        index, seed = key
        try:
            data = Path(self.samples[index][0]).read_bytes()
        except OSError:
            data = b""  # the decoder reports an empty item as a bad image
        return encoded_tensor(data), self.samples[index][1], seed, index, (len(data), 1)


def collate_encoded(items: list) -> tuple:
    """``(encoded tensors, labels, seeds, indices, ReadCounts)`` of a batch of :class:`EncodedFiles` items."""
    encoded, labels, seeds, indices, reads = zip(*items, strict=True)
    counts = (sum(count[0] for count in reads), len(reads))
    return list(encoded), torch.tensor(labels, dtype=torch.int64), list(seeds), list(indices), counts


class FileLoader:
    """A torch DataLoader over image files, positioned through its seeded sampler; rebuilt (with
    its workers) when a curriculum stage changes the image or batch size."""

    def __init__(self, samples: list[tuple[str, int]], data: DataPlan, train: bool):
        self.samples, self.data, self.train = samples, data, train
        split = "training" if train else "evaluation"
        self.bad_images = BadImageLog(samples, data.source.max_bad_fraction, split)
        world = data.world
        self.sampler = SeededSampler(
            len(samples), data.seed, train, world.data_rank, world.data_size, data.source.repeated_aug
        )
        self.image_size, self.batch_size, self.loader = 0, 0, None
        self.bytes_read, self.files_opened = 0, 0  # by the workers of this loader, ever
        self.configure(data.source.image_size, data.batch.global_batch if train else data.batch.eval_batch)

    def configure(self, image_size: int, batch_size: int) -> None:
        if (image_size, batch_size) == (self.image_size, self.batch_size):
            return
        config = self.data.source
        self.image_size, self.batch_size = image_size, batch_size
        self.decoder = None
        if config.decode == "gpu":
            from vitrain.data.device_decode import DeviceDecoder

            self.decoder = DeviceDecoder(config, image_size, self.train, self.data.device)
        workers = config.num_workers
        share = self.data.batch.per_process(batch_size)
        self.sampler.set_batch_size(batch_size, share)
        self.loader = DataLoader(
            EncodedFiles(self.samples) if self.decoder else CountedReads(self._decoding_dataset()),
            batch_size=share,
            sampler=self.sampler,
            collate_fn=collate_encoded if self.decoder else collate_counted,
            drop_last=self.train,
            num_workers=workers,
            pin_memory=self.data.device.startswith("cuda"),
            persistent_workers=workers > 0,
            prefetch_factor=4 if workers > 0 else None,
        )

    def _decoding_dataset(self) -> ImageFileDataset:
        """The files decoded and transformed in the workers, at the configured image size."""
        config, size = self.data.source, self.image_size
        transform = (
            build_train_transform(config, self.data.mean, size) if self.train else build_eval_transform(config, size)
        )
        return ImageFileDataset(
            self.samples,
            transform,
            draft_size(config, size, self.train),
            config.max_image_pixels,
            replace_bad=self.train,
            geometry=self.train and self.data.crop_geometry,
        )

    def __len__(self) -> int:
        return len(self.loader)

    def start_epoch(self, epoch: int, start_sample: int = 0) -> None:
        self.sampler.set_position(epoch, start_sample)

    @property
    def read_counts(self) -> ReadCounts:
        """Bytes of the files decoded and files opened by this loader so far (batches received)."""
        return self.bytes_read, self.files_opened

    def __iter__(self) -> Iterator[Batch]:
        batches = self._decoded_on_device() if self.decoder else self.loader
        for images, labels, events, geometry, (num_bytes, num_files) in batches:
            self.bytes_read += num_bytes
            self.files_opened += num_files
            if events:
                self.bad_images.record(events)  # raises past data.max_bad_fraction
            if images is None:
                if self.train:
                    raise TooManyBadImages(self.bad_images.describe_abort(no_image_decodes=True))
                continue  # an evaluation batch of bad files only
            yield (images, labels) if geometry is None else (images, labels, geometry)

    def _decoded_on_device(self) -> Iterator[tuple]:
        """The workers' encoded batches decoded by the device decoder, shaped like the workers' decoded ones."""
        for encoded, labels, seeds, indices, counts in self.loader:
            images, labels, events = self.decoder(encoded, labels, seeds, indices)
            yield images, labels, events, None, counts


def in_memory_split(data: DataPlan, split: str) -> sources.InMemoryDataset:
    config = data.source
    if config.name == "fashion-mnist":
        dataset = sources.load_fashion_mnist(sources.fashion_mnist_root(config), split)
    else:
        dataset = sources.build_synthetic(config, data.in_chans, split)
    limit = config.limit_train if split == "train" else config.limit_eval
    return dataset.limit(limit).to(data.device)


def image_folder_splits(config: DataConfig) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The ``(path, class index)`` samples of an image folder's training and evaluation splits, limited."""
    root = Path(sources.image_folder_root(config))
    train_samples = sources.image_folder_samples(root, "train", config.val_fraction)[0][: config.limit_train]
    return train_samples, sources.image_folder_samples(root, "eval", config.val_fraction)[0][: config.limit_eval]
