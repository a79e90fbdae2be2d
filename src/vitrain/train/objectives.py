"""What a training step optimizes: the forward of a micro-batch and its loss, apart from how the step computes.

:class:`~vitrain.train.step.TrainStep` keeps precision (autocast, O2's copy, full weights, the loss scaler),
gradient accumulation, clipping and the skipping of non-finite steps; an :class:`Objective` chosen by
``build_run`` (:func:`vitrain.train.build.build_objective`) says what each micro-batch computes:

- :class:`Classification`: the logits against hard labels or soft (mixed, smoothed) targets, cross-entropy or
  binary cross-entropy (:class:`~vitrain.train.losses.TrainingLoss`);
- :class:`Distillation`: DeiT's knowledge distillation, the frozen teacher's logits then the student's two
  heads (:class:`~vitrain.train.losses.DistillationLoss`);
- :class:`TokenLabeling`: the class and auxiliary heads against dense targets, with MixToken
  (:func:`~vitrain.token_labeling.token_labeling_loss`).

An objective is any object with the three methods of :class:`Objective`; the step calls ``forward`` then
``loss`` on each micro-batch (their ``context`` is what the step was called with besides images and targets,
the same for every micro-batch: MixToken's ``token_box``), and ``warm_up`` when compiling shapes. It calls
the model through the :class:`Student` the step hands it, which runs it in the run's precision.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal, Protocol

import torch
from torch import nn

from vitrain.config.plan import TokenLabelPlan
from vitrain.config.precision import PrecisionPolicy
from vitrain.token_labeling.loss import token_labeling_loss
from vitrain.token_labeling.mixtoken import MixTokenHook, TokenBox
from vitrain.train.losses import DistillationLoss, TrainingLoss

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


class Student(Protocol):
    """The model as a training step runs it: ``student(images)`` is the training forward in the run's
    precision (inputs cast for low-precision weights, else under the policy's training autocast)."""

    module: nn.Module
    """The module each forward calls (possibly wrapped by DDP, FSDP or compile): head switches go on it."""
    policy: PrecisionPolicy

    def __call__(self, images: torch.Tensor) -> Outputs: ...


class Objective(Protocol):
    """The forward and the loss of one micro-batch, and the forward that compiles the training shapes."""

    def forward(self, model: Student, images: torch.Tensor, targets: torch.Tensor, **context: Any) -> Any:
        """Everything computed from the micro-batch's images (teacher, student, hooks), for :meth:`loss`."""
        ...

    def loss(self, outputs: Any, targets: torch.Tensor, **context: Any) -> torch.Tensor:
        """The micro-batch's loss (a device scalar) of :meth:`forward`'s ``outputs``."""
        ...

    def warm_up(self, model: Student, images: torch.Tensor) -> Outputs:
        """The student's outputs of a training-shaped forward (no targets); the step backpropagates their sum."""
        ...


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


class Classification:
    """The logits against the batch's targets by ``loss`` (``ce`` or ``bce``, :class:`TrainingLoss`): class
    indices, where ``label_smoothing`` applies, or soft targets ``(B, classes)`` of a mixed batch, which hold
    their smoothing."""

    def __init__(self, loss: Literal["ce", "bce"] = "ce", label_smoothing: float = 0.0):
        self.criterion = TrainingLoss(loss, label_smoothing)

    def forward(self, model: Student, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return model(images)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.criterion(outputs.float(), targets)

    def warm_up(self, model: Student, images: torch.Tensor) -> Outputs:
        return model(images)


def _as_pair(outputs: Outputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(class logits, distillation logits) in fp32; a model without a distillation token gives its logits as both."""
    cls_logits, dist_logits = outputs if isinstance(outputs, tuple) else (outputs, outputs)
    return cls_logits.float(), dist_logits.float()


class Distillation:
    """Knowledge distillation: the frozen ``teacher`` runs on each micro-batch's (normalized, mixed) images
    first, with no gradient, under the run's autocast; then the student returns both heads' logits, and
    ``criterion`` (:class:`~vitrain.train.losses.DistillationLoss`) weighs the label and teacher terms."""

    def __init__(self, criterion: DistillationLoss, teacher: nn.Module):
        self.criterion, self.teacher = criterion, teacher

    @torch.no_grad()
    def teacher_logits(self, model: Student, images: torch.Tensor) -> torch.Tensor:
        """The teacher's fp32 logits, computed in the student's precision."""
        with model.policy.autocast_context():
            return self.teacher(images).float()

    def forward(self, model: Student, images: torch.Tensor, targets: torch.Tensor) -> tuple[Outputs, torch.Tensor]:
        teacher_logits = self.teacher_logits(model, images)
        with both_heads(model.module, "distill"):
            return model(images), teacher_logits

    def loss(self, outputs: tuple[Outputs, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        student, teacher_logits = outputs
        cls_logits, dist_logits = _as_pair(student)
        return self.criterion(cls_logits, dist_logits, targets, teacher_logits)

    def warm_up(self, model: Student, images: torch.Tensor) -> Outputs:
        self.teacher_logits(model, images)
        with both_heads(model.module, "distill"):
            return model(images)


MixBox = tuple[TokenBox, float]
"""A step's MixToken box on the auxiliary grid and the share of each image's own tokens."""


class TokenLabeling:
    """Token labeling (``plan``): the targets are ``(B, C, 1 + N)`` dense targets
    (:class:`~vitrain.token_labeling.training.TokenTargets`), the model returns its class and auxiliary heads
    apart, and the loss is :func:`~vitrain.token_labeling.token_labeling_loss`. ``mix_token``: the MixToken
    hook on the running model's patch embedding; each step then takes its ``token_box`` (a :data:`MixBox`),
    mixes the forward with it and puts the auxiliary outputs back in their images' order."""

    def __init__(self, plan: TokenLabelPlan, mix_token: MixTokenHook | None = None):
        if mix_token is not None and not plan.mix_token:
            raise ValueError("a MixToken hook needs token labels with mix_token on")
        self.plan, self.mix_token = plan, mix_token

    def _mixing(self, images: torch.Tensor, token_box: MixBox | None) -> contextlib.AbstractContextManager:
        """MixToken with ``token_box`` for the forwards inside (nothing without a hook or a box)."""
        if self.mix_token is None or token_box is None:
            return contextlib.nullcontext()
        grid = self.plan.grid(images.shape[-1])
        return self.mix_token.mixing(token_box[0], (grid, grid))

    def forward(
        self, model: Student, images: torch.Tensor, targets: torch.Tensor, token_box: MixBox | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with self._mixing(images, token_box):
            with both_heads(model.module, "aux"):
                cls_logits, aux_logits = model(images)
            if self.mix_token is not None:
                aux_logits = self.mix_token.unmix(aux_logits)
        return cls_logits, aux_logits

    def loss(
        self, outputs: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor, token_box: MixBox | None = None
    ) -> torch.Tensor:
        cls_logits, aux_logits = outputs
        lam = token_box[1] if token_box is not None else 1.0
        plan = self.plan
        return token_labeling_loss(
            cls_logits, aux_logits, targets[:, :, 0], targets[:, :, 1:], lam, plan.dense_weight, plan.cls_weight
        )

    def warm_up(self, model: Student, images: torch.Tensor) -> Outputs:
        """With MixToken, with a box set, as every training forward has one."""
        box = (TokenBox(0, 1, 0, 1), 1.0) if self.mix_token is not None else None
        with self._mixing(images, box), both_heads(model.module, "aux"):
            return model(images)
