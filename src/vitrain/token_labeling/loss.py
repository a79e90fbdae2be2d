"""The token-labeling loss (Jiang et al. 2021, eq. 5): soft-target cross-entropy on the class output
plus a weighted mean of the per-token soft-target cross-entropies.

The formula is the reference implementation's ``TokenLabelCrossEntropy`` (``tlt/loss/cross_entropy.py``,
also VOLO's ``loss/cross_entropy.py``): with MixToken (``lam < 1``) the class target becomes
``lam * target + (1 - lam) * target.flip(0)``, the batch-flipped partner's target weighted by the share of
tokens it gave; the dense term needs no mixing because the auxiliary outputs are put back in their own
image's order first (:func:`vitrain.token_labeling.unmix_tokens`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def soft_target_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against a distribution over the classes per image, averaged over the batch (timm's
    ``SoftTargetCrossEntropy``); the training loss of mixed batches (``TrainingLoss``) is this one too."""
    return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()


def token_labeling_loss(
    cls_logits: torch.Tensor,
    aux_logits: torch.Tensor,
    cls_target: torch.Tensor,
    aux_target: torch.Tensor,
    lam: float,
    dense_weight: float = 0.5,
    cls_weight: float = 1.0,
) -> torch.Tensor:
    """``cls_weight * CE(cls_logits, mixed cls_target) + dense_weight * mean over tokens CE(aux, aux_target)``.

    ``cls_logits``: ``(B, C)``; ``aux_logits``: ``(B, N, C)``, already un-mixed; ``cls_target``: ``(B, C)``
    probabilities (column 0 of :func:`vitrain.token_labeling.dense_targets`); ``aux_target``: ``(B, C, N)``
    (its columns ``1:``); ``lam``: the share of each image's own tokens (1 without MixToken), a host float.
    """
    batch, tokens, classes = aux_logits.shape
    if cls_logits.shape != (batch, classes) or cls_target.shape != (batch, classes):
        raise ValueError(
            f"cls_logits {tuple(cls_logits.shape)} and cls_target {tuple(cls_target.shape)} must be "
            f"(B, C) = ({batch}, {classes})"
        )
    if aux_target.shape != (batch, classes, tokens):
        raise ValueError(
            f"aux_target must be (B, C, N) = ({batch}, {classes}, {tokens}), got {tuple(aux_target.shape)}"
        )
    if lam < 1:
        cls_target = lam * cls_target + (1 - lam) * cls_target.flip(0)
    cls_loss = soft_target_cross_entropy(cls_logits.float(), cls_target.float())
    dense_loss = soft_target_cross_entropy(aux_logits.float(), aux_target.transpose(1, 2).float())
    return cls_weight * cls_loss + dense_weight * dense_loss
