"""Weights to and from timm: a model trained here loads into ``timm.create_model`` and back.

Our ViT, DeiT, DeiT III, CLIP-style ViT, VOLO and ResNet-50 use timm's parameter names, so conversion is a
name map of variants plus a check; families timm lacks (locality ViT, LocalViT) are refused by name. A timm
model at another resolution or patch size (``vit_small_patch16_384``, ``vit_base_patch32_224``) converts to
our variant of the same family and size, with the patch size and resolution its weights have.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vitrain.models import VisionTransformer, ViTArgs, VOLOArgs, build_model, load_weights, model_spec

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
    **{f"deit3_{size}_patch16": f"deit3_{size}_patch16_224" for size in ("small", "base", "large")},
    **{
        f"vit_{size}_patch{patch}_clip{act}": f"vit_{size}_patch{patch}_clip{act}_224"
        for size, patch in (("base", 16), ("base", 32), ("large", 14), ("huge", 14))
        for act in ("", "_quickgelu")
    },
    **{f"volo_d{depth}": f"volo_d{depth}_224" for depth in range(1, 6)},
    "resnet50": "resnet50",
}
_OUR_NAMES = {timm_name: ours for ours, timm_name in TIMM_NAMES.items()}


def timm_name(name: str) -> str:
    """The timm architecture equal to our variant ``name``."""
    model_spec(name)  # unknown names fail with the registry's hint
    if name not in TIMM_NAMES:
        raise ValueError(f"{name} has no timm equivalent; timm conversion covers {', '.join(sorted(TIMM_NAMES))}")
    return TIMM_NAMES[name]


_RESOLUTION_SUFFIX = re.compile(r"_\d+$")
_PATCH_SIZE = re.compile(r"_patch\d+")


def _timm_family(architecture: str) -> str:
    """A timm architecture without its resolution suffix and patch size (``vit_small_patch16_384`` ->
    ``vit_small_patch``): what its variants at other resolutions and patch sizes share."""
    return _PATCH_SIZE.sub("_patch", _RESOLUTION_SUFFIX.sub("", architecture))


def variant_for_timm(architecture: str | None, patch_size: int | None = None) -> str:
    """Our variant of timm architecture ``architecture`` (no ``.tag``) at any resolution or patch size: the
    one of the same family and size (width, depth, heads), with patch ``patch_size`` where there is one;
    ValueError naming the converted families when there is none."""
    if architecture in _OUR_NAMES:
        return _OUR_NAMES[architecture]
    family = [ours for ours, theirs in TIMM_NAMES.items() if _timm_family(theirs) == _timm_family(str(architecture))]
    if not family:
        known = sorted({_timm_family(theirs) + ("*" if "_patch" in theirs else "") for theirs in TIMM_NAMES.values()})
        raise ValueError(
            f"timm architecture {architecture!r} has no vitrain variant (converted families: {', '.join(known)}, "
            "at any resolution)"
        )
    same_patch = [ours for ours in family if getattr(model_spec(ours).args, "patch_size", None) == patch_size]
    return (same_patch or family)[0]


def _effective_args(name: str, overrides: Mapping[str, Any] | None) -> Any:
    """The variant's args with the ``overrides`` it has (``None`` values ignored)."""
    args = model_spec(name).args
    fields = {field.name for field in dataclasses.fields(args)}
    changes = {key: value for key, value in (overrides or {}).items() if key in fields and value is not None}
    return dataclasses.replace(args, **changes)


def _vit_geometry(state_dict: Mapping[str, torch.Tensor], args: ViTArgs) -> dict[str, Any]:
    """Head, distillation token, patch size and image size of a ViT's weights; ValueError naming the
    difference when the position embedding does not fit the variant's layout."""
    prefix = ("cls_token" in state_dict) + ("dist_token" in state_dict)
    found: dict[str, Any] = {"head": "cls" if prefix else "gap", "distill_token": "dist_token" in state_dict}
    patch_size = args.patch_size
    stem_convs = [key for key, value in state_dict.items() if key.startswith("patch_embed.convs.") and value.ndim == 4]
    projection = state_dict.get("patch_embed.proj.weight")
    if stem_convs:  # the convolutional stem: one stride-2 convolution per halving, then a 1x1 projection
        patch_size = found["patch_size"] = 2 ** len(stem_convs)
    elif projection is not None and projection.ndim == 4:  # the patchify convolution: kernel = stride = patch
        patch_size = found["patch_size"] = projection.shape[-1]
    entries = state_dict["pos_embed"].shape[1]
    patches = entries - (prefix if args.pos_embed_class else 0)
    side = math.isqrt(max(patches, 0))
    if side * side != patches:
        layout = "with" if args.pos_embed_class else "without"
        other = "pos_embed_class=False (DeiT III, deit3_*)" if args.pos_embed_class else "pos_embed_class=True"
        raise ValueError(
            f"the weights' position embedding has {entries} entries, not a square grid {layout} the {prefix} "
            f"prefix token(s)' positions this variant expects; use a variant with {other}"
        )
    found["img_size"] = side * patch_size
    return found


def inferred_model_args(
    state_dict: Mapping[str, torch.Tensor], name: str, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Args a state dict fixes that can differ from the variant's defaults (classes, channels, head, patch
    size, image size), read with the variant's args changed by ``overrides``."""
    args = _effective_args(name, overrides)
    overrides = {}
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
    if isinstance(args, ViTArgs) and "pos_embed" in state_dict and state_dict["pos_embed"].ndim == 3:
        overrides.update(_vit_geometry(state_dict, args))
    for field in ("aux_head", "use_aux_head"):  # token labeling's head: ViTs' and VOLO's argument
        if hasattr(args, field):
            overrides[field] = "aux_head.weight" in state_dict
    return overrides


def from_timm(source: nn.Module | Mapping[str, torch.Tensor], name: str | None = None, **overrides: Any) -> nn.Module:
    """Our model holding the weights of a timm model (or its state dict).

    ``name`` is our variant; for a timm model it defaults to the one of its architecture's family and size
    at any resolution and patch size (:func:`our_variant`). Classes, channels, head, patch size and input
    size are read from the weights; ``overrides`` set the rest (``img_size=`` another resolution resamples
    the position embedding bicubically). Weights of another structure are refused before loading, with
    ValueError naming the differing tensors, or for a timm model the differing heads, LayerNorm epsilon,
    activation or position-embedding layout.
    """
    if isinstance(source, nn.Module):
        state_dict = source.state_dict()
        if name is None:
            projection = state_dict.get("patch_embed.proj.weight")
            patch_size = projection.shape[-1] if projection is not None else None
            try:
                name = variant_for_timm(getattr(source, "pretrained_cfg", {}).get("architecture"), patch_size)
            except ValueError as error:
                raise ValueError(f"{error}; pass name= with a variant of the same structure") from None
    else:
        if name is None:
            raise ValueError("from_timm(state_dict) needs name= (our variant, see `vitrain list-models`)")
        state_dict = source
    timm_name(name)
    model = build_model(name, **{**inferred_model_args(state_dict, name, overrides), **overrides})
    differences = _weight_differences(model, state_dict)
    if isinstance(source, nn.Module) and isinstance(model, VisionTransformer):
        differences += _timm_vit_differences(source, model.args)
    if differences:
        raise ValueError(
            f"the timm weights do not fit {name} ({'; '.join(differences[:4])}); pass name= with a variant of "
            "that structure, or the differing arguments as overrides (e.g. depth=, num_heads=)"
        )
    load_weights(model, state_dict)  # an img_size override resamples the position embedding
    return model


def _weight_differences(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """Tensors that ``model`` lacks, has apart, or holds in another shape than ``state_dict`` (the position
    embedding excepted: :func:`load_weights` resamples it to another resolution)."""
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    shapes = [
        f"{key} {tuple(value.shape)} in the weights, {tuple(own[key].shape)} here"
        for key, value in state_dict.items()
        if key in own and key != "pos_embed" and tuple(own[key].shape) != tuple(value.shape)
    ]
    found = [f"missing in the weights: {', '.join(missing[:3])}"] if missing else []
    found += [f"not in the variant: {', '.join(unexpected[:3])}"] if unexpected else []
    return found + shapes[:2]


def _timm_vit_differences(source: nn.Module, args: ViTArgs) -> list[str]:
    """Architecture choices of a timm ViT that its weights do not show, where they differ from ``args``:
    attention heads, LayerNorm epsilon, FFN activation, position embedding layout."""
    block = getattr(source, "blocks", [None])[0]
    activation = type(getattr(getattr(block, "mlp", None), "act", None)).__name__
    theirs = {
        "num_heads": getattr(getattr(block, "attn", None), "num_heads", args.num_heads),
        "norm_eps": getattr(getattr(block, "norm1", None), "eps", args.norm_eps),
        "act": {"GELU": "gelu", "QuickGELU": "quick_gelu", "NoneType": args.act}.get(activation, activation),
    }
    if args.head == "cls":  # without prefix tokens both layouts are the same
        theirs["pos_embed_class"] = not getattr(source, "no_embed_class", not args.pos_embed_class)
    return [
        f"timm's {field}={value!r}, the variant's {getattr(args, field)!r}"
        for field, value in theirs.items()
        if value != getattr(args, field)
    ]


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
    if isinstance(args, ViTArgs):
        kwargs.update(_timm_vit_options(name, args, variant))
    return kwargs


def _timm_vit_options(name: str, args: ViTArgs, variant: ViTArgs) -> dict[str, Any]:
    """timm's arguments for the DeiT III and CLIP options of ``args`` that differ from the variant's
    (``no_embed_class``, ``init_values``, ``pre_norm``, ``act_layer``); ValueError for a LayerNorm epsilon
    other than the variant's, which timm takes only as a norm layer type."""
    if args.norm_eps != variant.norm_eps:
        raise ValueError(
            f"{name} with norm_eps={args.norm_eps} has no timm equivalent ({timm_name(name)} uses "
            f"{variant.norm_eps}); use a variant with that epsilon (CLIP's *_clip variants use 1e-5)"
        )
    kwargs: dict[str, Any] = {}
    if args.pos_embed_class != variant.pos_embed_class:
        kwargs["no_embed_class"] = not args.pos_embed_class
    if (args.layer_scale is None) != (variant.layer_scale is None):  # the start value itself is not in the weights
        kwargs["init_values"] = args.layer_scale
    if args.pre_norm != variant.pre_norm:
        kwargs["pre_norm"] = args.pre_norm
    if args.act != variant.act:
        kwargs["act_layer"] = args.act
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
