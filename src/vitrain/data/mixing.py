"""Mixup and CutMix of a training batch, and the soft targets they make.

Mixup (Zhang et al. 2018) blends each image with a partner, ``lam * x + (1 - lam) * partner`` with
``lam ~ Beta(alpha, alpha)``; CutMix (Yun et al. 2019) pastes a box of the partner covering ``1 - lam``
of the image, then takes ``lam`` from the box actually pasted (its area once clipped to the image).
The target is the same blend of the two label-smoothed one-hot vectors. The partner of image ``i`` of
a batch of ``B`` is image ``B - 1 - i`` (the batch flipped).

The rules are timm's ``timm.data.Mixup`` (``correct_lam=True``): the same modes (one draw per batch,
per pair of partners, or per image), the same draws in the same order, the same box rules
(``rand_bbox``, ``rand_bbox_minmax``) and arithmetic, so a batch and a seeded generator give what
timm gives when its ``np.random`` calls go to that generator (tests/unit/test_mixing.py). Unlike
timm, the draws come from a generator seeded by ``(run seed, data rank, epoch, step)``
(:func:`mixing_generator`), never from NumPy's global state, so a resumed run mixes its batches
exactly as the uninterrupted run did. The draws happen on the host (a few numbers per image); the
images are mixed on their device in one pass, every image its own box.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vitrain.config import DataPlan, MixPlan
from vitrain.seeds import derive_seed

MIXING_STREAM = 0x6D6978
"""Set apart the mixing draws from the other streams derived from the run seed ("mix" in ASCII)."""


def mixing_generator(seed: int, data_rank: int, epoch: int, step: int) -> np.random.Generator:
    """The generator of one step's mixing draws on one data slice: a pure function of its arguments."""
    return np.random.default_rng(derive_seed(MIXING_STREAM, seed, data_rank, epoch, step))


def smoothed_one_hot(labels: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """Float32 one-hot rows with label smoothing: ``smoothing / num_classes`` off the label, the rest on it."""
    off_value = smoothing / num_classes
    on_value = 1.0 - smoothing + off_value
    rows = torch.full((len(labels), num_classes), off_value, device=labels.device)
    return rows.scatter_(1, labels.long().view(-1, 1), on_value)


@dataclasses.dataclass(frozen=True)
class MixDraw:
    """What one batch drew, per image: the target's weight of its own label (``lam``, CutMix's corrected
    by the box area), the weight of its own pixels in a blend (1 for CutMix and unmixed images), and the
    pasted box (rows ``top:bottom``, columns ``left:right``; empty without CutMix)."""

    lam: np.ndarray
    """float64; per-image modes hold float32 values (timm keeps them in a float32 array)."""
    blend: np.ndarray
    boxes: np.ndarray
    """int64 (B, 4): top, bottom, left, right."""

    @property
    def mixes(self) -> bool:
        return bool((self.lam != 1.0).any())

    @property
    def pastes(self) -> bool:
        return bool(((self.boxes[:, 1] > self.boxes[:, 0]) & (self.boxes[:, 3] > self.boxes[:, 2])).any())


def cutmix_box(
    height: int, width: int, lam: float, minmax: tuple[float, float] | None, rng: np.random.Generator
) -> tuple[tuple[int, int, int, int], float]:
    """A CutMix box (top, bottom, left, right) and lam corrected to its area. Without ``minmax``: a box of
    sides ``sqrt(1 - lam)`` of the image's, centred uniformly and clipped to the image; with it: sides
    uniform between those fractions of the image's, placed uniformly inside (timm's two rules)."""
    if minmax is None:
        ratio = np.sqrt(1 - lam)  # float32 lam stays float32, as in timm's per-image modes
        cut_h, cut_w = int(height * ratio), int(width * ratio)
        centre_y, centre_x = rng.integers(0, height), rng.integers(0, width)
        top, bottom = np.clip(centre_y - cut_h // 2, 0, height), np.clip(centre_y + (cut_h + 1) // 2, 0, height)
        left, right = np.clip(centre_x - cut_w // 2, 0, width), np.clip(centre_x + (cut_w + 1) // 2, 0, width)
    else:
        cut_h = rng.integers(int(height * minmax[0]), int(height * minmax[1]))
        cut_w = rng.integers(int(width * minmax[0]), int(width * minmax[1]))
        top, left = rng.integers(0, height - cut_h + 1), rng.integers(0, width - cut_w + 1)
        bottom, right = top + cut_h, left + cut_w
    lam = 1.0 - (bottom - top) * (right - left) / float(height * width)
    return (int(top), int(bottom), int(left), int(right)), lam


class BatchMixer:
    """Mixes a training batch and makes its soft targets, as ``timm.data.Mixup`` with this plan."""

    def __init__(self, plan: MixPlan):
        self.plan = plan

    def _mixing_choice(self, rng: np.random.Generator, count: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(CutMix or not, lam) for ``count`` images (None: one scalar draw), before ``mix_prob``."""
        plan = self.plan
        if plan.mixup_alpha > 0 and plan.cutmix_alpha > 0:
            use_cutmix = rng.random(count) < plan.switch_prob
            if count is None:  # one draw, from the chosen distribution only
                alpha = plan.cutmix_alpha if use_cutmix else plan.mixup_alpha
                return np.asarray(use_cutmix), np.asarray(rng.beta(alpha, alpha))
            cutmix_lam = rng.beta(plan.cutmix_alpha, plan.cutmix_alpha, size=count)
            mixup_lam = rng.beta(plan.mixup_alpha, plan.mixup_alpha, size=count)
            return use_cutmix, np.where(use_cutmix, cutmix_lam, mixup_lam)
        alpha = plan.mixup_alpha if plan.mixup_alpha > 0 else plan.cutmix_alpha
        lam = rng.beta(alpha, alpha, size=count)
        return np.full(np.shape(lam), plan.mixup_alpha == 0), np.asarray(lam)

    def _draw_for_batch(self, rng: np.random.Generator, height: int, width: int) -> tuple[float, tuple | None]:
        """timm's per-batch draw: lam (1: not mixed) and the CutMix box (None: Mixup or not mixed)."""
        if not rng.random() < self.plan.prob:
            return 1.0, None
        use_cutmix, lam = self._mixing_choice(rng, None)
        lam = float(lam)
        if lam == 1.0 or not use_cutmix:
            return lam, None
        box, lam = cutmix_box(height, width, lam, self.plan.cutmix_minmax, rng)
        return lam, box

    def _draw_per_image(self, rng: np.random.Generator, count: int, height: int, width: int):
        """timm's per-image draws for ``count`` images: float32 lams, CutMix boxes (empty rows elsewhere)
        and which images blend (Mixup)."""
        use_cutmix, lam_mix = self._mixing_choice(rng, count)
        lam = np.where(rng.random(count) < self.plan.prob, lam_mix.astype(np.float32), np.float32(1.0))
        boxes = np.zeros((count, 4), dtype=np.int64)
        for index in np.flatnonzero(use_cutmix & (lam != 1.0)):  # in order: each box draws after the last
            boxes[index], lam[index] = cutmix_box(height, width, lam[index], self.plan.cutmix_minmax, rng)
        return lam.astype(np.float64), boxes, ~use_cutmix

    def draw(self, rng: np.random.Generator, batch_size: int, height: int, width: int) -> MixDraw:
        """The mixing of a batch of ``batch_size`` images of ``height`` x ``width``, drawn from ``rng``."""
        mode = self.plan.mode
        if mode == "batch":
            lam, box = self._draw_for_batch(rng, height, width)
            boxes = np.tile(np.asarray(box or (0, 0, 0, 0), dtype=np.int64), (batch_size, 1))
            lams = np.full(batch_size, lam)
            return MixDraw(lams, np.full(batch_size, 1.0 if box else lam), boxes)
        count = batch_size if mode == "elem" else batch_size // 2
        lam, boxes, blends = self._draw_per_image(rng, count, height, width)
        blend = np.where(blends, lam, 1.0)
        if mode == "pair":  # the second half mirrors the first: partners share their draw
            lam, blend, boxes = (np.concatenate([part, part[::-1]]) for part in (lam, blend, boxes))
        return MixDraw(lam, blend, boxes)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, rng: np.random.Generator):
        """``(mixed images, soft targets (B, num_classes) float32)`` of a float batch and its labels."""
        draw = self.draw(rng, len(images), images.shape[-2], images.shape[-1])
        targets = apply_mix_to_targets(smoothed_one_hot(labels, self.plan.num_classes, self.plan.label_smoothing), draw)
        return apply_mix_to_images(images, draw), targets


def _per_image_columns(draw: MixDraw, device: torch.device) -> torch.Tensor:
    """(B, 8) float32 on ``device`` in one copy: lam, 1 - lam, blend, 1 - blend and the box. Both weights
    are rounded from float64 to float32 (as timm's scalar and float32-array arithmetic round them)."""
    columns = np.stack([draw.lam, 1.0 - draw.lam, draw.blend, 1.0 - draw.blend, *draw.boxes.T], axis=1)
    return torch.from_numpy(columns.astype(np.float32)).to(device, non_blocking=True)


def apply_mix_to_targets(one_hot: torch.Tensor, draw: MixDraw) -> torch.Tensor:
    """Each row ``lam`` of its own target plus ``1 - lam`` of its partner's."""
    columns = _per_image_columns(draw, one_hot.device)
    return one_hot * columns[:, :1] + one_hot.flip(0) * columns[:, 1:2]


def apply_mix_to_images(images: torch.Tensor, draw: MixDraw) -> torch.Tensor:
    """The batch with each image blended with its partner and/or its box pasted from it: a new tensor, or
    ``images`` itself when no image is mixed."""
    if not draw.mixes:
        return images
    columns = _per_image_columns(draw, images.device)
    partners = images.flip(0)
    mixed = images
    if bool((draw.blend != 1.0).any()):
        mixed = images * columns[:, 2, None, None, None] + partners * columns[:, 3, None, None, None]
    if draw.pastes:
        top, bottom, left, right = columns[:, 4:].T.unsqueeze(-1)
        rows = torch.arange(images.shape[-2], device=images.device)
        cols = torch.arange(images.shape[-1], device=images.device)
        in_rows, in_cols = (rows >= top) & (rows < bottom), (cols >= left) & (cols < right)
        inside = (in_rows[:, :, None] & in_cols[:, None, :]).unsqueeze(1)
        mixed = torch.where(inside, partners, mixed)
    layout = torch.channels_last if images.is_contiguous(memory_format=torch.channels_last) else None
    return mixed.contiguous(memory_format=layout) if layout else mixed.contiguous()


def build_mixer(data: DataPlan) -> BatchMixer | None:
    """The plan's batch mixer; None when mixing is off."""
    return BatchMixer(data.mixing) if data.mixing is not None else None
