"""One training step: forward, loss, backward, clip, optimizer. No I/O, no sync (the loop sets the LR)."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

LOW_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(precision: str, device: str) -> contextlib.AbstractContextManager:
    """Autocast for bf16/fp16; a no-op for fp32."""
    if precision not in LOW_PRECISION_DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=LOW_PRECISION_DTYPES[precision])


class HalfWeightsGradScaler(torch.amp.GradScaler):
    """Dynamic loss scaling for fp16 *weights* ("full" fp16): torch's scaler refuses to unscale fp16
    gradients because fp32 master weights are the usual fix; here there are none by design."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


def build_grad_scaler(precision: str, device: str, precision_mode: str = "autocast") -> torch.amp.GradScaler:
    """Dynamic loss scaling, enabled only for fp16 (bf16 has fp32's exponent range)."""
    scaler = HalfWeightsGradScaler if precision_mode == "full" else torch.amp.GradScaler
    return scaler(torch.device(device).type, enabled=precision == "fp16")


def to_compute_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``model`` to ``dtype`` in place except BatchNorm layers, which stay fp32 (apex's
    ``keep_batchnorm_fp32``: torch normalizes low-precision inputs with fp32 statistics)."""
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.float()
    return model


class LowPrecisionWeights:
    """ "O2" mixed precision: a copy of the model in the compute dtype runs forward and backward
    with no autocast casts; the fp32 model stays the master copy that the optimizer updates and
    checkpoints hold (Micikevicius et al. 2018, "Mixed Precision Training"; apex opt-level O2).

    BatchNorm layers stay fp32 in the compute copy (``to_compute_dtype``) and share the master's
    running statistics, so the statistics each forward updates are the ones evaluation and
    checkpoints see.
    """

    def __init__(self, master: nn.Module, dtype: torch.dtype):
        self.master, self.dtype = master, dtype
        self.compute = to_compute_dtype(copy.deepcopy(master), dtype)
        for master_module, compute_module in zip(master.modules(), self.compute.modules(), strict=True):
            if isinstance(compute_module, nn.modules.batchnorm._BatchNorm):
                for name, buffer in master_module.named_buffers(recurse=False):
                    setattr(compute_module, name, buffer)
        self.master_params = list(master.parameters())
        self.compute_params = list(self.compute.parameters())
        self.buffer_pairs = [
            (master_buffer, compute_buffer)
            for master_buffer, compute_buffer in zip(master.buffers(), self.compute.buffers(), strict=True)
            if master_buffer is not compute_buffer
        ]
        self.push_weights()  # exact fp32 BatchNorm weights, not the round trip through the compute dtype

    def pull_grads(self) -> None:
        """Move the compute copy's gradients onto the master parameters, in fp32."""
        for master, compute in zip(self.master_params, self.compute_params, strict=True):
            master.grad = None if compute.grad is None else compute.grad.float()
            compute.grad = None

    @torch.no_grad()
    def push_weights(self) -> None:
        """Round the master weights (and unshared buffers) into the compute copy."""
        torch._foreach_copy_(self.compute_params, self.master_params)
        for master, compute in self.buffer_pairs:
            compute.copy_(master)


@contextlib.contextmanager
def deferred_gradient_sync(module: nn.Module):
    """Accumulating micro-batches: gradients are reduced across processes only after the last one
    (DDP's ``no_sync``; FSDP2's ``set_requires_gradient_sync``); a no-op for other modules."""
    if hasattr(module, "no_sync"):
        with module.no_sync():
            yield
    elif hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def clip_gradients_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most ``max_norm``; return the norm before.

    Sharded gradients (DTensors of FSDP/TP) count each element once across processes: per-tensor norms
    are stacked per placement and reduced by DTensor; replicated ones count as they are (the same on
    every process). Plain gradients alone take torch's ``clip_grad_norm_``."""
    grads = [param.grad for param in parameters if param.grad is not None]
    if not any(isinstance(grad, DTensor) for grad in grads):
        return nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    squares = []
    for key, members in groups.items():
        norms = torch.stack([torch.linalg.vector_norm(grad) for grad in members])
        squares.append((norms.full_tensor() if key is not None else norms).square().sum())
    total = torch.stack(squares).sum().sqrt()
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    local = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
    torch._foreach_mul_(local, coefficient)
    return total


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
        self.full_dtype = None  # "full": the model itself holds low-precision weights, no master copy
        self.autocast = True
        if precision_mode == "o2" and precision in LOW_PRECISION_DTYPES and hasattr(model, "unshard"):
            self.autocast = False  # FSDP2: its mixed-precision policy computes with low-precision weights
        elif precision_mode == "o2" and precision in LOW_PRECISION_DTYPES:
            self.low_precision = LowPrecisionWeights(model, LOW_PRECISION_DTYPES[precision])
        elif precision_mode == "full" and precision in LOW_PRECISION_DTYPES:
            self.full_dtype = LOW_PRECISION_DTYPES[precision]
            to_compute_dtype(model, self.full_dtype)  # in place: the optimizer's parameters stay the same objects
        # the module each step calls: the model or its O2 copy, possibly wrapped (DDP) from outside
        self.forward_module: nn.Module = self.low_precision.compute if self.low_precision else model
        self.micro_batch: int | None = None  # gradient accumulation: images per forward/backward

    def optimizer_context(self) -> contextlib.AbstractContextManager:
        """Tensor parallelism leaves norms and embeddings as plain tensors beside the DTensors of the split
        layers; the fused/foreach optimizers take plain ones as replicated (identical on every process)."""
        kinds = {isinstance(param, DTensor) for param in self.model.parameters()}
        return implicit_replication() if len(kinds) == 2 else contextlib.nullcontext()

    def weights_changed(self) -> None:
        """Call after loading weights into the model (resume) so the compute copy follows."""
        if self.low_precision is not None:
            self.low_precision.push_weights()

    def forward_logits(self, images: torch.Tensor) -> torch.Tensor:
        """The training forward pass alone (compile warm-up)."""
        return self._forward(images)

    def _forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.low_precision is not None:
            return self.forward_module(images.to(self.low_precision.dtype))
        if self.full_dtype is not None:
            return self.forward_module(images.to(self.full_dtype))
        with autocast_context(self.precision if self.autocast else "fp32", self.device):
            return self.forward_module(images)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step on the batch; with ``micro_batch`` set, gradients are accumulated over
        micro-batches of that size (each loss weighted by its share, so the update is the batch's) and
        DDP reduces them once, on the last."""
        self.optimizer.zero_grad(set_to_none=True)
        micro = self.micro_batch or len(labels)
        pieces = list(zip(images.split(micro), labels.split(micro), strict=True))
        loss = torch.zeros((), device=labels.device)
        for index, (piece_images, piece_labels) in enumerate(pieces):
            last = index == len(pieces) - 1
            with contextlib.nullcontext() if last else deferred_gradient_sync(self.forward_module):
                logits = self._forward(piece_images)
                share = len(piece_labels) / len(labels)
                piece_loss = F.cross_entropy(logits.float(), piece_labels, label_smoothing=self.label_smoothing) * share
                self.scaler.scale(piece_loss).backward()
            loss += piece_loss.detach()
        if self.low_precision is not None:
            self.low_precision.pull_grads()
        grad_norm = None
        if self.grad_clip is not None:
            self.scaler.unscale_(self.optimizer)
            grad_norm = clip_gradients_(list(self.model.parameters()), self.grad_clip)
        with self.optimizer_context():
            self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.low_precision is not None:
            self.low_precision.push_weights()
        return loss, grad_norm
