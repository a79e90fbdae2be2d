"""Your own images (``vitrain train --data DIR``): a ladder of model and image-size rungs, and the recipe of
each rung for a number of epochs. ``vitrain.train.budget_choice`` picks the rung for a time budget by timing
them on this machine; without a budget the rung follows the number of images."""

from __future__ import annotations

import dataclasses

from vitrain.config import Config
from vitrain.recipes import register_recipe
from vitrain.recipes.fmnist import fmnist


@dataclasses.dataclass(frozen=True)
class Rung:
    """One model at one image size, with the batch it trains at."""

    model: str
    image_size: int
    batch_size: int

    @property
    def label(self) -> str:
        return f"{self.model} at {self.image_size} px"


LADDER = (
    Rung("localvit_tiny6_convstem_patch8", 32, 256),
    Rung("localvit_tiny6_convstem_patch8", 64, 128),
    Rung("localvit_tiny_patch16", 128, 128),
    Rung("localvit_tiny_patch16", 224, 64),
    Rung("localvit_small_patch16", 224, 64),
)
"""Rungs in order of cost per image: each step up gives more tokens or a wider model, and more accuracy when
the run affords enough epochs (LocalViT with Xiao et al.'s convolutional stem throughout: the stem and the
locality FFN each won at equal epochs in docs/results.md)."""

RUNG_BY_IMAGES = ((2_000, 0), (20_000, 1), (200_000, 3))
"""Without a budget: the rung for fewer than this many training images (more: the last rung)."""

PLAIN_BELOW_EPOCHS = 8
"""Below this many epochs no random crops or flips (docs/results.md: they cost accuracy in the first epochs)."""

AUGMENT_FROM_EPOCHS = 24
"""From this many epochs on, RandAugment and random erasing are on too (docs/results.md: they cost 0.5 pt at 6-8
epochs and gained 1.0-1.3 pt at 24 epochs). Between the two thresholds: the usual crops and flips of photos."""

DEFAULT_EPOCHS = 30
"""Training length without a budget."""


def rung_for_images(num_train: int) -> Rung:
    """The rung a run without a budget takes for ``num_train`` training images."""
    return LADDER[next((rung for below, rung in RUNG_BY_IMAGES if num_train < below), len(LADDER) - 1)]


def images_recipe(rung: Rung, epochs: float, num_train: int) -> Config:
    """The recipe of ``rung`` for a run of about ``epochs`` epochs over ``num_train`` images: fmnist's training
    (Muon, pooled head, cosine schedule); crops and flips from :data:`PLAIN_BELOW_EPOCHS` epochs, RandAugment and
    random erasing from :data:`AUGMENT_FROM_EPOCHS`; a batch small enough for eight steps an epoch, and at
    least 32 (the LR scales with it)."""
    config = fmnist()
    config.recipe = "images"
    config.data.name = "imagefolder"
    config.model.name = rung.model
    config.model.mlp_ratio = 2.0 if "tiny6" in rung.model else None
    config.model.stem = "conv"
    config.model.attn_impl = "auto"  # SDPA or matmul, timed at the run's shape
    config.data.image_size = rung.image_size
    if epochs >= PLAIN_BELOW_EPOCHS:
        config.data.scale, config.data.hflip, config.data.crop_pct = (0.35, 1.0), 0.5, 0.875
    config.train.batch_size = min(rung.batch_size, 1 << max(5, (num_train // 8).bit_length() - 1))
    config.schedule.warmup_epochs = round(min(5.0, max(0.5, epochs / 20)), 1)
    if epochs >= AUGMENT_FROM_EPOCHS:
        config.data.randaugment, config.data.random_erase = "rand-m9-mstd0.5-inc1", 0.25
    config.train.budget, config.train.epochs = None, float(epochs)
    return config


@register_recipe
def images() -> Config:
    """Your images (`vitrain train --data DIR`): a LocalViT with a convolutional stem, its size and the image size
    chosen by the number of images (with --budget: timed on this machine for the budget); crops and flips from 8
    epochs, RandAugment and random erasing from 24; Muon. `vitrain train --data DIR --dry-run` shows the choice."""
    return images_recipe(LADDER[0], DEFAULT_EPOCHS, 10_000)
