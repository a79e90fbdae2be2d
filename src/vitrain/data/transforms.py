"""Augmentation and normalization.

Two implementations of the same train/eval geometry:
- per sample, torchvision v2 on decoded PIL images (file-backed sources, in loader workers);
- per batch, vectorized on a uint8 tensor (in-memory sources), with a seeded generator per batch,
  so small datasets never touch a Python-per-image loop (the airbench loader idea).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from vitrain.config import DataConfig


def eval_resize_size(image_size: int, crop_pct: float) -> int:
    return math.floor(image_size / crop_pct)


def build_train_transform(config: DataConfig, image_size: int | None = None) -> v2.Compose:
    size = image_size or config.image_size
    steps = [
        v2.RandomResizedCrop(size, scale=config.scale, ratio=config.ratio, antialias=True),
        v2.RandomHorizontalFlip(config.hflip),
    ]
    if config.translate:
        steps.append(v2.RandomCrop(size, padding=config.translate))
    steps.append(v2.PILToTensor())
    if config.random_erase:
        steps.append(RandomErase(config.random_erase))
    return v2.Compose(steps)


def build_eval_transform(config: DataConfig, image_size: int | None = None) -> v2.Compose:
    size = image_size or config.image_size
    return v2.Compose(
        [
            v2.Resize(eval_resize_size(size, config.crop_pct), antialias=True),
            v2.CenterCrop(size),
            v2.PILToTensor(),
        ]
    )


def _sample_crop_boxes(
    batch: int, height: int, width: int, scale, ratio, generator: torch.Generator, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """RandomResizedCrop boxes (x0, y0, w, h) in pixels, torchvision's rule: up to 10 tries of
    (area fraction, log-uniform aspect ratio) per image; the whole image when none fits."""
    tries = 10
    area = height * width * torch.empty(batch, tries, device=device).uniform_(*scale, generator=generator)
    log_ratio = torch.empty(batch, tries, device=device).uniform_(
        math.log(ratio[0]), math.log(ratio[1]), generator=generator
    )
    aspect = log_ratio.exp()
    crop_w, crop_h = (area * aspect).sqrt(), (area / aspect).sqrt()
    fits = (crop_w <= width) & (crop_h <= height)
    first = torch.where(fits.any(1), fits.float().argmax(1), torch.zeros_like(fits[:, 0], dtype=torch.long))
    rows = torch.arange(batch, device=device)
    crop_w, crop_h = crop_w[rows, first], crop_h[rows, first]
    none_fit = ~fits.any(1)
    crop_w = torch.where(none_fit, torch.full_like(crop_w, width), crop_w)
    crop_h = torch.where(none_fit, torch.full_like(crop_h, height), crop_h)
    x0 = torch.rand(batch, device=device, generator=generator) * (width - crop_w)
    y0 = torch.rand(batch, device=device, generator=generator) * (height - crop_h)
    return x0, y0, crop_w, crop_h


def batch_random_resized_crop(
    images: torch.Tensor, size: int, scale, ratio, hflip: float, generator: torch.Generator
) -> torch.Tensor:
    """RandomResizedCrop + horizontal flip for a uint8 batch, each image its own box (bilinear)."""
    batch, _, height, width = images.shape
    device = images.device
    x0, y0, crop_w, crop_h = _sample_crop_boxes(batch, height, width, scale, ratio, generator, device)
    flip = torch.rand(batch, device=device, generator=generator) < hflip
    if size == height == width and bool(((crop_w == width) & (crop_h == height)).all()):
        # every box is the whole image (scale (1, 1)): only the flips remain, no resampling
        return torch.where(flip[:, None, None, None], images.flip(-1), images)
    # affine_grid maps output coords in [-1, 1] to input coords in [-1, 1] (align_corners=False).
    theta = torch.zeros(batch, 2, 3, device=device)
    theta[:, 0, 0] = torch.where(flip, -crop_w, crop_w) / width
    theta[:, 0, 2] = (2 * x0 + crop_w) / width - 1
    theta[:, 1, 1] = crop_h / height
    theta[:, 1, 2] = (2 * y0 + crop_h) / height - 1
    grid = F.affine_grid(theta, [batch, images.shape[1], size, size], align_corners=False)
    out = F.grid_sample(images.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def batch_random_translate(images: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Shift each image of a batch by its own integer (dx, dy), each in [-max_shift, max_shift], filling
    with zeros: torchvision's RandomCrop(size, padding=max_shift) on every image."""
    if max_shift == 0:
        return images
    batch, _, height, width = images.shape
    device = images.device
    padded = F.pad(images, (max_shift,) * 4)
    top, left = torch.randint(0, 2 * max_shift + 1, (2, batch, 1), device=device, generator=generator)
    rows = (top + torch.arange(height, device=device))[:, :, None]  # (B, H, 1)
    cols = (left + torch.arange(width, device=device))[:, None, :]  # (B, 1, W)
    picked = padded.permute(0, 2, 3, 1)[torch.arange(batch, device=device)[:, None, None], rows, cols]
    return picked.permute(0, 3, 1, 2).contiguous()


ERASE_AREA, ERASE_LOG_RATIO = (0.02, 1 / 3), (math.log(0.3), math.log(1 / 0.3))


def _erase_boxes(batch: int, height: int, width: int, generator: torch.Generator, device):
    """timm's RandomErasing box rule: area fraction in ERASE_AREA, log-uniform aspect, up to 10
    tries for a box that fits; (top, left, h, w) with h = 0 where none fit."""
    tries = 10
    area = height * width * torch.empty(batch, tries, device=device).uniform_(*ERASE_AREA, generator=generator)
    aspect = torch.empty(batch, tries, device=device).uniform_(*ERASE_LOG_RATIO, generator=generator).exp()
    box_h, box_w = (area * aspect).sqrt().round().long(), (area / aspect).sqrt().round().long()
    fits = (box_h < height) & (box_w < width) & (box_h > 0) & (box_w > 0)
    first = fits.float().argmax(1)
    rows = torch.arange(batch, device=device)
    box_h, box_w = torch.where(fits.any(1), box_h[rows, first], 0), box_w[rows, first]
    top = (torch.rand(batch, device=device, generator=generator) * (height - box_h + 1)).long()
    left = (torch.rand(batch, device=device, generator=generator) * (width - box_w + 1)).long()
    return top, left, box_h, box_w


def batch_random_erase(images: torch.Tensor, probability: float, generator: torch.Generator) -> torch.Tensor:
    """Random erasing for a uint8 batch: with ``probability`` each image gets one box (timm's rule)
    filled with uniform noise, the same box across channels, noise per pixel and channel."""
    if probability == 0:
        return images
    batch, channels, height, width = images.shape
    device = images.device
    top, left, box_h, box_w = _erase_boxes(batch, height, width, generator, device)
    chosen = torch.rand(batch, device=device, generator=generator) < probability
    y = torch.arange(height, device=device)[None, :, None]
    x = torch.arange(width, device=device)[None, None, :]
    in_rows = (y >= top[:, None, None]) & (y < (top + box_h)[:, None, None])
    in_cols = (x >= left[:, None, None]) & (x < (left + box_w)[:, None, None])
    inside = in_rows & in_cols & chosen[:, None, None]
    noise = torch.randint(0, 256, images.shape, dtype=torch.uint8, device=device, generator=generator)
    return torch.where(inside[:, None], noise, images)


class RandomErase:
    """Per-sample random erasing on a uint8 CHW tensor (draws from torch's global RNG, which the
    file loader seeds per sample): the batch rule applied to a batch of one."""

    def __init__(self, probability: float):
        self.probability = probability

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return batch_random_erase(image[None], self.probability, torch.default_generator)[0]


def batch_eval_resize(images: torch.Tensor, size: int, crop_pct: float) -> torch.Tensor:
    """Resize the short side to size / crop_pct, then center-crop ``size`` (uint8 batch)."""
    height, width = images.shape[-2:]
    short = eval_resize_size(size, crop_pct)
    if (height, width) == (size, size) and short == size:
        return images
    # torchvision's Resize(int): the long side is truncated, the crop offset rounded.
    if height <= width:
        new_h, new_w = short, int(short * width / height)
    else:
        new_h, new_w = int(short * height / width), short
    resized = F.interpolate(images.float(), size=(new_h, new_w), mode="bilinear", antialias=True, align_corners=False)
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    cropped = resized[..., top : top + size, left : left + size]
    return cropped.round_().clamp_(0, 255).to(torch.uint8)


class Normalize:
    """uint8 batch -> float, (x / 255 - mean) / std, as one fused multiply-add on the device."""

    def __init__(self, mean, std, device: torch.device | str, channels_last: bool = False):
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        std_tensor = torch.tensor(std, device=device).view(1, -1, 1, 1)
        self.scale = 1.0 / (255.0 * std_tensor)
        self.shift = -torch.tensor(mean, device=device).view(1, -1, 1, 1) / std_tensor

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.shift, images.float(), self.scale).contiguous(memory_format=self.memory_format)
