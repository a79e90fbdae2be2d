"""Model registry: variants by name, each a builder plus a typed, frozen args object."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vitrain.config import ModelFacts
from vitrain.models.layers import conv_stem_depth, resample_pos_embed
from vitrain.models.localvit import LOCALVIT_SIZES
from vitrain.models.resnet import ResNet, ResNetArgs, build_resnet
from vitrain.models.vit import VisionTransformer, ViTArgs, build_localvit
from vitrain.models.volo import VOLO, VOLO_TINY_PATCH4, VOLO_VARIANTS, VOLOArgs


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    builder: Callable[..., nn.Module]
    args: Any
    description: str


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(name: str, builder: Callable[..., nn.Module], args: Any, description: str) -> None:
    if name in _REGISTRY:
        raise ValueError(f"model {name!r} is already registered")
    _REGISTRY[name] = ModelSpec(name, builder, args, description)


def model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        import difflib

        close = difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "see `vitrain list-models`"
        raise KeyError(f"unknown model {name!r}; {hint}")
    return _REGISTRY[name]


def _stem_problem(stride: int) -> str | None:
    try:
        conv_stem_depth(stride)
    except ValueError as error:
        return str(error)
    return None


def model_facts(name: str) -> ModelFacts:
    """What ``resolve()`` needs of variant ``name`` (its default arguments, whether tensor parallelism splits
    its blocks, what its convolutional stem allows); KeyError naming the known models when there is none."""
    spec = model_spec(name)
    splits = spec.builder is VisionTransformer and getattr(spec.args, "ffn", None) == "mlp"
    return ModelFacts(args=spec.args, splits_heads=splits, stem_problem=_stem_problem)


def list_models() -> list[ModelSpec]:
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def build_model(
    name: str, device: torch.device | str | None = None, dtype: torch.dtype | None = None, **overrides: Any
) -> nn.Module:
    """Build variant ``name`` with some of its args replaced; ``None`` overrides are ignored."""
    spec = model_spec(name)
    changes = {key: value for key, value in overrides.items() if value is not None}
    unknown = set(changes) - {field.name for field in dataclasses.fields(spec.args)}
    if unknown:
        raise TypeError(f"{name} has no argument(s) {sorted(unknown)}")
    return spec.builder(dataclasses.replace(spec.args, **changes), device=device, dtype=dtype)


def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """``model.load_state_dict`` that first resamples a position embedding saved at another input
    resolution to the model's grid (ViT's ``(1, prefix + H*W, D)`` and VOLO's ``(1, H, W, D)``)."""
    saved, own = state_dict.get("pos_embed"), getattr(model, "pos_embed", None)
    if saved is not None and own is not None and saved.shape != own.shape:
        if own.ndim == 4:  # a (1, H, W, D) grid: flatten it for the shared resampler
            flat = resample_pos_embed(saved.flatten(1, 2), tuple(own.shape[1:3]), num_prefix_tokens=0)
            resampled = flat.reshape(own.shape)
        else:
            resampled = resample_pos_embed(saved, model.grid, model.pos_embed_prefix_tokens)
        state_dict = {**state_dict, "pos_embed": resampled}
    model.load_state_dict(state_dict, strict=strict)


# Parameter names of the classifiers of every family (ViT/DeiT/LocalViT/VOLO head, DeiT's distillation
# head, VOLO's token-labeling head, ResNet's fc): a fine-tune to another class count keeps their fresh
# initialization.
CLASSIFIER_PREFIXES = ("head.", "head_dist.", "aux_head.", "fc.")


def load_pretrained(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Fine-tuning load: :func:`load_weights` (position embeddings resampled to the model's grid)
    that keeps the model's own classifier where the class count differs. Returns the names left at
    their initialization; raises ValueError when anything else does not fit."""
    own = model.state_dict()
    fresh = [
        key
        for key, value in state_dict.items()
        if key.startswith(CLASSIFIER_PREFIXES) and key in own and own[key].shape != value.shape
    ]
    mismatched = [
        f"{key} {tuple(value.shape)} vs {tuple(own[key].shape)}"
        for key, value in state_dict.items()
        if key in own and key not in fresh and key != "pos_embed" and own[key].shape != value.shape
    ]
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    problems = [
        f"{label}: {', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        for label, names in (("shapes differ", mismatched), ("missing", missing), ("unexpected", unexpected))
        if names
    ]
    if problems:
        raise ValueError("the checkpoint's model does not fit this one: " + "; ".join(problems))
    load_weights(model, {key: value for key, value in state_dict.items() if key not in fresh}, strict=False)
    return fresh


def num_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


# ViT sizes. Ti/S from DeiT (Touvron et al. 2021, Table 1); B and up exactly as NeMo's ViT documentation's
# table (hidden size, FFN size, heads, layers, patch); its "Model size" column is checked in tests.
_VIT_SIZES = {
    "tiny": ({"embed_dim": 192, "depth": 12, "num_heads": 3}, "Ti", (16,)),
    "small": ({"embed_dim": 384, "depth": 12, "num_heads": 6}, "S", (16,)),
    "base": ({"embed_dim": 768, "depth": 12, "num_heads": 12}, "B", (16,)),
    "large": ({"embed_dim": 1024, "depth": 24, "num_heads": 16}, "L", (16,)),
    "huge": ({"embed_dim": 1280, "depth": 32, "num_heads": 16}, "H", (16, 14)),
    "giant": ({"embed_dim": 1408, "depth": 40, "num_heads": 16, "mlp_dim": 6144}, "g", (14,)),
    "gigantic": ({"embed_dim": 1664, "depth": 48, "num_heads": 16, "mlp_dim": 8192}, "G", (14,)),
}
# DeiT (Touvron et al. 2021): the ViT architecture with its training defaults; stochastic depth 0.1.
_DEIT_SIZES = ("tiny", "small", "base")
# DeiT III (Touvron et al. 2022): LayerScale from 1e-4 (facebookresearch/deit models_v2.py init_scale; timm's
# deit3_* use 1e-6), no position embedding for the CLS token, and the stochastic depth of the ImageNet-1k
# commands in its README_revenge.md (S 0.05, B 0.2, L 0.45), the same in every block (models_v2.py).
_DEIT3_DROP_PATH = {"small": 0.05, "base": 0.2, "large": 0.45}
# CLIP's image towers as timm builds them (vit_*_clip_224): pre-norm, LayerNorm eps 1e-5; quickgelu for
# OpenAI's weights. (size, patch) pairs of timm's vit_{size}_patch{patch}_clip[_quickgelu]_224.
_CLIP_TOWERS = (("base", 16), ("base", 32), ("large", 14), ("huge", 14))


def _register_vit_family() -> None:
    for size, (dims, short, patches) in _VIT_SIZES.items():
        for patch in patches:
            register_model(
                f"vit_{size}_patch{patch}",
                VisionTransformer,
                ViTArgs(**dims, patch_size=patch),
                f"ViT-{short}/{patch} (Dosovitskiy et al. 2021)",
            )
        if size in ("tiny", "small", "base"):
            register_model(
                f"locality_vit_{size}_patch16",
                VisionTransformer,
                ViTArgs(**dims, patch_size=16, ffn="locality"),
                f"locality ViT-{short}/16: 3x3 depthwise conv + h-swish in the FFN (Irandoust et al. 2022)",
            )
    for size in _DEIT_SIZES:
        register_model(
            f"deit_{size}_patch16",
            VisionTransformer,
            ViTArgs(**_VIT_SIZES[size][0], patch_size=16, drop_path_rate=0.1),
            f"DeiT-{_VIT_SIZES[size][1]}/16: ViT with DeiT's stochastic depth 0.1 (Touvron et al. 2021)",
        )
        register_model(
            f"deit_{size}_distilled_patch16",
            VisionTransformer,
            ViTArgs(**_VIT_SIZES[size][0], patch_size=16, drop_path_rate=0.1, distill_token=True),
            f"DeiT-{_VIT_SIZES[size][1]}/16 with the distillation token and head (Touvron et al. 2021, sec. 4)",
        )
    _register_deit3_and_clip()
    # Small images (Fashion-MNIST): 6 blocks of ViT-Ti width; patch 7 -> a 4x4 grid at 28 px,
    # the best accuracy per CPU-second we measured at equal time (docs/benchmarks.md).
    small_image = {"embed_dim": 192, "depth": 6, "num_heads": 3, "patch_size": 7, "img_size": 28}
    register_model(
        "vit_tiny6_patch7", VisionTransformer, ViTArgs(**small_image), "6-block ViT-Ti, patch 7, for 28 px images"
    )
    register_model(
        "locality_vit_tiny6_patch7",
        VisionTransformer,
        ViTArgs(**small_image, ffn="locality"),
        "6-block locality ViT-Ti, patch 7, for 28 px images",
    )
    register_model(
        "vit_tiny6_convstem_patch8",
        VisionTransformer,
        ViTArgs(**{**small_image, "patch_size": 8, "img_size": 32}, stem="conv"),
        "6-block ViT-Ti with Xiao et al.'s convolutional stem (3 stride-2 convs), for 32 px images",
    )


def _register_deit3_and_clip() -> None:
    for size, drop_path in _DEIT3_DROP_PATH.items():
        dims, short, _ = _VIT_SIZES[size]
        register_model(
            f"deit3_{size}_patch16",
            VisionTransformer,
            ViTArgs(
                **dims,
                patch_size=16,
                layer_scale=1e-4,
                pos_embed_class=False,
                drop_path_rate=drop_path,
                drop_path_schedule="uniform",
            ),
            f"DeiT III ViT-{short}/16: LayerScale, no CLS position embedding (Touvron et al. 2022)",
        )
    for size, patch in _CLIP_TOWERS:
        dims, short, _ = _VIT_SIZES[size]
        clip = ViTArgs(**dims, patch_size=patch, pre_norm=True, norm_eps=1e-5)
        register_model(
            f"vit_{size}_patch{patch}_clip",
            VisionTransformer,
            clip,
            f"CLIP's ViT-{short}/{patch} image tower: pre-norm, LayerNorm eps 1e-5 (Radford et al. 2021)",
        )
        register_model(
            f"vit_{size}_patch{patch}_clip_quickgelu",
            VisionTransformer,
            dataclasses.replace(clip, act="quick_gelu"),
            f"CLIP's ViT-{short}/{patch} image tower with OpenAI's QuickGELU (Radford et al. 2021)",
        )


def _register_localvit_family() -> None:
    for size, fields in LOCALVIT_SIZES.items():
        register_model(
            f"localvit_{size}_patch16",
            build_localvit,
            ViTArgs(**fields),
            f"LocalViT-{size[0].upper()}: BN + SE depthwise-conv FFN (Li et al. 2021), the baseline of Irandoust et al. 2022",
        )
    register_model(
        "localvit_tiny6_patch7",
        build_localvit,
        ViTArgs(embed_dim=192, depth=6, num_heads=3, patch_size=7, img_size=28, ffn="localvit"),
        "6-block LocalViT, patch 7, for the Borealis comparison on Fashion-MNIST (28 px)",
    )
    register_model(
        "localvit_tiny6_convstem_patch8",
        build_localvit,
        ViTArgs(embed_dim=192, depth=6, num_heads=3, patch_size=8, img_size=32, ffn="localvit", stem="conv"),
        "6-block LocalViT with Xiao et al.'s convolutional stem, for 32 px images (default recipe)",
    )


def _register_resnet_family() -> None:
    register_model(
        "resnet50",
        build_resnet,
        ResNetArgs(depth=50),
        "ResNet-50 (He et al. 2016; IBM's ImageNet mixed-precision benchmark), torchvision's",
    )


def _register_volo_family() -> None:
    for name, args in VOLO_VARIANTS.items():
        register_model(name, VOLO, args, f"VOLO-{name[-2:].upper()} (Yuan et al. 2021)")
    register_model(
        "volo_tiny_patch4",
        VOLO,
        VOLO_TINY_PATCH4,
        "a small VOLO for 32 px images: 2 outlooker, 5 transformer and 2 class-attention blocks, widths "
        "96/192, stem stride 4",
    )


_register_vit_family()
_register_volo_family()
_register_localvit_family()
_register_resnet_family()

__all__ = [
    "ModelSpec",
    "ResNet",
    "ResNetArgs",
    "VOLO",
    "VOLOArgs",
    "VisionTransformer",
    "ViTArgs",
    "build_model",
    "list_models",
    "load_pretrained",
    "load_weights",
    "model_facts",
    "model_spec",
    "num_parameters",
    "register_model",
    "resample_pos_embed",
]
