"""NVIDIA DALI input pipelines (``data.backend=dali``; extra ``vitrain[dali]``).

The image folder is read with DALI's file reader and tar shards with its WebDataset reader; images are
decoded on the GPU (DALI's ``mixed`` decoder, nvJPEG) when the run is on CUDA and by DALI's CPU threads
otherwise (``data.num_workers`` threads), cropped, flipped and resized inside the pipeline, and handed to
the training step as uint8 ``(B, 3, H, W)`` tensors through DLPack (on the GPU they never visit the host).
The loaders behave like :class:`~vitrain.data.loader.FileLoader` and
:class:`~vitrain.data.shards.ShardLoader`: ``configure``, ``start_epoch``, ``bad_images``, ``read_counts``.

Where DALI differs from the Pillow path (docs/data.md): the crop is drawn by DALI's generator (the same
area and aspect-ratio ranges, a different random stream), the resize is DALI's antialiased linear
filter rather than Pillow's, and JPEGs are decoded by nvImageCodec (libjpeg-turbo on the CPU, nvJPEG
on the GPU) at full size (no draft mode). Image folders keep vitrain's sample order exactly (the
epoch's permutation, repeated augmentation and the rank split of :class:`~vitrain.data.loader.SeededSampler`);
shards are read in a per-epoch shard order through DALI's shuffle buffer, each rank its 1/world of
the samples. Random erasing and translation are applied to the decoded batch; the per-image policies
(RandAugment, 3-Augment, color jitter) need the Pillow path.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator
from typing import Any

import torch

from vitrain.config import ConfigError, DataPlan
from vitrain.data.decode import BadImage, decode_image
from vitrain.data.loader import (
    BadImageLog,
    Batch,
    ReadCounts,
    SeededSampler,
    TooManyBadImages,
    derive_seed,
    epoch_order,
    image_folder_splits,
)
from vitrain.data.shards import shard_source
from vitrain.data.transforms import batch_random_erase, batch_random_translate, eval_resize_size

log = logging.getLogger("vitrain")
PREFETCH = 2
"""Batches DALI prepares ahead of the one the step takes."""


def require_dali():
    """The ``nvidia.dali`` module, or a ConfigError naming the extra that installs it."""
    try:
        import nvidia.dali  # noqa: F401
        from nvidia.dali import fn, pipeline_def, types
    except ImportError as error:
        raise ConfigError(
            f"data.backend=dali needs NVIDIA DALI ({error}): pip install 'vitrain[dali]' (the nvidia-dali-cuda130 "
            "wheel; its CPU pipelines need no GPU), or set data.backend=pillow"
        ) from None
    return fn, pipeline_def, types


def _device_id(data: DataPlan) -> int | None:
    """The CUDA device DALI decodes on, or None for a CPU-only pipeline."""
    if not data.device.startswith("cuda"):
        return None
    return (
        torch.device(data.device).index if torch.device(data.device).index is not None else torch.cuda.current_device()
    )


def _augment(encoded, data: DataPlan, train: bool, size: int, gpu: bool):
    """The DALI graph from encoded image bytes to uint8 CHW images of side ``size``."""
    fn, _, types = require_dali()
    config, device = data.source, "mixed" if gpu else "cpu"
    if train:
        images = fn.decoders.image_random_crop(
            encoded,
            device=device,
            output_type=types.RGB,
            random_area=list(config.scale),
            random_aspect_ratio=list(config.ratio),
            num_attempts=10,
        )
        images = fn.resize(images, resize_x=size, resize_y=size, interp_type=types.INTERP_LINEAR, antialias=True)
        mirror = fn.random.coin_flip(probability=config.hflip)
        return fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW", mirror=mirror)
    images = fn.decoders.image(encoded, device=device, output_type=types.RGB)
    shorter = eval_resize_size(size, config.crop_pct)
    images = fn.resize(images, resize_shorter=shorter, interp_type=types.INTERP_LINEAR, antialias=True)
    return fn.crop_mirror_normalize(
        images, dtype=types.UINT8, output_layout="CHW", crop=(size, size), out_of_bounds_policy="pad", fill_values=0
    )


def _file_pipeline(files: list[str], data: DataPlan, train: bool, size: int, batch: int, seed: int):
    """A pipeline reading ``files`` in the given order, ``batch`` at a time: (images, encoded bytes per image)."""
    fn, pipeline_def, _ = require_dali()
    device_id = _device_id(data)

    @pipeline_def
    def files_pipeline():
        encoded, _ = fn.readers.file(files=files, random_shuffle=False, name="reader")
        return _augment(encoded, data, train, size, device_id is not None), encoded.shape()

    threads = max(1, data.source.num_workers)
    return files_pipeline(
        batch_size=batch,
        num_threads=threads,
        device_id=device_id,
        seed=seed % 2**31,
        prefetch_queue_depth=PREFETCH,
        exec_dynamic=True,
    )


def _as_torch(output, device: str) -> torch.Tensor:
    """A DALI batch as a torch tensor, shared through DLPack (no copy; the dynamic executor keeps it alive)."""
    tensor = output.as_tensor()
    images = torch.from_dlpack(tensor)
    return images if images.device.type == device.split(":")[0] else images.to(device)


def _batch_extras(images: torch.Tensor, data: DataPlan, seed: int) -> torch.Tensor:
    """Random translation and erasing of a training batch (the batch rules of the in-memory path)."""
    config = data.source
    if not (config.translate or config.random_erase):
        return images
    generator = torch.Generator(images.device).manual_seed(seed)
    images = batch_random_translate(images, config.translate, generator)
    return batch_random_erase(images, config.random_erase, generator)


class DaliBatchFailed(Exception):
    """DALI failed to build or run a pipeline (a file it cannot read or decode): the error it raised."""

    def __init__(self, error: RuntimeError):
        super().__init__(str(error))
        self.error = error


def _dali_call(call):
    """``call()``, with DALI's RuntimeError as :class:`DaliBatchFailed` (errors of vitrain's own code pass)."""
    try:
        return call()
    except RuntimeError as error:
        raise DaliBatchFailed(error) from error


def _last_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


class DaliFileLoader:
    """Batches of an image folder through a DALI pipeline, in vitrain's sample order (exact on resume).

    A file DALI cannot decode fails its batch; the loader then checks that batch's files (and the
    prefetched ones) with vitrain's decoder, logs and counts the bad ones in ``bad_images`` like the
    Pillow path, and goes on with each bad file replaced by the next good one in file order (training) or
    left out (evaluation). A batch DALI rejects whose files all decode elsewhere stops the run (exit 2)."""

    def __init__(self, samples: list[tuple[str, int]], data: DataPlan, train: bool):
        require_dali()
        self.samples, self.data, self.train = samples, data, train
        self.bad_images = BadImageLog(samples, data.source.max_bad_fraction, "training" if train else "evaluation")
        world = data.world
        self.sampler = SeededSampler(
            len(samples), data.seed, train, world.data_rank, world.data_size, data.source.repeated_aug
        )
        self.read_counts: ReadCounts = (0, 0)
        self.image_size, self.batch_size, self.epoch, self.start = 0, 0, 0, 0
        self.configure(data.source.image_size, data.batch.global_batch if train else data.batch.eval_batch)

    def configure(self, image_size: int, batch_size: int) -> None:
        self.image_size, self.batch_size = image_size, batch_size
        self.share = self.data.batch.per_process(batch_size)
        self.sampler.set_batch_size(batch_size, self.share)

    def start_epoch(self, epoch: int, start_sample: int = 0) -> None:
        self.epoch, self.start = epoch, start_sample
        self.sampler.set_position(epoch, start_sample)

    def __len__(self) -> int:
        count = len(self.sampler)
        return count // self.share if self.train else -(-count // self.share)

    def _replacement(self, index: int) -> int:
        """``index``, or the next sample in file order that is not known bad."""
        for step in range(len(self.samples)):
            candidate = (index + step) % len(self.samples)
            if self.samples[candidate][0] not in self.bad_images.bad:
                return candidate
        raise TooManyBadImages(self.bad_images.describe_abort(no_image_decodes=True))

    def _batches(self) -> list[list[int]]:
        """This rank's sample indices of the epoch from its position, batch by batch."""
        sampler = self.sampler
        order = epoch_order(sampler.count, sampler.seed, sampler.epoch, sampler.repeats) if self.train else None
        positions = sampler.positions()
        indices = [int(order[p]) for p in positions] if self.train else list(positions)
        if self.train:
            indices = indices[: len(indices) // self.share * self.share]
        return [indices[start : start + self.share] for start in range(0, len(indices), self.share)]

    def _usable(self, batches: list[list[int]]) -> list[list[int]]:
        """The batches with known-bad files replaced (training) or left out (evaluation)."""
        if self.train:
            return [[self._replacement(index) for index in batch] for batch in batches]
        kept = [index for batch in batches for index in batch if self.samples[index][0] not in self.bad_images.bad]
        return [kept[start : start + self.share] for start in range(0, len(kept), self.share)]

    def __iter__(self) -> Iterator[Batch]:
        pending = self._batches()
        done = 0
        while pending:
            pending = self._usable(pending)
            try:
                for batch in self._run(pending, done):
                    done += 1
                    pending = pending[1:]
                    yield batch
            except DaliBatchFailed as failed:
                self._find_bad(pending[: PREFETCH + 1], failed.error)

    def _run(self, batches: list[list[int]], done: int) -> Iterator[Batch]:
        if not batches:
            return
        files = [self.samples[index][0] for batch in batches for index in batch]
        seed = derive_seed(self.data.seed, self.epoch, self.start, done, self.data.world.data_rank)
        pipe = _file_pipeline(files, self.data, self.train, self.image_size, self.share, seed)
        _dali_call(pipe.build)
        for number, batch in enumerate(batches):
            images, sizes = _dali_call(pipe.run)
            tensor = _as_torch(images, self.data.device)[: len(batch)]
            self._count_reads(sizes, len(batch))
            if self.train:
                tensor = _batch_extras(tensor, self.data, derive_seed(seed, number))
            labels = torch.tensor([self.samples[index][1] for index in batch], dtype=torch.int64)
            yield tensor, labels

    def _count_reads(self, sizes, count: int) -> None:
        num_bytes = sum(int(sizes.at(i)[0]) for i in range(count))
        self.read_counts = (self.read_counts[0] + num_bytes, self.read_counts[1] + count)

    def _find_bad(self, batches: list[list[int]], error: RuntimeError) -> None:
        """Check the files of the batches DALI was decoding; record the bad ones or stop the run."""
        indices = list(dict.fromkeys(index for batch in batches for index in batch))
        events = []
        for index in indices:
            try:
                decode_image(self.samples[index][0], max_image_pixels=self.data.source.max_image_pixels)
            except BadImage as bad:
                events.append((index, bad.reason, bad.detail))
        if not events:
            paths = ", ".join(self.samples[index][0] for index in indices[:3])
            raise ConfigError(
                f"data.backend=dali: DALI failed on a batch whose files all decode with Pillow (e.g. {paths}): "
                f"{_last_line(error)}; set data.backend=pillow"
            ) from error
        self.bad_images.record(events)  # raises past data.max_bad_fraction


class DaliShardLoader:
    """Batches of tar shards through DALI's WebDataset reader (local shard files).

    Each training epoch reads the shards in a seeded order, DALI splitting their samples into one part
    per rank, through a shuffle buffer of ``data.wds_shuffle_buffer`` samples; an epoch is
    ``num_samples // global batch`` batches. A resumed epoch plays its remaining batches with a fresh
    draw (approximate, like the Pillow shard path's buffer). DALI stops at a sample it cannot read or
    decode: the run ends with exit 2 naming the shards (``vitrain shard`` writes shards without
    such samples; the Pillow path skips and counts them)."""

    def __init__(self, source, data: DataPlan, train: bool):
        require_dali()
        self.source, self.data, self.train = source, data, train
        self.shards = source.train if train else source.eval
        limit = data.source.limit_train if train else data.source.limit_eval
        self.num_samples = min(self.shards.num_samples, limit or self.shards.num_samples)
        self.bad_images = BadImageLog([], data.source.max_bad_fraction, "training" if train else "evaluation")
        self.read_counts: ReadCounts = (0, 0)
        self.epoch, self.start, self.image_size, self.batch_size = 0, 0, 0, 0
        self.configure(data.source.image_size, data.batch.global_batch if train else data.batch.eval_batch)

    def configure(self, image_size: int, batch_size: int) -> None:
        self.image_size, self.batch_size = image_size, batch_size
        self.share = self.data.batch.per_process(batch_size)

    def start_epoch(self, epoch: int, start_sample: int = 0) -> None:
        self.epoch, self.start = epoch, start_sample

    def _rank_samples(self) -> int:
        """Samples this rank evaluates: its part of the shards' sample sequence (DALI's contiguous split),
        cut at ``data.limit_eval`` counted over the whole sequence."""
        world = self.data.world
        total, ranks, rank = self.shards.num_samples, world.data_size, world.data_rank
        start, end = total * rank // ranks, total * (rank + 1) // ranks
        return max(0, min(end, self.num_samples) - start)

    def __len__(self) -> int:
        if self.train:
            return self.num_samples // self.batch_size
        return -(-self._rank_samples() // self.share)

    def _pipeline(self, seed: int):
        fn, pipeline_def, _ = require_dali()
        config, world = self.data.source, self.data.world
        urls = list(self.shards.urls)
        if self.train:  # one order for all ranks: DALI gives rank r the r-th part of it
            random.Random(derive_seed(self.data.seed, self.epoch)).shuffle(urls)
        device_id = _device_id(self.data)

        @pipeline_def
        def shard_pipeline():
            encoded, label = fn.readers.webdataset(
                paths=urls,
                ext=[config.wds_image_keys, config.wds_label_key],
                missing_component_behavior="error",
                random_shuffle=self.train and config.wds_shuffle_buffer > 0,
                initial_fill=max(1, config.wds_shuffle_buffer),
                shard_id=world.data_rank,
                num_shards=world.data_size,
                pad_last_batch=not self.train,
                name="reader",
            )
            images = _augment(encoded, self.data, self.train, self.image_size, device_id is not None)
            return images, label, encoded.shape()

        threads = max(1, config.num_workers)
        return shard_pipeline(
            batch_size=self.share,
            num_threads=threads,
            device_id=device_id,
            seed=seed % 2**31,
            prefetch_queue_depth=PREFETCH,
            exec_dynamic=True,
        )

    def __iter__(self) -> Iterator[Batch]:
        first = self.start // self.batch_size if self.train else 0
        seed = derive_seed(self.data.seed, self.epoch, first, self.data.world.data_rank)
        remaining = self._rank_samples()
        pipe = self._pipeline(seed)
        try:
            _dali_call(pipe.build)
            for number in range(first, len(self)):
                images, labels, sizes = _dali_call(pipe.run)
                count = self.share if self.train else min(self.share, remaining - (number - first) * self.share)
                tensor = _as_torch(images, self.data.device)[:count]
                num_bytes = sum(int(sizes.at(i)[0]) for i in range(count))
                self.read_counts = (self.read_counts[0] + num_bytes, self.read_counts[1] + count)
                if self.train:
                    tensor = _batch_extras(tensor, self.data, derive_seed(seed, number))
                yield tensor, self._labels(labels, count)
        except DaliBatchFailed as failed:
            raise ConfigError(self._describe_failure(failed.error)) from failed.error

    def _labels(self, labels, count: int) -> torch.Tensor:
        values = []
        for i in range(count):
            text = bytes(memoryview(labels.at(i))).decode("utf-8", "replace").strip()
            if not text.isdigit() or int(text) >= self.source.num_classes:
                raise ConfigError(
                    f"data.wds_label_key={self.data.source.wds_label_key}: a sample's label is {text!r}, not a class "
                    f"index below {self.source.num_classes}; fix the shards or set data.backend=pillow, which "
                    "skips and counts such samples"
                )
            values.append(int(text))
        return torch.tensor(values, dtype=torch.int64)

    def _describe_failure(self, error: RuntimeError) -> str:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        detail = next((line for line in lines if "failure" in line or "missing" in line.lower()), _last_line(error))
        shown = ", ".join(os.path.basename(url) for url in self.shards.urls[:3])
        return (
            f"data.backend=dali: DALI could not read or decode a sample of the shards ({shown}, ...): {detail}; "
            "write the shards with `vitrain shard` (it leaves undecodable images out) or set data.backend=pillow, "
            "which skips and counts bad samples"
        )


def build_dali_loaders(data: DataPlan) -> tuple[Any, Any]:
    """Train and eval loaders of ``data.backend=dali`` for the image folder or the shards."""
    config = data.source
    if config.name == "webdataset":
        source = shard_source(config)
        return DaliShardLoader(source, data, train=True), DaliShardLoader(source, data, train=False)
    train_samples, eval_samples = image_folder_splits(config)
    return DaliFileLoader(train_samples, data, train=True), DaliFileLoader(eval_samples, data, train=False)
