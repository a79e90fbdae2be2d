"""Analytic forward FLOPs per image, one function per family (a multiply-add counts as 2 FLOPs).

They count what ``torch.utils.flop_counter.FlopCounterMode`` counts (matmuls, convolutions,
attention), not elementwise ops or norms (so nothing for DeiT III's LayerScale, CLIP's ``norm_pre`` or
QuickGELU); tests compare the two within 5 %. MFU uses
``3 × forward`` for a training step (backward costs twice the forward).
"""

from __future__ import annotations

from torch import nn

from vitrain.models.layers import conv_stem_flops
from vitrain.models.localvit import localvit_mlp_flops
from vitrain.models.resnet import ResNet, resnet_flops
from vitrain.models.vit import VisionTransformer, ViTArgs
from vitrain.models.volo import VOLO, volo_flops


def vit_flops(args: ViTArgs, img_size: int) -> int:
    grid = img_size // args.patch_size
    patches = grid * grid
    tokens = patches + ((2 if args.distill_token else 1) if args.head == "cls" else 0)
    dim, hidden = args.embed_dim, args.mlp_dim or int(args.embed_dim * args.mlp_ratio)
    patch_embed = 2 * patches * args.in_chans * args.patch_size**2 * dim
    if args.stem == "conv":
        patch_embed = conv_stem_flops(args.patch_size, args.in_chans, dim, img_size)
    attention = 2 * tokens * dim * 3 * dim + 2 * 2 * tokens * tokens * dim + 2 * tokens * dim * dim
    ffn = 2 * 2 * tokens * dim * hidden
    if args.ffn == "locality":
        ffn += 2 * patches * hidden * 3 * 3  # depthwise 3x3 conv over the patch grid
    elif args.ffn == "localvit":
        ffn = localvit_mlp_flops(dim, hidden, tokens, (grid, grid))
    heads = 2 if args.distill_token else 1
    classifier = heads * 2 * dim * args.num_classes
    if args.aux_head:
        classifier += patches * 2 * dim * args.num_classes  # token labeling's head on every patch token
    return patch_embed + args.depth * (attention + ffn) + classifier


def model_flops(model: nn.Module, img_size: int) -> int:
    """Forward FLOPs per image of a built model at ``img_size`` (square) input."""
    if isinstance(model, VisionTransformer):
        return vit_flops(model.args, img_size)
    if isinstance(model, ResNet):
        return resnet_flops(model.args, img_size)
    if isinstance(model, VOLO):
        return volo_flops(model.args, img_size)
    raise TypeError(f"no analytic FLOPs for {type(model).__name__}; add a function to vitrain.models.flops")
