"""One training step: forward, loss, backward, clip, optimizer. No I/O, no sync (the loop sets the LR).

The step holds how it computes (precision, gradient accumulation, clipping, skips); what it computes, the
forward of a micro-batch and its loss, is the run's objective (:mod:`vitrain.train.objectives`).

A step whose loss or gradient norm is not finite changes nothing: no parameter, optimizer-state or
BatchNorm-statistics update (fp16 loss scaling's semantics, for every precision). With a fused
AdamW the skip happens on the device (the kernel's ``found_inf`` input, as torch's GradScaler uses
it), so no step waits for the device; other optimizers read one flag per step on the host.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from vitrain.config.precision import PrecisionPolicy
from vitrain.parallel.distributed import holds_dtensors, local_shard
from vitrain.train.objectives import Objective, Outputs
from vitrain.train.optim import adam_step_unless_found_inf


class HalfWeightsGradScaler(torch.amp.GradScaler):
    """Dynamic loss scaling for fp16 *weights* ("full" fp16): torch's scaler refuses to unscale fp16
    gradients because fp32 master weights are the usual fix; here there are none by design."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


def build_grad_scaler(policy: PrecisionPolicy) -> torch.amp.GradScaler:
    """Dynamic loss scaling, enabled only where the policy scales the loss (fp16)."""
    scaler = HalfWeightsGradScaler if policy.weights == "low_precision" else torch.amp.GradScaler
    return scaler(torch.device(policy.device).type, enabled=policy.loss_scaling)


def to_compute_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``model`` to ``dtype`` in place except BatchNorm layers, which stay fp32 (apex's
    ``keep_batchnorm_fp32``: torch normalizes low-precision inputs with fp32 statistics)."""
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.float()
    return model


class FlatCopy:
    """The O2 bookkeeping as flat buffers: the compute copy's parameters are views into one buffer per dtype,
    and the master gradients views into one fp32 buffer, so rounding the master weights into the copy is one
    ``cat`` per dtype and moving the gradients over is one ``cat``, whatever the number of tensors (the
    per-tensor loops launch a kernel or more per parameter). Values are the ones the per-tensor copies give:
    each is a rounding or an exact widening, element by element."""

    def __init__(self, master_params: list[nn.Parameter], compute_params: list[nn.Parameter]):
        self.master_params, self.compute_params = master_params, compute_params
        self.groups: list[tuple[torch.Tensor, list[nn.Parameter]]] = []  # (flat compute buffer, its masters)
        by_dtype: dict[torch.dtype, list[tuple[nn.Parameter, nn.Parameter]]] = {}
        for master, compute in zip(master_params, compute_params, strict=True):
            by_dtype.setdefault(compute.dtype, []).append((master, compute))
        for pairs in by_dtype.values():
            flat = torch.cat([compute.detach().reshape(-1) for _, compute in pairs])
            offset = 0
            for _, compute in pairs:
                compute.data = flat[offset : offset + compute.numel()].view_as(compute)
                offset += compute.numel()
            self.groups.append((flat, [master for master, _ in pairs]))
        sizes = [param.numel() for param in master_params]
        self.grad = torch.empty(sum(sizes), dtype=torch.float32, device=master_params[0].device)
        self.grad_views = [view.view_as(p) for view, p in zip(self.grad.split(sizes), master_params, strict=True)]

    @staticmethod
    def applies(master_params: list[nn.Parameter], compute_params: list[nn.Parameter]) -> bool:
        """Plain, contiguous parameters on one device (not the DTensors of tensor parallelism)."""
        params = [*master_params, *compute_params]
        return (
            bool(params)
            and all(type(p.data) is torch.Tensor and p.is_contiguous() for p in params)
            and len({p.device for p in params}) == 1
        )

    def pull_grads(self) -> bool:
        """The compute gradients, widened to fp32, as the master gradients; False (nothing done) when some
        parameter has none (the optimizer skips those: a zero would not be the same step)."""
        grads = [compute.grad for compute in self.compute_params]
        if any(grad is None or not grad.is_contiguous() for grad in grads):
            return False
        torch.cat([grad.reshape(-1) for grad in grads], out=self.grad)
        for master, compute, view in zip(self.master_params, self.compute_params, self.grad_views, strict=True):
            master.grad, compute.grad = view, None
        return True

    def push_weights(self) -> None:
        for flat, masters in self.groups:  # the masters' current storage (a resume may have replaced it)
            torch.cat([master.detach().reshape(-1) for master in masters], out=flat)


class LowPrecisionWeights:
    """ "O2" mixed precision: a copy of the model in the compute dtype runs forward and backward
    with no autocast casts; the fp32 model stays the master copy that the optimizer updates and
    checkpoints hold (Micikevicius et al. 2018, "Mixed Precision Training"; apex opt-level O2).
    Weights and gradients move between the two through flat buffers (:class:`FlatCopy`) where the
    parameters are plain tensors, else tensor by tensor.

    BatchNorm layers stay fp32 in the compute copy (``to_compute_dtype``) and share the master's
    running statistics, so the statistics each forward updates are the ones evaluation and
    checkpoints see.
    """

    def __init__(self, master: nn.Module, dtype: torch.dtype, flat: bool = True):
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
        applies = flat and FlatCopy.applies(self.master_params, self.compute_params)
        self.flat = FlatCopy(self.master_params, self.compute_params) if applies else None
        self.push_weights()  # exact fp32 BatchNorm weights, not the round trip through the compute dtype

    def pull_grads(self) -> None:
        """Move the compute copy's gradients onto the master parameters, in fp32."""
        if self.flat is not None and self.flat.pull_grads():
            return
        for master, compute in zip(self.master_params, self.compute_params, strict=True):
            master.grad = None if compute.grad is None else compute.grad.float()
            compute.grad = None

    @torch.no_grad()
    def push_weights(self) -> None:
        """Round the master weights (and unshared buffers) into the compute copy."""
        if self.flat is not None:
            self.flat.push_weights()
        else:
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


def clip_gradients_(parameters: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most ``max_norm`` (None: leave them); return the norm before.

    Sharded gradients (DTensors of FSDP/TP) count each element once across processes: per-tensor norms
    are stacked per placement and reduced by DTensor; replicated ones count as they are (the same on
    every process). Plain gradients alone take torch's ``clip_grad_norm_``."""
    grads = [param.grad for param in parameters if param.grad is not None]
    if not any(isinstance(grad, DTensor) for grad in grads):
        if max_norm is None:
            return nn.utils.get_total_norm(grads, foreach=True)
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
    if max_norm is None:
        return total
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    local = [local_shard(grad) for grad in grads]
    torch._foreach_mul_(local, coefficient)
    return total


class BatchNormStatistics:
    """The running statistics of a model's BatchNorm layers, which every training forward updates:
    kept before the forward so a skipped step can put them back (a NaN batch would poison them).
    Flattened per dtype, so saving and restoring are a few kernels whatever the number of layers."""

    def __init__(self, model: nn.Module):
        self.buffers = [
            buffer
            for module in model.modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm)
            for buffer in module.buffers(recurse=False)
        ]
        self.groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in self.buffers:
            self.groups.setdefault(buffer.dtype, []).append(buffer)
        self.saved: dict[torch.dtype, torch.Tensor] = {}

    def save(self) -> None:
        self.saved = {dtype: _flat(group) for dtype, group in self.groups.items()}

    @torch.no_grad()
    def restore_where(self, skipped: torch.Tensor) -> None:
        """Put the saved statistics back where ``skipped`` (a device flag) is set; no host sync."""
        for dtype, group in self.groups.items():
            chosen = torch.where(skipped.bool(), self.saved[dtype], _flat(group))
            pieces = chosen.split([buffer.numel() for buffer in group])
            torch._foreach_copy_(group, [piece.view_as(buffer) for piece, buffer in zip(pieces, group, strict=True)])


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensor.reshape(-1) for tensor in tensors])


def supports_device_skip(optimizer: torch.optim.Optimizer) -> bool:
    """Fused Adam/AdamW skip a step inside the kernel when ``found_inf`` is set. (Fused SGD would
    keep uninitialized momentum buffers after a skipped first step, so it takes the host path.)"""
    return isinstance(optimizer, torch.optim.Adam) and getattr(optimizer, "_step_supports_amp_scaling", False)


def apply_precision(model: nn.Module, policy: PrecisionPolicy) -> LowPrecisionWeights | None:
    """Give ``model`` the weights its precision policy computes with: O2, a low-precision copy (returned:
    its ``compute`` module is the one that runs); full, the model itself cast in place; otherwise (and
    under FSDP2, whose mixed-precision policy is O2) nothing to do."""
    if policy.weights == "low_precision_copy":
        return LowPrecisionWeights(model, policy.compute_dtype)
    if policy.weights == "low_precision":
        to_compute_dtype(model, policy.compute_dtype)  # in place: the parameters stay the same objects
    return None


class StudentForward:
    """The training forward of ``module`` (the module each step calls) in ``policy``'s precision: inputs cast to
    the compute dtype for low-precision weights (O2's copy, full), else under the policy's training autocast.
    What a step hands its :class:`~vitrain.train.objectives.Objective` as the model."""

    def __init__(self, module: nn.Module, policy: PrecisionPolicy):
        self.module, self.policy = module, policy

    def __call__(self, images: torch.Tensor) -> Outputs:
        if self.policy.casts_inputs:  # O2's copy and full: low-precision weights, no autocast
            return self.module(images.to(self.policy.compute_dtype))
        with self.policy.training_context():
            return self.module(images)


class TrainStep:
    """Callable holding what every step needs; returns the loss and grad norm as device tensors.
    After each call ``skipped`` is a device flag (float 1.0 or 0.0): the step's update was skipped.

    ``objective``: what each micro-batch computes, its forward and loss (:mod:`vitrain.train.objectives`:
    classification, distillation, token labeling); the step calls it with a :class:`StudentForward` of the
    module that runs and does the rest: precision, accumulation, clipping, skips. ``low_precision``: O2's copy
    from :func:`apply_precision`; ``forward_module``: the module each step calls (the model or that copy,
    possibly wrapped by ``parallelize``); ``micro_batch``: images per forward/backward (gradient accumulation;
    None: the whole batch at once); ``agree_on_skip``: with several processes, makes every process skip when
    one does (each sees only its own loss)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        policy: PrecisionPolicy,
        objective: Objective,
        grad_clip: float | None,
        *,
        micro_batch: int | None = None,
        low_precision: LowPrecisionWeights | None = None,
        forward_module: nn.Module | None = None,
        agree_on_skip: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        if (low_precision is not None) != (policy.weights == "low_precision_copy"):
            raise ValueError("precision_mode=o2 runs the low-precision copy from apply_precision(); nothing else does")
        self.model, self.optimizer, self.scaler, self.policy = model, optimizer, scaler, policy
        self.objective, self.grad_clip = objective, grad_clip
        self.low_precision = low_precision
        self.sharded = holds_dtensors(model)  # FSDP/TP shard before the step is built
        if forward_module is None:
            forward_module = low_precision.compute if low_precision is not None else model
        self.forward_module = forward_module
        self.student = StudentForward(forward_module, policy)
        self.micro_batch = micro_batch
        self.batchnorm = BatchNormStatistics(model)
        self.device_skip = supports_device_skip(optimizer)
        self.agree_on_skip = agree_on_skip or (lambda flag: flag)
        self.skipped = torch.zeros((), device=policy.device)

    def optimizer_context(self) -> contextlib.AbstractContextManager:
        """Sharded parameters are DTensors; plain tensors beside them (the norms and embeddings tensor
        parallelism leaves whole, the fused optimizers' found_inf flag) count as replicated."""
        return implicit_replication() if self.sharded else contextlib.nullcontext()

    def weights_changed(self) -> None:
        """Call after loading weights into the model (resume) so the compute copy follows."""
        if self.low_precision is not None:
            self.low_precision.push_weights()

    def warm_up(self, batches: Iterable[torch.Tensor]) -> None:
        """Forward (the objective's :meth:`~vitrain.train.objectives.Objective.warm_up`) and backward of each
        batch with no gradient reduction across processes and no update, then drop the gradients: compiles the
        training shapes before the clock starts (``performance.compile``)."""
        for images in batches:
            with deferred_gradient_sync(self.forward_module):
                outputs = self.objective.warm_up(self.student, images)
                sum(
                    logits.float().sum() for logits in (outputs if isinstance(outputs, tuple) else (outputs,))
                ).backward()
        self.optimizer.zero_grad(set_to_none=True)
        for module in (self.model, self.forward_module):
            for param in module.parameters():
                param.grad = None

    def _loss(self, images: torch.Tensor, targets: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        """The objective's forward and loss of one micro-batch."""
        outputs = self.objective.forward(self.student, images, targets, **context)
        return self.objective.loss(outputs, targets, **context)

    def __call__(
        self, images: torch.Tensor, targets: torch.Tensor, **context: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on the batch (``targets``: what the objective takes: class indices, soft targets
        (B, classes) of a mixed batch, or token labeling's dense targets; ``context``: the step's further
        inputs to the objective, as token labeling's ``token_box``), skipped when the loss or gradient norm is
        not finite; with ``micro_batch`` set, gradients are accumulated over micro-batches of that size (each
        loss weighted by its share, so the update is the batch's) and DDP reduces them once, on the last."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.batchnorm.buffers:
            self.batchnorm.save()
        micro = self.micro_batch or len(targets)
        pieces = list(zip(images.split(micro), targets.split(micro), strict=True))
        loss = torch.zeros((), device=targets.device)
        for index, (piece_images, piece_targets) in enumerate(pieces):
            last = index == len(pieces) - 1
            with contextlib.nullcontext() if last else deferred_gradient_sync(self.forward_module):
                share = len(piece_targets) / len(targets)
                piece_loss = self._loss(piece_images, piece_targets, context) * share
                self.scaler.scale(piece_loss).backward()
            loss += piece_loss.detach()
        if self.low_precision is not None:
            self.low_precision.pull_grads()
        self.scaler.unscale_(self.optimizer)  # fp16: true gradients for the norm, the clip and the check
        grad_norm = self._grad_norm()
        self.skipped = self.agree_on_skip((~(torch.isfinite(loss) & torch.isfinite(grad_norm))).float())
        self._update(self.skipped)
        self.scaler.update()  # fp16: a step with overflowing gradients also lowers the loss scale
        if self.batchnorm.buffers:
            self.batchnorm.restore_where(self.skipped)
        if self.low_precision is not None:
            self.low_precision.push_weights()
        return loss, grad_norm

    def _grad_norm(self) -> torch.Tensor:
        """The global gradient norm, clipped to ``grad_clip`` when set."""
        parameters = [parameter for parameter in self.model.parameters() if parameter.grad is not None]
        return clip_gradients_(parameters, self.grad_clip)

    def _update(self, skipped: torch.Tensor) -> None:
        """The optimizer step, unless ``skipped``: on the device for fused Adam(W), else on the host."""
        if self.device_skip:
            with self.optimizer_context():
                adam_step_unless_found_inf(self.optimizer, skipped)
        elif not skipped.item():  # the host sync of this path
            with self.optimizer_context():
                self.optimizer.step()
