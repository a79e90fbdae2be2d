"""Training losses on hard labels or on soft targets (mixed, label-smoothed one-hot rows).

``ce``: softmax cross-entropy; with hard labels torch's, label smoothing included; with soft targets
``-sum(target * log_softmax(logits))`` averaged over the batch (timm's ``SoftTargetCrossEntropy``).
``bce``: each class's logit against its target by binary cross-entropy, averaged over images and
classes (DeiT III, Touvron et al. 2022: as timm's ``BinaryCrossEntropy`` without a target
threshold); hard labels first become smoothed one-hot rows, as timm's does. Evaluation stays plain
cross-entropy on hard labels (``vitrain.train.evaluate``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from vitrain.data.mixing import smoothed_one_hot


def soft_target_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against a distribution over the classes per image, averaged over the batch."""
    return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()


def binary_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of every logit against its target in [0, 1], averaged over all of them."""
    return F.binary_cross_entropy_with_logits(logits, targets)


class TrainingLoss:
    """The training loss of a step: ``kind`` on hard labels (int64, shape (B,)), where ``label_smoothing``
    applies, or on soft targets (float, shape (B, classes)), which carry their smoothing already."""

    def __init__(self, kind: Literal["ce", "bce"], label_smoothing: float):
        if kind not in ("ce", "bce"):
            raise ValueError(f"unknown loss {kind!r}; use ce or bce")
        self.kind, self.label_smoothing = kind, label_smoothing

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hard = targets.ndim == 1
        if self.kind == "ce":
            if hard:
                return F.cross_entropy(logits, targets, label_smoothing=self.label_smoothing)
            return soft_target_cross_entropy(logits, targets)
        if hard:
            targets = smoothed_one_hot(targets, logits.shape[-1], self.label_smoothing).to(logits.dtype)
        return binary_cross_entropy(logits, targets)
