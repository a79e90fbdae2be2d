"""Weights to and from timm: a model trained here loads into ``timm.create_model`` and back.

Our ViT, DeiT, VOLO and ResNet-50 use timm's parameter names, so conversion is a name map of
variants plus a check; families timm lacks (locality ViT, LocalViT) are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vitrain.models import VOLOArgs, build_model, load_weights, model_spec

# Our variant -> timm architecture.
TIMM_NAMES = {
    "vit_tiny_patch16": "vit_tiny_patch16_224",
    "vit_small_patch16": "vit_small_patch16_224",
    "vit_base_patch16": "vit_base_patch16_224",
    "vit_large_patch16": "vit_large_patch16_224",
    "vit_huge_patch14": "vit_huge_patch14_224",
    "vit_giant_patch14": "vit_giant_patch14_224",
    "vit_gigantic_patch14": "vit_gigantic_patch14_224",
    "deit_tiny_patch16": "deit_tiny_patch16_224",
    "deit_small_patch16": "deit_small_patch16_224",
    "deit_base_patch16": "deit_base_patch16_224",
    "deit_tiny_distilled_patch16": "deit_tiny_distilled_patch16_224",
    "deit_small_distilled_patch16": "deit_small_distilled_patch16_224",
    "deit_base_distilled_patch16": "deit_base_distilled_patch16_224",
    **{f"volo_d{depth}": f"volo_d{depth}_224" for depth in range(1, 6)},
    "resnet50": "resnet50",
}
_OUR_NAMES = {timm_name: ours for ours, timm_name in TIMM_NAMES.items()}


def register_timm_name(ours: str, theirs: str) -> None:
    TIMM_NAMES[ours] = theirs
    _OUR_NAMES[theirs] = ours


def timm_name(name: str) -> str:
    """The timm architecture equal to our variant ``name``."""
    model_spec(name)  # unknown names fail with the registry's hint
    if name not in TIMM_NAMES:
        raise ValueError(f"{name} has no timm equivalent; timm conversion covers {', '.join(sorted(TIMM_NAMES))}")
    return TIMM_NAMES[name]


def variant_for_timm(architecture: str | None) -> str:
    """Our variant of timm architecture ``architecture`` (no ``.tag``); ValueError when there is none."""
    if architecture not in _OUR_NAMES:
        raise ValueError(
            f"timm architecture {architecture!r} has no vitrain variant (timm architectures vitrain has: "
            f"{', '.join(sorted(_OUR_NAMES))})"
        )
    return _OUR_NAMES[architecture]


def inferred_model_args(state_dict: Mapping[str, torch.Tensor], name: str) -> dict[str, Any]:
    """Args a state dict fixes that can differ from the variant's defaults (classes, size, head)."""
    args = model_spec(name).args
    overrides: dict[str, Any] = {}
    for key in ("head.weight", "fc.weight"):
        if key in state_dict and hasattr(args, "num_classes"):
            overrides["num_classes"] = state_dict[key].shape[0]
    if hasattr(args, "in_chans"):
        # the first layer: VOLO's stem, ResNet's, a ViT's convolutional stem, else a ViT's patchify projection
        first_layers = (
            "patch_embed.conv.0.weight",
            "conv1.weight",
            "patch_embed.convs.0.weight",
            "patch_embed.proj.weight",
        )
        for key in first_layers:
            if key in state_dict:
                overrides["in_chans"] = state_dict[key].shape[1]
                break
    if isinstance(args, VOLOArgs) and "pos_embed" in state_dict:  # a (1, H, W, C) grid at 1/16
        overrides["img_size"] = state_dict["pos_embed"].shape[1] * args.pos_embed_stride
    if hasattr(args, "head") and "pos_embed" in state_dict and state_dict["pos_embed"].ndim == 3:
        prefix = ("cls_token" in state_dict) + ("dist_token" in state_dict)
        grid = round((state_dict["pos_embed"].shape[1] - prefix) ** 0.5)
        overrides.update(head="cls" if prefix else "gap", img_size=grid * args.patch_size)
        overrides["distill_token"] = "dist_token" in state_dict
    for field in ("aux_head", "use_aux_head"):  # token labeling's head: ViTs' and VOLO's argument
        if hasattr(args, field):
            overrides[field] = "aux_head.weight" in state_dict
    return overrides


def from_timm(source: nn.Module | Mapping[str, torch.Tensor], name: str | None = None, **overrides: Any) -> nn.Module:
    """Our model holding the weights of a timm model (or its state dict).

    ``name`` is our variant; for a timm model it defaults to the one matching its architecture.
    Classes, input size, channels and head are read from the weights; ``overrides`` set the rest
    (``img_size=`` another resolution resamples the position embedding bicubically).
    """
    if isinstance(source, nn.Module):
        if name is None:
            try:
                name = variant_for_timm(getattr(source, "pretrained_cfg", {}).get("architecture"))
            except ValueError as error:
                raise ValueError(f"{error}; pass name= with a variant of the same family") from None
        state_dict = source.state_dict()
    else:
        if name is None:
            raise ValueError("from_timm(state_dict) needs name= (our variant, see `vitrain list-models`)")
        state_dict = source
    timm_name(name)
    model = build_model(name, **{**inferred_model_args(state_dict, name), **overrides})
    load_weights(model, state_dict)  # an img_size override resamples the position embedding
    return model


def to_timm(model: nn.Module) -> dict[str, torch.Tensor]:
    """A state dict that ``timm.create_model(timm_name(variant), ...)`` loads with ``strict=True``
    (pass the model's num_classes and img_size, and ``global_pool="avg", class_token=False``
    for a ``gap`` head)."""
    if getattr(getattr(model, "args", None), "stem", "patch") != "patch":
        raise ValueError("timm's VisionTransformer has only the patchify stem; this model has model.stem=conv")
    if getattr(getattr(model, "args", None), "aux_head", False):
        raise ValueError(
            "timm's VisionTransformer has no token-labeling head; this model has model.aux_head=true "
            "(export it without timm, or train with model.aux_head=false)"
        )
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


TIMM_ARCHITECTURE_OPTIONS = ("patch_size", "num_heads", "mlp_ratio", "use_aux_head")
"""Architecture arguments that timm's models take under the same name: passed on when they differ from
the variant's."""


def timm_model_args(name: str, model: nn.Module) -> dict[str, Any]:
    """Keyword arguments of ``timm.create_model(timm_name(name), ...)`` for the timm model equal to our
    ``model`` (variant ``name``): classes, channels, input size, head, and the architecture options set
    apart from the variant's; ValueError naming why when timm has no such model."""
    architecture = timm_name(name)
    args, variant = model.args, model_spec(name).args
    if getattr(args, "distill_token", False) != getattr(variant, "distill_token", False):
        raise ValueError(
            f"{name} with model.distill_token={args.distill_token} has no timm equivalent ({architecture} "
            f"{'has' if variant.distill_token else 'has no'} distillation token)"
        )
    kwargs: dict[str, Any] = {"num_classes": args.num_classes, "in_chans": args.in_chans}
    if hasattr(model, "pos_embed"):  # ViTs and VOLO fix their input size; a ResNet takes any
        kwargs["img_size"] = args.img_size
    if getattr(args, "head", "cls") == "gap":
        kwargs.update(global_pool="avg", class_token=False)
    for option in TIMM_ARCHITECTURE_OPTIONS:
        if hasattr(args, option) and getattr(args, option) != getattr(variant, option):
            value = getattr(args, option)
            kwargs[option] = list(value) if isinstance(value, tuple) else value
    return kwargs


def timm_hub_config(
    name: str,
    model: nn.Module,
    mean: Sequence[float],
    std: Sequence[float],
    crop_pct: float,
    label_names: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of a timm model folder (Hugging Face hub layout; ``timm.create_model("local-dir:
    FOLDER")`` reads it) for our ``model`` (variant ``name``) with its weights from :func:`to_timm`, evaluated
    with ``mean``/``std`` normalization and a ``crop_pct`` bilinear resize and centre crop. Checks that the
    timm model has exactly the tensors ``to_timm`` gives; ValueError naming why not."""
    import timm

    weights = to_timm(model)
    kwargs = timm_model_args(name, model)
    with torch.device("meta"):
        theirs = timm.create_model(timm_name(name), pretrained=False, **kwargs)
    expected = {key: tuple(value.shape) for key, value in theirs.state_dict().items()}
    if expected != {key: tuple(value.shape) for key, value in weights.items()}:
        different = sorted(set(expected.items()) ^ {(key, tuple(value.shape)) for key, value in weights.items()})
        raise ValueError(f"timm's {timm_name(name)} does not hold these weights (differences: {different[:4]})")
    pretrained_cfg = {
        key: value
        for key, value in theirs.pretrained_cfg.items()
        if key in ("classifier", "first_conv", "fixed_input_size")
    }
    side = kwargs.get("img_size", model.args.img_size)
    pretrained_cfg.update(
        input_size=[model.args.in_chans, side, side],
        interpolation="bilinear",
        crop_pct=crop_pct,
        crop_mode="center",
        mean=list(mean),
        std=list(std),
        num_classes=model.args.num_classes,
        custom_load=False,
    )
    config = {"architecture": timm_name(name), "num_classes": model.args.num_classes}
    config["num_features"] = theirs.num_features
    pool = getattr(theirs, "global_pool", None)  # a ResNet's is a pooling module, not a name
    if isinstance(pool, str) and pool:
        config["global_pool"] = pool
    if label_names is not None:
        config["label_names"] = list(label_names)
    return {**config, "model_args": kwargs, "pretrained_cfg": pretrained_cfg}
