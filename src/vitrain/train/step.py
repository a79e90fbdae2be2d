"""One training step: forward, loss, backward, clip, optimizer. No I/O, no sync (the loop sets the LR)."""

from __future__ import annotations

import contextlib
import copy

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


class LowPrecisionWeights:
    """ "O2" mixed precision: a copy of the model in the compute dtype runs forward and backward
    with no autocast casts; the fp32 model stays the master copy that the optimizer updates and
    checkpoints hold (Micikevicius et al. 2018, "Mixed Precision Training"; apex opt-level O2).
    """

    def __init__(self, master: nn.Module, dtype: torch.dtype):
        self.master, self.dtype = master, dtype
        self.compute = copy.deepcopy(master).to(dtype)
        self.master_params = list(master.parameters())
        self.compute_params = list(self.compute.parameters())

    def pull_grads(self) -> None:
        """Move the compute copy's gradients onto the master parameters, in fp32."""
        for master, compute in zip(self.master_params, self.compute_params, strict=True):
            master.grad = None if compute.grad is None else compute.grad.float()
            compute.grad = None

    @torch.no_grad()
    def push_weights(self) -> None:
        """Round the master weights (and buffers) into the compute copy."""
        torch._foreach_copy_(self.compute_params, self.master_params)
        for master, compute in zip(self.master.buffers(), self.compute.buffers(), strict=True):
            compute.copy_(master)


class TrainStep:
    """Callable holding what every step needs; returns the loss and grad norm as device tensors."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        precision: str,
        device: str,
        label_smoothing: float,
        grad_clip: float | None,
        precision_mode: str = "autocast",
    ):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.precision, self.device = precision, device
        self.label_smoothing, self.grad_clip = label_smoothing, grad_clip
        self.low_precision = None
        if precision_mode == "o2" and precision in _AUTOCAST_DTYPES:
            self.low_precision = LowPrecisionWeights(model, _AUTOCAST_DTYPES[precision])

    def weights_changed(self) -> None:
        """Call after loading weights into the model (resume) so the compute copy follows."""
        if self.low_precision is not None:
            self.low_precision.push_weights()

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.optimizer.zero_grad(set_to_none=True)
        if self.low_precision is None:
            with autocast_context(self.precision, self.device):
                logits = self.model(images)
        else:
            logits = self.low_precision.compute(images.to(self.low_precision.dtype))
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.label_smoothing)
        self.scaler.scale(loss).backward()
        if self.low_precision is not None:
            self.low_precision.pull_grads()
        grad_norm = None
        if self.grad_clip is not None:
            self.scaler.unscale_(self.optimizer)
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.low_precision is not None:
            self.low_precision.push_weights()
        return loss.detach(), grad_norm
