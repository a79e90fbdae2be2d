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
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler

from vitrain.config import DataConfig, Plan
from vitrain.data import sources
from vitrain.data.transforms import (
    batch_eval_resize,
    batch_random_resized_crop,
    build_eval_transform,
    build_train_transform,
    eval_resize_size,
)

Batch = tuple[torch.Tensor, torch.Tensor]


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (NumPy's SeedSequence hashing)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def epoch_permutation(count: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(count, generator=torch.Generator().manual_seed(derive_seed(seed, epoch)))


class InMemoryLoader:
    """Batches of an in-memory dataset, augmented per batch on the dataset's device."""

    def __init__(self, dataset: sources.InMemoryDataset, plan: Plan, train: bool):
        self.dataset, self.train = dataset, train
        self.rank, self.world_size = plan.world.data_rank, plan.world.data_size
        self.config = plan.config.data
        self.seed = plan.config.train.seed
        self.image_size = self.config.image_size
        self.batch_size = plan.global_batch if train else plan.eval_batch
        self.epoch, self.start_sample = 0, 0

    def configure(self, image_size: int, batch_size: int) -> None:
        self.image_size, self.batch_size = image_size, batch_size

    def __len__(self) -> int:
        if self.train:
            return len(self.dataset) // self.batch_size
        return -(-len(self._eval_indices()) // (self.batch_size // self.world_size))

    def start_epoch(self, epoch: int, start_sample: int = 0) -> None:
        self.epoch, self.start_sample = epoch, start_sample

    def _eval_indices(self) -> torch.Tensor:
        return torch.arange(self.rank, len(self.dataset), self.world_size)

    def __iter__(self) -> Iterator[Batch]:
        return self._train_batches() if self.train else self._eval_batches()

    def _train_batches(self) -> Iterator[Batch]:
        count, batch = len(self.dataset), self.batch_size
        order = epoch_permutation(count, self.seed, self.epoch)
        device = self.dataset.images.device
        local = slice(self.rank * batch // self.world_size, (self.rank + 1) * batch // self.world_size)
        for start in range(self.start_sample, count - batch + 1, batch):  # drops the partial batch
            indices = order[start : start + batch].to(device)
            images, labels = self.dataset.images[indices], self.dataset.labels[indices]
            generator = torch.Generator(device).manual_seed(derive_seed(self.seed, self.epoch, start))
            # the whole global batch draws its crops (cheap at in-memory sizes), so every image gets
            # the crop it gets in a one-process run; this rank keeps its slice
            images = batch_random_resized_crop(
                images, self.image_size, self.config.scale, self.config.ratio, self.config.hflip, generator
            )
            yield images[local], labels[local]

    def _eval_batches(self) -> Iterator[Batch]:
        indices, batch = self._eval_indices().to(self.dataset.images.device), self.batch_size // self.world_size
        for start in range(0, len(indices), batch):
            chunk = indices[start : start + batch]
            images = batch_eval_resize(self.dataset.images[chunk], self.image_size, self.config.crop_pct)
            yield images, self.dataset.labels[chunk]


class SeededSampler(Sampler):
    """Yields ``(index, sample_seed)``: an epoch-seeded permutation (or identity), from a start.

    With ``world_size`` > 1, training positions go by global batches of ``batch_size`` and this rank
    yields its slice of each; evaluation (no shuffle) yields every ``world_size``-th sample."""

    def __init__(self, count: int, seed: int, shuffle: bool, rank: int = 0, world_size: int = 1):
        self.count, self.seed, self.shuffle = count, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start, self.batch_size = 0, 0, 1

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def set_batch_size(self, batch_size: int) -> None:
        self.batch_size = batch_size

    def positions(self) -> range | list[int]:
        if self.world_size == 1:
            return range(self.start, self.count)
        if not self.shuffle:
            return range(self.start + self.rank, self.count, self.world_size)
        local = self.batch_size // self.world_size
        return [
            batch_start + self.rank * local + offset
            for batch_start in range(self.start, self.count - self.batch_size + 1, self.batch_size)
            for offset in range(local)
        ]

    def __len__(self) -> int:
        return len(self.positions())

    def __iter__(self):
        order = epoch_permutation(self.count, self.seed, self.epoch) if self.shuffle else torch.arange(self.count)
        for position in self.positions():
            index = int(order[position])
            yield index, derive_seed(self.seed, self.epoch, index)


def draft_size(config: DataConfig, image_size: int, train: bool) -> int:
    """The smallest decoded side that loses no detail in the output: the eval resize, or for
    training the side at which the smallest RandomResizedCrop still has ``image_size`` pixels."""
    if train:
        return math.ceil(image_size / math.sqrt(config.scale[0]))
    return eval_resize_size(image_size, config.crop_pct)


class ImageFileDataset(Dataset):
    """Decodes ``(path, label)`` samples with Pillow (RGB) and applies a seeded v2 transform.

    JPEGs decode at a reduced scale (Pillow ``draft``: 1/2, 1/4 or 1/8 in the DCT) when the
    output is small, so low-resolution curriculum stages also make decoding cheaper.
    """

    def __init__(self, samples: list[tuple[str, int]], transform, draft_side: int):
        self.samples, self.transform, self.draft_side = samples, transform, draft_side

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: tuple[int, int]) -> Batch:
        index, sample_seed = key
        path, label = self.samples[index]
        with Image.open(path) as image:
            if image.format == "JPEG":
                # draft keeps both sides >= the requested box, so ask for the short side
                # scaled to the aspect ratio: the short side stays >= draft_side
                width, height = image.size
                scale = self.draft_side / min(width, height)
                image.draft("RGB", (math.ceil(width * scale), math.ceil(height * scale)))
            image = image.convert("RGB")
        # The transform draws from torch's global RNG; seed it per sample, without disturbing
        # the caller's stream, so augmentation is independent of workers and restarts.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed)
            tensor = self.transform(image)
        return tensor, torch.tensor(label)


class FileLoader:
    """A torch DataLoader over image files, positioned through its seeded sampler; rebuilt (with
    its workers) when a curriculum stage changes the image or batch size."""

    def __init__(self, samples: list[tuple[str, int]], plan: Plan, train: bool):
        self.samples, self.plan, self.train = samples, plan, train
        world = plan.world
        self.sampler = SeededSampler(len(samples), plan.config.train.seed, train, world.data_rank, world.data_size)
        self.image_size, self.batch_size, self.loader = 0, 0, None
        self.configure(plan.config.data.image_size, plan.global_batch if train else plan.eval_batch)

    def configure(self, image_size: int, batch_size: int) -> None:
        if (image_size, batch_size) == (self.image_size, self.batch_size):
            return
        config = self.plan.config.data
        self.image_size, self.batch_size = image_size, batch_size
        transform = (
            build_train_transform(config, image_size) if self.train else build_eval_transform(config, image_size)
        )
        dataset = ImageFileDataset(self.samples, transform, draft_size(config, image_size, self.train))
        workers = config.num_workers
        self.sampler.set_batch_size(batch_size)
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size // self.plan.world.data_size,
            sampler=self.sampler,
            drop_last=self.train,
            num_workers=workers,
            pin_memory=self.plan.device.startswith("cuda"),
            persistent_workers=workers > 0,
            prefetch_factor=4 if workers > 0 else None,
        )

    def __len__(self) -> int:
        return len(self.loader)

    def start_epoch(self, epoch: int, start_sample: int = 0) -> None:
        self.sampler.set_position(epoch, start_sample)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.loader)


def _in_memory_split(plan: Plan, split: str) -> sources.InMemoryDataset:
    config = plan.config.data
    if config.name == "fashion-mnist":
        dataset = sources.load_fashion_mnist(sources.fashion_mnist_root(config), split)
    else:
        dataset = sources.build_synthetic(config, plan.in_chans, split)
    limit = config.limit_train if split == "train" else config.limit_eval
    return dataset.limit(limit).to(plan.device)


def build_loaders(plan: Plan) -> tuple[InMemoryLoader | FileLoader, InMemoryLoader | FileLoader]:
    """Train and eval loaders for the plan's data source."""
    config = plan.config.data
    if config.name == "imagefolder":
        root = Path(sources.image_folder_root(config))
        train_samples = sources.image_folder_samples(root, "train")[0][: config.limit_train]
        eval_samples = sources.image_folder_samples(root, "eval")[0][: config.limit_eval]
        return FileLoader(train_samples, plan, train=True), FileLoader(eval_samples, plan, train=False)
    return InMemoryLoader(_in_memory_split(plan, "train"), plan, True), InMemoryLoader(
        _in_memory_split(plan, "eval"), plan, False
    )
