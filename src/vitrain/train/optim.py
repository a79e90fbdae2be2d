"""Optimizer construction: parameter groups with weight-decay exclusion."""

from __future__ import annotations

import torch
from torch import nn

from vitrain.config import Plan


def build_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and conv kernels; never norms, biases, position embeddings or tokens."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if parameter.ndim <= 1 or name in skip:
            no_decay.append(parameter)
        else:
            decay.append(parameter)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def implementation_flags(implementation: str, device: str) -> dict[str, bool]:
    """torch.optim keyword arguments for an ``optim.implementation`` on ``device``."""
    if implementation == "auto":
        # torch's fused AdamW/SGD kernels exist for CPU and CUDA tensors alike
        implementation = "fused" if torch.device(device).type in ("cpu", "cuda") else "foreach"
    return {
        "fused": {"fused": True, "foreach": False},
        "foreach": {"fused": False, "foreach": True},
        "for-loop": {"fused": False, "foreach": False},
    }[implementation]


def build_optimizer(model: nn.Module, plan: Plan) -> torch.optim.Optimizer:
    config = plan.config.optim
    groups = build_param_groups(model, config.weight_decay)
    flags = implementation_flags(config.implementation, plan.device)
    if config.name == "adamw":
        return torch.optim.AdamW(groups, lr=plan.lr, betas=config.betas, eps=config.eps, **flags)
    return torch.optim.SGD(groups, lr=plan.lr, momentum=config.momentum, **flags)
