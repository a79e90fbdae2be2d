"""Batched JPEG decoding on the run's device (``data.decode=gpu``).

The loader workers only read the files (or the shard entries) and send their bytes; the training process
decodes each batch's JPEGs in one call of ``torchvision.io.decode_jpeg(device="cuda")`` (nvJPEG), other
formats (PNG, WebP, ...) with vitrain's CPU decoder, then crops, flips and resizes every image on the device
with the same seeded draws as the Pillow path (:func:`~vitrain.data.transforms.seeded_sample_rngs`): on an
image of the same size, the same crop box, flip and translation. Random erasing follows on the batch (the
in-memory rule, drawn from a generator seeded by the batch's first sample: other boxes than the Pillow path's).

A file that does not decode is found by decoding the batch's files one by one after the batched call
failed; it is reported as a bad event (the loader counts it like the Pillow path) and, in training, its
slot takes the next good image of the same batch (with its label), so batches keep their size;
evaluation leaves it out. The decoder also runs on the CPU (``device="cpu"``), which is how the suite
tests it without a GPU.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Sequence

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from vitrain.config import DataConfig
from vitrain.data.decode import BadImage, decode_image
from vitrain.data.transforms import (
    RandomResizedCropFlip,
    batch_random_erase,
    eval_resize_size,
    seeded_sample_rngs,
)

JPEG_MAGIC = b"\xff\xd8\xff"
Event = tuple[object, str, str]
"""A bad sample: (its name or index, reason, detail), as the loaders' bad-image logs take them."""


def encoded_tensor(data: bytes) -> torch.Tensor:
    """File bytes as the uint8 CPU tensor the decoder takes (and a DataLoader worker can send)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def build_device_transform(config: DataConfig, image_size: int, train: bool) -> v2.Compose:
    """The per-image steps of the Pillow path that work on CHW uint8 tensors on any device: crop and flip
    (and translation) for training, resize and centre crop for evaluation."""
    if not train:
        return v2.Compose(
            [v2.Resize(eval_resize_size(image_size, config.crop_pct), antialias=True), v2.CenterCrop(image_size)]
        )
    steps = [RandomResizedCropFlip(image_size, config.scale, config.ratio, config.hflip)]
    if config.translate:
        steps.append(v2.RandomCrop(image_size, padding=config.translate))
    return v2.Compose(steps)


class DeviceDecoder:
    """Decode and transform a batch of encoded images on ``device``; see the module docstring."""

    def __init__(self, config: DataConfig, image_size: int, train: bool, device: str):
        self.config, self.train, self.device = config, train, torch.device(device)
        self.transform = build_device_transform(config, image_size, train)

    def _decode_one(self, data: torch.Tensor) -> torch.Tensor:
        """One image on the device: JPEGs with the device decoder, anything else through vitrain's decoder."""
        if bytes(data[:3].tolist()) == JPEG_MAGIC:
            return self._jpegs([data])[0]
        image = decode_image(data.numpy().tobytes(), max_image_pixels=self.config.max_image_pixels).image
        return v2.functional.pil_to_tensor(image).to(self.device)

    def _jpegs(self, items: list[torch.Tensor]) -> list[torch.Tensor]:
        with warnings.catch_warnings():  # torchvision 0.29 points image decoding to TorchCodec
            warnings.simplefilter("ignore", DeprecationWarning)
            return decode_jpeg(items, mode=ImageReadMode.RGB, device=self.device)

    def _refused(self, data: torch.Tensor) -> BadImage | None:
        """What is wrong with a file before decoding: unreadable or empty, or more pixels than
        data.max_image_pixels (read from the header)."""
        if data.numel() == 0:
            return BadImage("empty", "0 bytes (or the file could not be read)")
        if bytes(data[:3].tolist()) != JPEG_MAGIC:
            return None  # decoded by vitrain's decoder, which checks the size itself
        try:
            width, height = Image.open(io.BytesIO(data.numpy().tobytes())).size
        except (OSError, ValueError):
            return None  # the decoders below fail on it, and vitrain's says why
        if width * height > self.config.max_image_pixels:
            return BadImage("decompression_bomb", f"{width}x{height} pixels > data.max_image_pixels")
        return None

    def decode(self, encoded: Sequence[torch.Tensor]) -> list[torch.Tensor | BadImage]:
        """Each image decoded to an RGB CHW uint8 tensor on the device, or the :class:`BadImage` it is."""
        decoded: dict[int, torch.Tensor | BadImage] = {}
        for index, data in enumerate(encoded):
            refused = self._refused(data)
            if refused is not None:
                decoded[index] = refused
        jpeg = [i for i, data in enumerate(encoded) if i not in decoded and bytes(data[:3].tolist()) == JPEG_MAGIC]
        if jpeg:
            with contextlib.suppress(RuntimeError):  # a bad file fails the batched call: found below, one by one
                decoded.update(zip(jpeg, self._jpegs([encoded[i] for i in jpeg]), strict=True))
        for index, data in enumerate(encoded):
            if index not in decoded:
                decoded[index] = self._decode_alone(data)
        return [decoded[index] for index in range(len(encoded))]

    def _decode_alone(self, data: torch.Tensor) -> torch.Tensor | BadImage:
        try:
            return self._decode_one(data)
        except BadImage as bad:
            return bad
        except RuntimeError:  # the device decoder refused what vitrain's may read (e.g. CMYK, progressive)
            try:
                image = decode_image(data.numpy().tobytes(), max_image_pixels=self.config.max_image_pixels).image
            except BadImage as bad:
                return bad
            return v2.functional.pil_to_tensor(image).to(self.device)

    def __call__(
        self, encoded: Sequence[torch.Tensor], labels: torch.Tensor, seeds: Sequence[int], names: Sequence[object]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[Event]]:
        """``(images (B, 3, S, S) uint8 on the device, labels, bad events)``; None, None when nothing decoded."""
        decoded = self.decode(encoded)
        events = [
            (name, image.reason, image.detail)
            for name, image in zip(names, decoded, strict=True)
            if isinstance(image, BadImage)
        ]
        good = [i for i, image in enumerate(decoded) if not isinstance(image, BadImage)]
        if not good:
            return None, None, events
        slots = [i if i in good else next((g for g in good if g > i), good[0]) for i in range(len(decoded))]
        slots = slots if self.train else good
        images = []
        for position, slot in zip(range(len(decoded)) if self.train else slots, slots, strict=True):
            with seeded_sample_rngs(seeds[position]):  # a replacement keeps its slot's draws, as in the Pillow path
                images.append(self.transform(decoded[slot]))
        batch = torch.stack(images)
        if self.train and self.config.random_erase:
            generator = torch.Generator(self.device).manual_seed(seeds[0])
            batch = batch_random_erase(batch, self.config.random_erase, generator)
        return batch, labels[torch.tensor(slots)], events
