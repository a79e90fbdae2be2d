"""Evaluation: top-1 / top-5 accuracy and mean loss over a loader."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.parallel.distributed import all_reduce_
from vitrain.precision import PrecisionPolicy


@torch.inference_mode()
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
    compiled model sees one shape. The forward runs under the policy's autocast (every precision mode)."""
    device = policy.device
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # count, top1, top5, loss sum
    for images, labels in loader:
        images, labels = prepare(images.to(device, non_blocking=True)), labels.to(device, non_blocking=True)
        count = len(images)
        if pad_to is not None and count < pad_to:
            images = torch.cat([images, images.new_zeros((pad_to - count, *images.shape[1:]))])
        with policy.autocast_context():
            logits = model(images)[:count].float()
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hits = top == labels[:, None]
        totals += torch.stack(
            [
                torch.tensor(len(labels), device=device, dtype=torch.float64),
                hits[:, 0].sum().double(),
                hits.any(1).sum().double(),
                F.cross_entropy(logits, labels, reduction="sum").double(),
            ]
        )
    model.train(was_training)
    count, top1, top5, loss = (all_reduce_(totals) / replicas).tolist()  # several processes: each its shard
    if count == 0:
        raise ValueError("evaluation loader produced no samples")
    return {"top1": 100.0 * top1 / count, "top5": 100.0 * top5 / count, "loss": loss / count, "num_samples": int(count)}
