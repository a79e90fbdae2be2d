"""Vision Transformer (Dosovitskiy et al., ICLR 2021) and the locality ViT (Irandoust et al.,
"Training a ViT from scratch in less than 24 hours with 1 GPU", NeurIPS 2022 workshop).

Choices that differ from the papers:
- ``head="gap"`` drops the CLS token and classifies LayerNorm(mean of patch tokens), the pooled
  classifier of pycls (Meta AI, "Significantly faster Vision Transformer training", 2022) and timm's ``global_pool="avg"``; the final norm then moves
  after the pooling (``fc_norm``), as in timm, so state dicts stay interchangeable.
- The locality FFN lets the CLS token skip the depthwise convolution (it has no grid position).
- Initialization follows timm: truncated normal (std 0.02) for linear layers and position
  embeddings, tiny normal for the CLS token.
- ``distill_token=True`` is DeiT's distilled model (Touvron et al. 2021, sec. 4; timm's
  ``VisionTransformerDistilled``): a distillation token after the CLS token with its own position
  embedding and classifier ``head_dist``. ``forward`` returns the mean of the two heads' logits (what
  DeiT evaluates); :meth:`VisionTransformer.forward_distill` returns both, which the distillation loss
  needs (``vitrain.train.losses.DistillationLoss``).
- ``aux_head=True`` adds token labeling's auxiliary head (Jiang et al. 2021, LV-ViT): a linear classifier
  on every patch token after the final norm (``fc_norm`` for ``head="gap"``, applied per token).
  ``forward`` returns the class logits plus 0.5 x the max over tokens of the auxiliary logits (VOLO's
  and LV-ViT's inference rule); :meth:`VisionTransformer.forward_head_with_tokens` returns both parts for
  the token-labeling loss. timm's ``VisionTransformer`` has no such head: such a model does not convert
  to timm.
- DeiT III (Touvron et al. 2022, "DeiT III: Revenge of the ViT"): ``layer_scale`` (LayerScale, each residual
  branch times a learned per-channel ``gamma``) and ``pos_embed_class=False`` (position embeddings for the
  patches only; the CLS token is joined after adding them), timm's ``init_values`` and ``no_embed_class``.
  The variants start LayerScale at 1e-4 and drop every block's path at the same rate
  (``drop_path_schedule="uniform"``), as DeiT III's code does (timm builds them at 1e-6, rates rising with depth).
- CLIP's image tower (Radford et al. 2021, timm's ``vit_*_clip_*``): ``pre_norm`` adds a LayerNorm
  ``norm_pre`` after the position embedding and drops the patch embedding's bias; its LayerNorms use
  ``norm_eps=1e-5`` and OpenAI's weights ``act="quick_gelu"``. CLIP's projection into the text embedding
  is not part of the model: ``head`` is a classifier.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import torch
from torch import nn

from vitrain.models.layers import (
    AttentionImpl,
    Block,
    Blocks,
    ConvStem,
    LayerScale,
    LocalityMlp,
    Mlp,
    PatchEmbed,
    QuickGELU,
    resample_pos_embed,
)
from vitrain.models.localvit import LocalViTMlp


@dataclasses.dataclass(frozen=True)
class ViTArgs:
    """Architecture of a ViT-family model."""

    embed_dim: int = 192
    depth: int = 12
    num_heads: int = 3
    mlp_ratio: float = 4.0
    mlp_dim: int | None = None
    """FFN hidden size; ``embed_dim * mlp_ratio`` when unset (g/14 and G/14 have non-integer ratios)."""
    patch_size: int = 16
    img_size: int = 224
    in_chans: int = 3
    num_classes: int = 1000
    head: Literal["cls", "gap"] = "cls"
    ffn: Literal["mlp", "locality", "localvit"] = "mlp"
    stem: Literal["patch", "conv"] = "patch"
    """patch: one strided convolution (ViT); conv: Xiao et al.'s stack of 3x3 stride-2 convolutions."""
    attn_impl: AttentionImpl = "sdpa"
    attn_softmax_fp32: bool = False
    """Matmul attention: scores and softmax in fp32 under fp16/bf16 (DeiT's NaN fix)."""
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    drop_path_schedule: Literal["linear", "uniform"] = "linear"
    """Stochastic depth per block: rising linearly from 0 to ``drop_path_rate`` (timm), or the same in all (DeiT III)."""
    distill_token: bool = False
    """DeiT's distillation token and second classifier ``head_dist`` (needs ``head="cls"``)."""
    aux_head: bool = False
    """Token labeling's auxiliary classifier ``aux_head`` on every patch token (not with ``distill_token``)."""
    layer_scale: float | None = None
    """LayerScale's starting value: each residual branch times a learned per-channel ``gamma`` (DeiT III)."""
    pos_embed_class: bool = True
    """Position embeddings for the CLS/distillation tokens too (ViT, DeiT); False: patches only (DeiT III)."""
    pre_norm: bool = False
    """CLIP's LayerNorm ``norm_pre`` after the position embedding, and a patch embedding without bias."""
    norm_eps: float = 1e-6
    """Epsilon of every LayerNorm (CLIP's: 1e-5)."""
    act: Literal["gelu", "quick_gelu"] = "gelu"
    """The FFN's activation (``mlp`` FFN only): exact GELU, or OpenAI CLIP's ``x * sigmoid(1.702 x)``."""


def _check_args(args: ViTArgs) -> None:
    """ValueError naming the conflict when ``args`` do not make a model."""
    if args.img_size % args.patch_size:
        raise ValueError(f"img_size {args.img_size} is not divisible by patch_size {args.patch_size}")
    if args.distill_token and args.head != "cls":
        raise ValueError("distill_token=True needs head='cls': the heads read the CLS and distillation tokens")
    if args.distill_token and args.aux_head:
        raise ValueError("aux_head=True does not combine with distill_token=True: use one of the two heads")
    if args.act != "gelu" and args.ffn != "mlp":
        raise ValueError(f"act={args.act!r} needs ffn='mlp' (the {args.ffn} FFN has its own activation)")
    if args.layer_scale is not None and args.layer_scale <= 0:
        raise ValueError(f"layer_scale must be a positive starting value or None, got {args.layer_scale}")


class VisionTransformer(nn.Module):
    def __init__(self, args: ViTArgs, device=None, dtype=None):
        super().__init__()
        _check_args(args)
        factory = {"device": device, "dtype": dtype}
        self.args = args
        self.num_prefix_tokens = (2 if args.distill_token else 1) if args.head == "cls" else 0
        grid_side = args.img_size // args.patch_size
        self.grid = (grid_side, grid_side)
        dim = args.embed_dim
        if args.stem == "patch":
            self.patch_embed = PatchEmbed(args.patch_size, args.in_chans, dim, bias=not args.pre_norm, **factory)
        else:
            self.patch_embed = ConvStem(args.patch_size, args.in_chans, dim, **factory)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim, **factory)) if args.head == "cls" else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, dim, **factory)) if args.distill_token else None
        self.pos_embed_prefix_tokens = self.num_prefix_tokens if args.pos_embed_class else 0
        """Prefix tokens with a position embedding (0 for DeiT III's layout)."""
        self.pos_embed = nn.Parameter(torch.zeros(1, self.pos_embed_prefix_tokens + grid_side**2, dim, **factory))
        self.pos_drop = nn.Dropout(args.drop_rate)
        self.norm_pre = nn.LayerNorm(dim, eps=args.norm_eps, **factory) if args.pre_norm else nn.Identity()
        mlp_type = {"mlp": Mlp, "locality": LocalityMlp, "localvit": LocalViTMlp}[args.ffn]
        if args.act == "quick_gelu":
            mlp_type = functools.partial(Mlp, act_layer=QuickGELU)
        drop_path_rates = torch.linspace(0, args.drop_path_rate, args.depth).tolist()
        if args.drop_path_schedule == "uniform":
            drop_path_rates = [args.drop_path_rate] * args.depth
        self.blocks = Blocks(
            Block(
                dim,
                args.num_heads,
                args.mlp_dim or int(dim * args.mlp_ratio),
                mlp_type=mlp_type,
                num_prefix_tokens=self.num_prefix_tokens,
                drop=args.drop_rate,
                attn_drop=args.attn_drop_rate,
                drop_path=rate,
                attn_impl=args.attn_impl,
                attn_softmax_fp32=args.attn_softmax_fp32,
                layer_scale=args.layer_scale,
                norm_eps=args.norm_eps,
                **factory,
            )
            for rate in drop_path_rates
        )
        final_norm = nn.LayerNorm(dim, eps=args.norm_eps, **factory)
        self.norm = final_norm if args.head == "cls" else nn.Identity()
        self.fc_norm = final_norm if args.head == "gap" else nn.Identity()
        self.head_drop = nn.Dropout(args.drop_rate)
        self.head = nn.Linear(dim, args.num_classes, **factory)
        self.head_dist = nn.Linear(dim, args.num_classes, **factory) if args.distill_token else None
        self.aux_head = nn.Linear(dim, args.num_classes, **factory) if args.aux_head else None
        self.distilled_training = False
        """With a distillation token, ``forward`` in training mode returns both heads' logits (timm's
        ``set_distilled_training``); the training step sets it for its forward only."""
        self.aux_output = False
        """With an auxiliary head, ``forward`` returns ``(cls_logits, aux_logits)`` apart (``set_aux_output``):
        the token-labeling step and evaluation set it for their forwards only."""
        if device is None or torch.device(device).type != "meta":
            self.init_weights()

    # --- the model protocol (docs/models.md) ------------------------------------------------

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        if self.dist_token is not None:
            nn.init.trunc_normal_(self.dist_token, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.Conv2d, nn.BatchNorm2d, LayerScale)):
                module.reset_parameters()

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token", "dist_token"}

    def block_modules(self) -> list[nn.Module]:
        """The repeated blocks: units of FSDP sharding and activation checkpointing."""
        return list(self.blocks)

    @property
    def num_layers(self) -> int:
        """Layers between the embeddings and the head, as :meth:`layer_id` counts them: the blocks."""
        return self.args.depth

    def layer_id(self, param_name: str) -> int:
        """Depth of a parameter for layer-wise LR decay (BEiT's numbering): 0 embeddings, i+1 block i,
        ``num_layers + 1`` the final norm and the heads (the auxiliary head included)."""
        if param_name.startswith(("patch_embed", "cls_token", "dist_token", "pos_embed", "norm_pre")):
            return 0
        if param_name.startswith("blocks."):
            return int(param_name.split(".")[1]) + 1
        return self.num_layers + 1

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        x, grid = self.patch_embed(images)
        pos_embed = self.pos_embed
        if grid != self.grid:
            pos_embed = resample_pos_embed(pos_embed, grid, self.pos_embed_prefix_tokens)
        prefix = [token.expand(x.shape[0], -1, -1) for token in (self.cls_token, self.dist_token) if token is not None]
        if not self.args.pos_embed_class:  # DeiT III: the patches' positions first, then the prefix tokens
            x = x + pos_embed
        if prefix:
            x = torch.cat([*prefix, x], dim=1)
        if self.args.pos_embed_class:
            x = x + pos_embed
        x = self.norm_pre(self.pos_drop(x))
        return self.norm(self.blocks(x, grid))

    def forward_head(
        self, tokens: torch.Tensor, pre_logits: bool = False, both: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (or ``pre_logits``: the pooled features). With a distillation token: the mean of
        both heads, or with ``both`` (or ``distilled_training`` in training mode) the pair
        ``(cls_logits, dist_logits)``. With an auxiliary head: the class logits plus 0.5 x the max over
        patch tokens of the auxiliary logits, or with ``aux_output`` the pair ``(cls_logits, aux_logits)``."""
        if self.head_dist is None:
            if self.aux_head is not None and not pre_logits:
                cls_logits, aux_logits = self.forward_head_with_tokens(tokens)
                return (cls_logits, aux_logits) if self.aux_output else cls_logits + 0.5 * aux_logits.amax(dim=1)
            pooled = tokens[:, 0] if self.args.head == "cls" else tokens.mean(dim=1)
            pooled = self.head_drop(self.fc_norm(pooled))
            return pooled if pre_logits else self.head(pooled)
        cls_pooled, dist_pooled = self.head_drop(tokens[:, 0]), self.head_drop(tokens[:, 1])
        if pre_logits:
            return (cls_pooled + dist_pooled) / 2
        cls_logits, dist_logits = self.head(cls_pooled), self.head_dist(dist_pooled)
        if both or (self.distilled_training and self.training):
            return cls_logits, dist_logits
        return (cls_logits + dist_logits) / 2

    def forward_head_with_tokens(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(class logits (B, classes), per-patch auxiliary logits (B, patches, classes)) for token
        labeling; ``tokens`` are :meth:`forward_features`' output."""
        if self.aux_head is None:
            raise ValueError("this model has no auxiliary head; build it with aux_head=True (model.aux_head=true)")
        patches = tokens[:, self.num_prefix_tokens :]
        pooled = tokens[:, 0] if self.args.head == "cls" else patches.mean(dim=1)
        cls_logits = self.head(self.head_drop(self.fc_norm(pooled)))
        # a gap head's final norm (fc_norm) comes after the pooling: each patch token gets it here
        return cls_logits, self.aux_head(self.head_drop(self.fc_norm(patches)))

    def forward_distill(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cls_logits, dist_logits)``: the class head and the distillation head (needs ``distill_token``)."""
        if self.head_dist is None:
            raise ValueError("forward_distill needs a model built with distill_token=True")
        return self.forward_head(self.forward_features(images), both=True)

    def set_distilled_training(self, enable: bool = True) -> None:
        self.distilled_training = enable

    def set_aux_output(self, enable: bool = True) -> None:
        self.aux_output = enable

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(images))


def build_localvit(args: ViTArgs, device=None, dtype=None) -> VisionTransformer:
    """A ``VisionTransformer`` with LocalViT's FFN (``vitrain.models.localvit``); ``args.ffn`` must be
    ``"localvit"``."""
    if args.ffn != "localvit":
        raise ValueError(f"build_localvit needs ViTArgs.ffn='localvit', got {args.ffn!r}")
    return VisionTransformer(args, device=device, dtype=dtype)
