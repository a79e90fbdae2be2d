"""Token labeling in a training run: each batch's dense targets from the label maps, and each step's MixToken box.

The loader gives every training sample's index, crop box and flip (``DataPlan.crop_geometry``);
:class:`TokenTargets` reads the samples' maps (memory-mapped shards, in the main process), cuts them to
the crops on the token grid of the current image size and returns the step's targets: ``(B, C, 1 + N)``
probabilities, column 0 the class token's, then the grid's tokens row-major
(:func:`~vitrain.token_labeling.dense_targets`). The MixToken box of a step is drawn from the step's mixing
generator (a function of seed, data rank, epoch and step), so a resumed run draws what the uninterrupted
run drew; nothing here holds a position to save.
"""

from __future__ import annotations

import numpy as np
import torch

from vitrain.config import DataPlan, TokenLabelPlan
from vitrain.data import sources
from vitrain.data.mixing import smoothed_one_hot
from vitrain.token_labeling.maps import (
    LabelMaps,
    PublishedLabelMaps,
    in_memory_sample_keys,
    open_label_maps,
    sample_keys_of_paths,
)
from vitrain.token_labeling.mixtoken import TokenBox, draw_token_box
from vitrain.token_labeling.targets import dense_targets


def training_sample_keys(data: DataPlan, train_loader) -> list[str]:
    """The keys the label maps were made for, of the training samples in loader order (``vitrain label``'s)."""
    config = data.source
    if config.name == "imagefolder":
        base = sources.image_folder_base(sources.image_folder_root(config))
        return sample_keys_of_paths(base, [path for path, _ in train_loader.samples])
    return in_memory_sample_keys(config.name, len(train_loader.dataset))


class TokenTargets:
    """The dense targets of training batches (``plan``: the run's :class:`TokenLabelPlan`)."""

    def __init__(self, plan: TokenLabelPlan, maps: LabelMaps | PublishedLabelMaps, smoothing: float, device):
        self.plan, self.maps, self.smoothing, self.device = plan, maps, smoothing, device

    @classmethod
    def open(cls, plan: TokenLabelPlan, data: DataPlan, train_loader, smoothing: float) -> TokenTargets:
        """Open (and check against the training images) the plan's label maps; a mismatch is a ConfigError
        naming the file."""
        maps = open_label_maps(plan.maps, training_sample_keys(data, train_loader), plan.num_classes)
        return cls(plan, maps, smoothing, data.device)

    def __call__(self, labels: torch.Tensor, geometry: torch.Tensor, image_size: int) -> torch.Tensor:
        """``(B, C, 1 + grid²)`` targets for a batch: ``labels`` its class indices (on the device),
        ``geometry`` the loader's ``(B, 6)`` rows (sample index, crop box, flip), ``image_size`` its side."""
        maps = self.maps.read(geometry[:, 0].long()).to(self.device, non_blocking=True)
        boxes = geometry[:, 1:5].to(self.device, torch.float32)
        flips = geometry[:, 5].to(self.device) > 0.5
        grid = self.plan.grid(image_size)
        targets = dense_targets(maps, boxes, grid, self.plan.num_classes, flips, self.smoothing)
        if self.plan.ground_truth:
            truth = smoothed_one_hot(labels, self.plan.num_classes, self.smoothing)
            targets[:, :, 0] = 0.5 * truth + 0.5 * targets[:, :, 0]
        return targets

    def draw_box(self, image_size: int, rng: np.random.Generator) -> tuple[TokenBox, float] | None:
        """The step's MixToken box on the auxiliary grid and the share of own tokens (None: MixToken off)."""
        if not self.plan.mix_token:
            return None
        grid = self.plan.grid(image_size)
        return draw_token_box((grid, grid), self.plan.mix_alpha, rng)
