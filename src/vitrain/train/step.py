"""One training step: forward, loss, backward, clip, optimizer. No I/O, no sync (the loop sets the LR).

A step whose loss or gradient norm is not finite changes nothing: no parameter, optimizer-state or
BatchNorm-statistics update (fp16 loss scaling's semantics, for every precision). With a fused
AdamW the skip happens on the device (the kernel's ``found_inf`` input, as torch's GradScaler uses
it), so no step waits for the device; other optimizers read one flag per step on the host.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from vitrain.config.plan import DistillPlan, TokenLabelPlan
from vitrain.config.precision import PrecisionPolicy
from vitrain.parallel.distributed import holds_dtensors, local_shard
from vitrain.token_labeling.loss import token_labeling_loss
from vitrain.token_labeling.mixtoken import MixTokenHook, TokenBox
from vitrain.train.losses import DistillationLoss, TrainingLoss


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


HEAD_SWITCHES = {"distill": "set_distilled_training", "aux": "set_aux_output"}
"""The model method that makes a forward return two heads apart: the distillation head, the auxiliary head."""


@contextlib.contextmanager
def both_heads(module: nn.Module, which: str = "distill"):
    """While inside, models among ``module``'s submodules with a distillation token (``which="distill"``:
    ``set_distilled_training``) return ``(cls_logits, dist_logits)`` from a training forward; with an
    auxiliary head (``which="aux"``: ``set_aux_output``), ``(cls_logits, aux_logits)`` from any forward. Set on
    the inner model so the call still goes through ``module`` (DDP's and FSDP's hooks run); other models
    return plain logits."""
    switch = HEAD_SWITCHES[which]
    students = [child for child in module.modules() if hasattr(child, switch)]
    for student in students:
        getattr(student, switch)(True)
    try:
        yield
    finally:
        for student in students:
            getattr(student, switch)(False)


def _as_pair(outputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(class logits, distillation logits) in fp32; a model without a distillation token gives its logits as both."""
    cls_logits, dist_logits = outputs if isinstance(outputs, tuple) else (outputs, outputs)
    return cls_logits.float(), dist_logits.float()


class TrainStep:
    """Callable holding what every step needs; returns the loss and grad norm as device tensors.
    After each call ``skipped`` is a device flag (float 1.0 or 0.0): the step's update was skipped.

    ``low_precision``: O2's copy from :func:`apply_precision`; ``forward_module``: the module each step
    calls (the model or that copy, possibly wrapped by ``parallelize``); ``micro_batch``: images per
    forward/backward (gradient accumulation; None: the whole batch at once); ``agree_on_skip``: with
    several processes, makes every process skip when one does (each sees only its own loss); ``loss``:
    ``ce`` or ``bce`` (:class:`~vitrain.train.losses.TrainingLoss`): on hard labels with ``label_smoothing``,
    or on the soft targets of mixed batches, which hold their smoothing. ``teacher`` and ``distill``: knowledge
    distillation (:class:`~vitrain.train.losses.DistillationLoss`): the frozen teacher runs on each
    micro-batch (no gradient, under the policy's autocast) and the student returns both heads' logits.
    ``token_labels``: token labeling; the step's targets are ``(B, C, 1 + N)`` dense targets
    (:class:`~vitrain.token_labeling.training.TokenTargets`) and the model returns its class and auxiliary
    heads apart; ``mix_token``: the MixToken hook on the running model's patch embedding (each call then takes
    its ``token_box``)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        policy: PrecisionPolicy,
        label_smoothing: float,
        grad_clip: float | None,
        *,
        micro_batch: int | None = None,
        low_precision: LowPrecisionWeights | None = None,
        forward_module: nn.Module | None = None,
        agree_on_skip: Callable[[torch.Tensor], torch.Tensor] | None = None,
        loss: str = "ce",
        teacher: nn.Module | None = None,
        distill: DistillPlan | None = None,
        token_labels: TokenLabelPlan | None = None,
        mix_token: MixTokenHook | None = None,
    ):
        if (low_precision is not None) != (policy.weights == "low_precision_copy"):
            raise ValueError("precision_mode=o2 runs the low-precision copy from apply_precision(); nothing else does")
        self.model, self.optimizer, self.scaler, self.policy = model, optimizer, scaler, policy
        if (teacher is None) != (distill is None):
            raise ValueError("distillation needs both a teacher and its DistillPlan")
        self.criterion, self.grad_clip = TrainingLoss(loss, label_smoothing), grad_clip
        self.teacher = teacher
        self.distillation = (
            DistillationLoss(self.criterion, distill.kind, distill.alpha, distill.tau) if distill is not None else None
        )
        self.token_labels, self.mix_token = token_labels, mix_token
        if mix_token is not None and (token_labels is None or not token_labels.mix_token):
            raise ValueError("a MixToken hook needs token labels with mix_token on")
        self.low_precision = low_precision
        self.sharded = holds_dtensors(model)  # FSDP/TP shard before the step is built
        if forward_module is None:
            forward_module = low_precision.compute if low_precision is not None else model
        self.forward_module = forward_module
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

    def _mixing(self, images: torch.Tensor, token_box: tuple[TokenBox, float] | None):
        """MixToken with ``token_box`` for the forwards inside (nothing without a hook or a box)."""
        if self.mix_token is None or token_box is None:
            return contextlib.nullcontext()
        grid = self.token_labels.grid(images.shape[-1])
        return self.mix_token.mixing(token_box[0], (grid, grid))

    def warm_up(self, batches: Iterable[torch.Tensor]) -> None:
        """Forward and backward of each batch with no gradient reduction across processes and no update,
        then drop the gradients: compiles the training shapes before the clock starts (``train.compile``);
        with MixToken, with a box set, as every training forward has one."""
        for images in batches:
            box = (TokenBox(0, 1, 0, 1), 1.0) if self.mix_token is not None else None
            with deferred_gradient_sync(self.forward_module), self._mixing(images, box):
                if self.teacher is not None:
                    self._teacher_logits(images)
                outputs = self._forward(images)
                sum(
                    logits.float().sum() for logits in (outputs if isinstance(outputs, tuple) else (outputs,))
                ).backward()
        self.optimizer.zero_grad(set_to_none=True)
        for module in (self.model, self.forward_module):
            for param in module.parameters():
                param.grad = None

    def _forward(self, images: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.teacher is not None:
            heads = both_heads(self.forward_module, "distill")
        elif self.token_labels is not None:
            heads = both_heads(self.forward_module, "aux")
        else:
            heads = contextlib.nullcontext()
        with heads:
            if self.policy.casts_inputs:  # O2's copy and full: low-precision weights, no autocast
                return self.forward_module(images.to(self.policy.compute_dtype))
            with self.policy.training_context():
                return self.forward_module(images)

    @torch.no_grad()
    def _teacher_logits(self, images: torch.Tensor) -> torch.Tensor:
        """The frozen teacher on the student's (normalized, mixed) images, in the run's precision."""
        with self.policy.autocast_context():
            return self.teacher(images).float()

    def _loss(
        self, images: torch.Tensor, labels: torch.Tensor, token_box: tuple[TokenBox, float] | None = None
    ) -> torch.Tensor:
        """The forward and the loss of one micro-batch (with the teacher's forward when distilling; mixed by
        ``token_box`` and against dense targets with token labels)."""
        if self.token_labels is not None:
            plan = self.token_labels
            with self._mixing(images, token_box):
                cls_logits, aux_logits = self._forward(images)
                if self.mix_token is not None:
                    aux_logits = self.mix_token.unmix(aux_logits)
            lam = token_box[1] if token_box is not None else 1.0
            return token_labeling_loss(
                cls_logits, aux_logits, labels[:, :, 0], labels[:, :, 1:], lam, plan.dense_weight, plan.cls_weight
            )
        if self.distillation is None:
            return self.criterion(self._forward(images).float(), labels)
        teacher_logits = self._teacher_logits(images)
        cls_logits, dist_logits = _as_pair(self._forward(images))
        return self.distillation(cls_logits, dist_logits, labels, teacher_logits)

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, token_box: tuple[TokenBox, float] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on the batch (``labels``: class indices, soft targets (B, classes) of a
        mixed batch, or token labeling's dense targets with the step's MixToken ``token_box`` and its share
        of own tokens), skipped when the loss or gradient norm is not finite; with
        ``micro_batch`` set, gradients are accumulated over micro-batches of that size (each loss weighted
        by its share, so the update is the batch's) and DDP reduces them once, on the last."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.batchnorm.buffers:
            self.batchnorm.save()
        micro = self.micro_batch or len(labels)
        pieces = list(zip(images.split(micro), labels.split(micro), strict=True))
        loss = torch.zeros((), device=labels.device)
        for index, (piece_images, piece_labels) in enumerate(pieces):
            last = index == len(pieces) - 1
            with contextlib.nullcontext() if last else deferred_gradient_sync(self.forward_module):
                share = len(piece_labels) / len(labels)
                piece_loss = self._loss(piece_images, piece_labels, token_box) * share
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
            self.optimizer.grad_scale, self.optimizer.found_inf = None, skipped
            try:
                with self.optimizer_context():
                    self.optimizer.step()
            finally:
                del self.optimizer.grad_scale, self.optimizer.found_inf
        elif not skipped.item():  # the host sync of this path
            with self.optimizer_context():
                self.optimizer.step()
