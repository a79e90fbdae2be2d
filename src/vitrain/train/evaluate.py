"""Evaluation: top-1 / top-5 accuracy and mean loss over a loader."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.config.precision import PrecisionPolicy
from vitrain.parallel.distributed import all_reduce_
from vitrain.train.objectives import both_heads


def evaluate(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    prepare: Callable[[torch.Tensor], torch.Tensor],
    policy: PrecisionPolicy,
    replicas: int = 1,
    pad_to: int | None = None,
) -> dict[str, float]:
    """Accuracy in percent; ``prepare`` turns a uint8 batch into the model's input. ``replicas``: how many
    processes evaluated each sample (tensor-parallel peers share their data), so sums count it once.
    ``pad_to``: a smaller last batch is padded to this size (outputs of the padding dropped), so a
    compiled model sees one shape. The forward runs under the policy's autocast (every precision mode).

    A model with a token-labeling auxiliary head is scored as it predicts (class logits + 0.5 x the max of
    the auxiliary ones) and, as ``cls_top1`` / ``cls_top5``, by its class head alone."""
    with policy.evaluation_context():
        return _evaluate(model, loader, prepare, policy, replicas, pad_to)


def _evaluate(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    prepare: Callable[[torch.Tensor], torch.Tensor],
    policy: PrecisionPolicy,
    replicas: int,
    pad_to: int | None,
) -> dict[str, float]:
    device = policy.device
    was_training = model.training
    model.eval()
    auxiliary = any(getattr(child, "aux_head", None) is not None for child in model.modules())
    totals = torch.zeros(6, dtype=torch.float64, device=device)  # count, top1, top5, loss sum, class head top1, top5
    for images, labels in loader:
        images, labels = prepare(images.to(device, non_blocking=True)), labels.to(device, non_blocking=True)
        count = len(images)
        if pad_to is not None and count < pad_to:
            images = torch.cat([images, images.new_zeros((pad_to - count, *images.shape[1:]))])
        with policy.autocast_context(), both_heads(model, "aux") if auxiliary else contextlib.nullcontext():
            outputs = model(images)
        cls_logits, aux_logits = outputs if isinstance(outputs, tuple) else (outputs, None)
        cls_logits = cls_logits[:count].float()
        logits = cls_logits if aux_logits is None else cls_logits + 0.5 * aux_logits[:count].float().amax(dim=1)
        hits, cls_hits = _top_hits(logits, labels), _top_hits(cls_logits, labels)
        totals += torch.stack(
            [
                torch.tensor(len(labels), device=device, dtype=torch.float64),
                hits[:, 0].sum().double(),
                hits.any(1).sum().double(),
                F.cross_entropy(logits, labels, reduction="sum").double(),
                cls_hits[:, 0].sum().double(),
                cls_hits.any(1).sum().double(),
            ]
        )
    model.train(was_training)
    count, top1, top5, loss, cls_top1, cls_top5 = (all_reduce_(totals) / replicas).tolist()  # each process its shard
    if count == 0:
        raise ValueError("evaluation loader produced no samples")
    result = {"top1": 100.0 * top1 / count, "top5": 100.0 * top5 / count, "loss": loss / count}
    if auxiliary:
        result.update(cls_top1=100.0 * cls_top1 / count, cls_top5=100.0 * cls_top5 / count)
    return {**result, "num_samples": int(count)}


def _top_hits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``(B, min(5, classes))`` bools: whether each of the top classes is the label."""
    return logits.topk(min(5, logits.shape[1]), dim=1).indices == labels[:, None]
