"""A plan's training step on synthetic data: the batch it takes and the device sync that closes a timing.
Shared by the measured choices (:mod:`vitrain.train.precision_choice`) and ``vitrain bench``."""

from __future__ import annotations

import torch

from vitrain.config import Plan
from vitrain.data import Normalize
from vitrain.seeds import derive_seed


def synthetic_batch(plan: Plan, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random uint8 images of the plan's shape (this process's share of the global batch), normalized
    on the device, and random labels."""
    generator = torch.Generator().manual_seed(seed if plan.world.size == 1 else derive_seed(seed, plan.world.data_rank))
    model, batch = plan.model, plan.batch.per_process(plan.batch.global_batch)
    images = torch.randint(0, 256, (batch, model.in_chans, model.image_size, model.image_size), generator=generator)
    labels = torch.randint(0, model.num_classes, (batch,), generator=generator)
    normalize = Normalize(plan.data.mean, plan.data.std, plan.device, plan.runtime.channels_last)
    return normalize(images.to(torch.uint8).to(plan.device)), labels.to(plan.device)


def synchronize(device: str, loss: torch.Tensor) -> None:
    """Wait for the device to finish the work queued up to ``loss`` (CUDA: a device sync; CPU: ``.item()``)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    else:
        loss.item()
