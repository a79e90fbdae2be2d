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
from vitrain.token_labeling.loss import soft_target_cross_entropy


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


class DistillationLoss:
    """DeiT's distillation loss (Touvron et al. 2021, sec. 5.2; facebookresearch/deit ``losses.py``):
    the base loss on the class-token logits plus a term pulling the distillation-token logits toward a
    teacher, weighted ``1 - alpha`` and ``alpha``.

    ``soft``: ``KL(softmax(teacher / tau) || softmax(dist / tau)) * tau^2``, summed over the batch and
    classes and divided by the number of logits (DeiT's normalization); ``hard``: cross-entropy of the
    distillation logits against the teacher's top class (no smoothing). The teacher's logits carry no
    gradient. A student without a distillation token passes its class logits as both (DeiT allows this).
    """

    def __init__(self, base: TrainingLoss, kind: Literal["soft", "hard"], alpha: float, tau: float):
        if kind not in ("soft", "hard"):
            raise ValueError(f"unknown distillation {kind!r}; use soft or hard")
        self.base, self.kind, self.alpha, self.tau = base, kind, alpha, tau

    def distillation_term(self, dist_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        teacher_logits = teacher_logits.detach().float()
        if self.kind == "hard":
            return F.cross_entropy(dist_logits, teacher_logits.argmax(dim=1))
        tau = self.tau
        divergence = F.kl_div(
            F.log_softmax(dist_logits / tau, dim=1),
            F.log_softmax(teacher_logits / tau, dim=1),
            reduction="sum",
            log_target=True,
        )
        return divergence * (tau * tau) / dist_logits.numel()

    def __call__(
        self, cls_logits: torch.Tensor, dist_logits: torch.Tensor, targets: torch.Tensor, teacher_logits: torch.Tensor
    ) -> torch.Tensor:
        base = self.base(cls_logits, targets)
        return (1 - self.alpha) * base + self.alpha * self.distillation_term(dist_logits, teacher_logits)
