"""Dense token-labeling targets: a teacher's top-k label map, cropped like the image, one target per token.

Token labeling (Jiang et al. 2021, "All Tokens Matter", sec. 3.2) stores, for every position of a
teacher's output grid, its top-k class scores and indices. A training image is a crop (and maybe a
flip) of the full image, so its targets are the same crop of the label map: the top-k scores are
scattered into a full ``(classes, H, W)`` map, RoIAlign reads the crop box onto the student's token
grid (and onto one cell for the class token), and a softmax over classes turns the aligned scores
into probabilities. The arithmetic is the reference implementation's (``tlt/data/mixup.py``,
``get_featuremaps`` / ``get_label`` / ``get_labelmaps_with_coords``): RoIAlign with its defaults
(``spatial_scale=1``, ``sampling_ratio=-1``, ``aligned=False``) on the box in label-map pixels
shifted by half a pixel, softmax with no temperature, then its label smoothing.

Boxes are ``(x1, y1, x2, y2)``: x along the label map's width (its last axis), RoIAlign's order. The
reference stores its crop as (top, left, bottom, right) fractions and hands them to RoIAlign in that
order; a label map stored ``(H, W)`` needs x-y boxes. Its horizontal flip mirrors the whole image and
label map before the crop; flipping the aligned grid after the crop is the same arithmetic (RoIAlign's
sample points are symmetric in each bin, and the half-pixel shift maps the mirrored box onto the
mirrored map).
"""

from __future__ import annotations

import torch
from torchvision.ops import roi_align

Grid = tuple[int, int]


def _grid_hw(grid_size: int | Grid) -> Grid:
    height, width = (grid_size, grid_size) if isinstance(grid_size, int) else tuple(grid_size)
    if height < 1 or width < 1:
        raise ValueError(f"grid_size must be positive, got {grid_size}")
    return height, width


def scatter_label_maps(label_maps: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``(B, 2, k, H, W)`` top-k label maps (scores, class indices stored as floats) -> a float32
    ``(B, num_classes, H, W)`` score map, zero outside each position's top k."""
    if label_maps.ndim != 5 or label_maps.shape[1] != 2:
        raise ValueError(f"label maps must be (B, 2, k, H, W) (scores, indices), got {tuple(label_maps.shape)}")
    batch, _, _, height, width = label_maps.shape
    scores, indices = label_maps[:, 0].float(), label_maps[:, 1].long()
    full = torch.zeros(batch, num_classes, height, width, dtype=torch.float32, device=label_maps.device)
    return full.scatter_(1, indices, scores)


def _roi_boxes(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``(B, 4)`` fractional ``(x1, y1, x2, y2)`` -> RoIAlign's ``(B, 5)`` rows in label-map pixels,
    shifted by half a pixel as the reference does (it scales both axes by the width: the same for
    its square maps)."""
    scale = torch.tensor([width, height, width, height], dtype=torch.float32, device=boxes.device)
    pixels = boxes.float() * scale - 0.5
    index = torch.arange(len(boxes), dtype=torch.float32, device=boxes.device).unsqueeze(1)
    return torch.cat([index, pixels], dim=1)


def dense_targets(
    label_maps: torch.Tensor,
    boxes: torch.Tensor,
    grid_size: int | Grid,
    num_classes: int,
    flips: torch.Tensor | None = None,
    smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token target probabilities ``(B, num_classes, 1 + grid_h * grid_w)`` from top-k label maps.

    ``label_maps``: ``(B, 2, k, H, W)`` float, scores and class indices (as floats) at the teacher's
    resolution. ``boxes``: ``(B, 4)`` crop boxes ``(x1, y1, x2, y2)`` as fractions of the label map
    (the crop the image got). ``flips``: optional bool ``(B,)``, a horizontal flip applied after the
    crop. ``grid_size``: the token grid, an int (square) or ``(height, width)``.

    Column 0 is the class token's target (the box aligned onto one cell), columns ``1:`` the grid's
    tokens row-major. Each column is a softmax over classes of the aligned scores (classes outside
    the top k count with score 0, as in the reference). ``smoothing`` applies the reference's label
    smoothing, ``p * (1 - smoothing + smoothing / C) + smoothing / C`` (its columns then sum to
    ``1 + smoothing / C``); 0 leaves the probabilities as they are.

    Everything stays on the tensors' device: no host synchronisation.
    """
    if boxes.shape != (len(label_maps), 4):
        raise ValueError(f"boxes must be (B, 4) = ({len(label_maps)}, 4), got {tuple(boxes.shape)}")
    grid_hw = _grid_hw(grid_size)
    full = scatter_label_maps(label_maps, num_classes)
    rois = _roi_boxes(boxes, *full.shape[-2:])
    grid = roi_align(full, rois, output_size=grid_hw, spatial_scale=1.0, sampling_ratio=-1, aligned=False)
    if flips is not None:
        grid = torch.where(flips.view(-1, 1, 1, 1).to(grid.device), grid.flip(-1), grid)
    cls = roi_align(full, rois, output_size=(1, 1), spatial_scale=1.0, sampling_ratio=-1, aligned=False)
    scores = torch.cat([cls.flatten(2), grid.flatten(2)], dim=2)
    probabilities = scores.softmax(dim=1)
    if smoothing:
        off_value = smoothing / num_classes
        probabilities = probabilities * (1.0 - smoothing + off_value) + off_value
    return probabilities
