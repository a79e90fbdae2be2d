"""One training step: forward, loss, backward, clip, optimizer and scheduler. No I/O, no sync."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(precision: str, device: str) -> contextlib.AbstractContextManager:
    """Autocast for bf16/fp16; a no-op for fp32."""
    if precision not in _AUTOCAST_DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=_AUTOCAST_DTYPES[precision])


def build_grad_scaler(precision: str, device: str) -> torch.amp.GradScaler:
    """Dynamic loss scaling, enabled only for fp16 (bf16 has fp32's exponent range)."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=precision == "fp16")


class TrainStep:
    """Callable holding what every step needs; returns the loss and grad norm as device tensors."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler,
        precision: str,
        device: str,
        label_smoothing: float,
        grad_clip: float | None,
    ):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.precision, self.device = precision, device
        self.label_smoothing, self.grad_clip = label_smoothing, grad_clip

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        with autocast_context(self.precision, self.device):
            logits = self.model(images)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.label_smoothing)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        grad_norm = None
        if self.grad_clip is not None:
            self.scaler.unscale_(self.optimizer)
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        return loss.detach(), grad_norm
