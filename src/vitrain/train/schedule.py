"""Learning-rate schedule: linear warmup, then cosine (or constant) decay to a floor."""

from __future__ import annotations

import math

import torch

from vitrain.config import Plan


def lr_factor(
    step: int, total_steps: int, warmup_steps: int, name: str, warmup_start: float, min_ratio: float
) -> float:
    """Multiplier of the peak LR for the update at ``step`` (0-based)."""
    if step < warmup_steps:
        return warmup_start + (1.0 - warmup_start) * step / warmup_steps
    if name == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, plan: Plan) -> torch.optim.lr_scheduler.LambdaLR:
    config = plan.config.schedule

    def factor(step: int) -> float:
        return lr_factor(
            step, plan.total_steps, plan.warmup_steps, config.name, config.warmup_start, config.min_lr_ratio
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
