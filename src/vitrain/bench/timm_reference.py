"""The same architecture built and trained the timm way, timed by the same harness.

timm's defaults as its ``train.py`` uses them: ``timm.create_model`` (fused attention), AdamW
with torch's default implementation (foreach, not fused), autocast for bf16/fp16 (no O2), no
gradient clipping, the LR schedule stepped per epoch (so not in the step). The loss is ours
(cross-entropy with the plan's label smoothing; timm's default smoothing is 0.1 too).
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.bench.memory import PeakMemory
from vitrain.bench.throughput import (
    BenchSettings,
    apply_compile,
    breakdown_record,
    describe_run,
    measure_training_step,
    synthetic_batch,
    throughput_record,
    time_training_steps,
)
from vitrain.config import ConfigError, Plan, precision_policy
from vitrain.models import ViTArgs, VOLOArgs, build_model, model_spec, num_parameters
from vitrain.models.flops import model_flops, vit_flops
from vitrain.train.step import build_grad_scaler

# timm VisionTransformer whose named defaults a ViT of other dimensions overrides.
_TIMM_VIT_BASE = "vit_tiny_patch16_224"
_TIMM_WEIGHT_DECAY = 0.05


@dataclasses.dataclass(frozen=True)
class TimmReference:
    """How to build the timm counterpart of a planned model."""

    architecture: str
    """timm model name given to ``timm.create_model``."""
    kwargs: dict[str, Any]
    """The other ``create_model`` arguments (size, classes, channels, head, dimensions)."""
    description: str
    """What the reference is, and how it differs from our model."""
    flops_per_image: int
    """Analytic forward FLOPs per image of the timm architecture."""


def _planned_model(plan: Plan) -> nn.Module:
    """The plan's model on the meta device (for its args and FLOPs; costs no memory)."""
    return build_model(plan.model.name, device="meta", **plan.model.arguments)


def _timm_architecture(name: str) -> tuple[str | None, str | None]:
    """timm's name for our variant, or for the plain ViT a locality ViT adds its FFN to; and that variant."""
    from vitrain.models.timm_weights import TIMM_NAMES

    for variant in (name, name.removeprefix("locality_")):
        if variant in TIMM_NAMES:
            return TIMM_NAMES[variant], variant
    return None, None


def _create_model_kwargs(args: Any, plan: Plan) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"num_classes": plan.model.num_classes, "in_chans": plan.model.in_chans}
    if isinstance(args, (ViTArgs, VOLOArgs)):  # timm's ResNet takes any input size and no img_size
        kwargs["img_size"] = plan.model.image_size
    if getattr(args, "head", None) == "gap":
        kwargs.update(global_pool="avg", class_token=False)
    if getattr(args, "drop_path_rate", 0.0):
        kwargs["drop_path_rate"] = args.drop_path_rate
    return kwargs


def _vit_dimensions(args: ViTArgs) -> dict[str, Any]:
    hidden = args.mlp_dim or int(args.embed_dim * args.mlp_ratio)
    return {
        "embed_dim": args.embed_dim,
        "depth": args.depth,
        "num_heads": args.num_heads,
        "mlp_ratio": hidden / args.embed_dim,
        "patch_size": args.patch_size,
    }


def timm_reference(plan: Plan) -> TimmReference:
    """The timm counterpart of the plan's model: its timm name; for a locality ViT the plain ViT of
    the same size, for a conv-stem ViT the patchify one; for other ViTs timm's VisionTransformer with the same dimensions. Raises
    ConfigError for families timm lacks (LocalViT's BN + SE FFN)."""
    name = plan.model.name
    model = _planned_model(plan)
    args = model.args
    kwargs = _create_model_kwargs(args, plan)
    architecture, variant = _timm_architecture(name)
    notes = []
    if isinstance(args, ViTArgs) and args.ffn in ("mlp", "locality"):
        named = _vit_dimensions(model_spec(variant).args) if variant else {}
        dimensions = {key: value for key, value in _vit_dimensions(args).items() if named.get(key) != value}
        kwargs.update(dimensions)  # model.patch_size / model.mlp_ratio overrides reach timm too
        changed = ", ".join(f"{key}={value}" for key, value in dimensions.items())
        if architecture is None:
            architecture = _TIMM_VIT_BASE
            notes.append(f"timm VisionTransformer with {changed}")
        elif changed:
            notes.append(f"with {changed}")
    if architecture is None:
        raise ConfigError(
            f"--compare-timm: {name} has no timm equivalent; it covers vit_*, deit_*, locality_vit_* "
            "(against the plain ViT), volo_* and resnet50 models"
        )
    if isinstance(args, ViTArgs):  # timm builds the plain FFN and the patchify stem
        notes += ["no locality FFN in timm"] if args.ffn == "locality" else []
        notes += ["timm's patchify stem in place of the conv stem"] if args.stem == "conv" else []
        flops = vit_flops(dataclasses.replace(args, ffn="mlp", stem="patch"), plan.model.image_size)
    else:
        flops = model_flops(model, plan.model.image_size)
    description = architecture + (f" ({'; '.join(notes)})" if notes else "")
    return TimmReference(architecture, kwargs, description, flops)


def _import_timm():
    try:
        import timm
    except ImportError:
        raise ConfigError("--compare-timm needs timm: pip install timm (or the [dev] extra)") from None
    return timm


class TimmStyleStep:
    """timm ``train.py``'s step with its defaults: autocast forward and loss, scaled backward,
    optimizer step; no clipping, no per-step scheduler."""

    def __init__(self, model: nn.Module, plan: Plan):
        self.model = model
        self.policy = precision_policy(plan.precision.dtype, "autocast", plan.device)  # timm's AMP
        self.label_smoothing = plan.step.label_smoothing
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=plan.optim.lr, weight_decay=_TIMM_WEIGHT_DECAY)
        self.scaler = build_grad_scaler(self.policy)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.optimizer.zero_grad(set_to_none=True)
        with self.policy.autocast_context():
            output = self.model(images)
            logits = output[0] if isinstance(output, tuple) else output
            loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach(), None


def measure_timm_training_step(plan: Plan, settings: BenchSettings, reference: TimmReference) -> dict[str, Any]:
    """Time timm's model and step with the harness :func:`measure_training_step` uses."""
    timm = _import_timm()
    memory = PeakMemory(plan.device)
    memory.start()
    torch.manual_seed(plan.seed)
    model = timm.create_model(reference.architecture, pretrained=False, **reference.kwargs).to(plan.device)
    model.train()
    apply_compile(model, settings)
    step = TimmStyleStep(model, plan)
    images, labels = synthetic_batch(plan)
    times = time_training_steps(step, images, labels, plan.device, settings)
    memory.stop()
    record = throughput_record(plan, times, settings, reference.flops_per_image, memory)
    return {
        "implementation": "timm",
        "model": reference.architecture,
        "timm_reference": reference.description,
        "timm_version": timm.__version__,
        **describe_run(plan, settings),
        "precision_mode": "autocast",
        "optimizer": "adamw torch default (foreach)",
        "grad_clip": None,
        "num_params": num_parameters(model),
        **record,
        **breakdown_record(step, images, labels, plan.device, settings, record),
    }


def _release_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def compare_with_timm(plan: Plan, settings: BenchSettings, timm_eager: bool = False) -> dict[str, Any]:
    """Our record, with the timm reference's record under ``timm`` and ``ours_over_timm`` (img/s ratio).
    ``timm_eager`` with ``settings.compile``: timm also as its ``train.py`` runs by default, not compiled,
    under ``timm_eager`` and ``ours_over_timm_eager``."""
    _import_timm()
    reference = timm_reference(plan)  # fail on a model timm lacks before measuring anything
    ours = measure_training_step(plan, settings)
    _release_memory(plan.device)
    theirs = measure_timm_training_step(plan, settings, reference)
    _release_memory(plan.device)
    result = {**ours, "timm": theirs, "ours_over_timm": ours["img_s_median"] / theirs["img_s_median"]}
    if timm_eager and settings.compile:
        eager = measure_timm_training_step(plan, dataclasses.replace(settings, compile=False), reference)
        _release_memory(plan.device)
        result |= {"timm_eager": eager, "ours_over_timm_eager": ours["img_s_median"] / eager["img_s_median"]}
    return result
