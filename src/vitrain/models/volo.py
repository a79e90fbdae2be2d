"""VOLO: Vision Outlooker (Yuan et al., "VOLO: Vision Outlooker for Visual Recognition", 2021).

A convolutional stem, a first stage of outlooker blocks on the fine 1/8 grid (outlook attention,
§3.1: each location predicts the attention weights of its K x K neighbourhood from its own
feature), a downsampling to the 1/16 grid, transformer stages, then class-attention blocks that
read the patch tokens into a CLS token (CaiT), and a token-labeling auxiliary head on every patch.

Choices that differ from the paper (and from timm's ``volo.py``):
- MixToken (Jiang et al. 2021, token labeling) is not in the model: mixing lives in data/loss
  code, so the model stays a plain classifier. The model only exposes per-token logits
  (``forward_head_with_tokens``).
- ``forward`` / ``forward_head`` return what timm's do: class logits plus 0.5 times the max over
  patch tokens of the auxiliary logits (the paper's inference rule); a token-labeling loss takes
  the two parts apart from ``forward_head_with_tokens``.
- Any input divisible by the total stride runs: the 2-D position embedding is resampled
  bicubically to the new grid (timm fixes the input size instead).
- As in the official code and timm, stochastic depth applies to the transformer blocks only; its
  rate grows linearly with the block's index among all blocks, outlookers included.
- Parameter and buffer names are timm's, so state dicts load into ``timm.create_model("volo_*")``
  strictly and back with no renaming.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.models.layers import (
    Attention,
    AttentionImpl,
    DropPath,
    Grid,
    Mlp,
    resample_pos_embed,
    split_prefix,
)


@dataclasses.dataclass(frozen=True)
class VOLOArgs:
    """Architecture of a VOLO model; every per-stage tuple has one entry per stage."""

    layers: tuple[int, ...] = (4, 4, 8, 2)
    """Blocks per stage."""
    embed_dims: tuple[int, ...] = (192, 384, 384, 384)
    num_heads: tuple[int, ...] = (6, 12, 12, 12)
    mlp_ratio: float = 3.0
    """FFN hidden size / width, for every block including the class-attention blocks."""
    downsamples: tuple[bool, ...] = (True, False, False, False)
    """Halve the grid (2x2 stride-2 conv) after this stage."""
    outlook_attention: tuple[bool, ...] = (True, False, False, False)
    """Outlooker (True) or transformer (False) blocks; outlooker stages come first."""
    outlook_kernel_size: int = 3
    outlook_stride: int = 2
    """Attention weights are predicted from features average-pooled by this stride (timm, official code)."""
    stem_hidden_dim: int = 64
    patch_size: int = 8
    """Total stride of the stem: a stride-2 7x7 conv, two 3x3 convs, then a (patch/2)-strided projection."""
    post_layers: tuple[Literal["ca"], ...] = ("ca", "ca")
    """Class-attention blocks after the last stage (CaiT); at least one, they make the CLS token."""
    use_aux_head: bool = True
    """Token-labeling head: logits for every patch token."""
    qkv_bias: bool = False
    attn_impl: AttentionImpl = "sdpa"
    """The transformer stages' attention: SDPA or explicit matmuls (``model.attn_impl``, or ``auto`` by measurement)."""
    attn_softmax_fp32: bool = False
    """Explicit-matmul attention scores and softmax in fp32 (DeiT's fp16 NaN fix)."""
    img_size: int = 224
    in_chans: int = 3
    num_classes: int = 1000
    drop_rate: float = 0.0
    """Dropout before the heads."""
    pos_drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0

    def __post_init__(self) -> None:
        num_stages = len(self.layers)
        for name in ("embed_dims", "num_heads", "downsamples", "outlook_attention"):
            if len(getattr(self, name)) != num_stages:
                raise ValueError(f"VOLOArgs.{name} needs one entry per stage ({num_stages}), got {getattr(self, name)}")
        if any(
            self.outlook_attention[index + 1] and not self.outlook_attention[index] for index in range(num_stages - 1)
        ):
            raise ValueError(
                f"VOLOArgs.outlook_attention: outlooker stages must come first, got {self.outlook_attention}"
            )
        if all(self.outlook_attention):
            raise ValueError("VOLOArgs.outlook_attention: at least one transformer stage is needed (False)")
        if self.downsamples[-1]:
            raise ValueError("VOLOArgs.downsamples: the last stage has no next stage to downsample into")
        for index in range(num_stages - 1):
            if not self.downsamples[index] and self.embed_dims[index] != self.embed_dims[index + 1]:
                raise ValueError(f"VOLOArgs.embed_dims: stages {index} and {index + 1} differ without a downsample")
        for dim, heads in zip(self.embed_dims, self.num_heads, strict=True):
            if dim % heads:
                raise ValueError(f"VOLOArgs: embed dim {dim} is not divisible by {heads} heads")
        if not self.post_layers or any(kind != "ca" for kind in self.post_layers):
            raise ValueError(f"VOLOArgs.post_layers: one or more 'ca' (class attention) blocks, got {self.post_layers}")
        if self.patch_size % 2:
            raise ValueError(
                f"VOLOArgs.patch_size must be even (the stem's first conv has stride 2), got {self.patch_size}"
            )
        if self.img_size % self.total_stride:
            raise ValueError(
                f"VOLOArgs.img_size {self.img_size} is not divisible by the total stride {self.total_stride}"
            )

    @property
    def total_stride(self) -> int:
        return self.patch_size * 2 ** sum(self.downsamples)

    @property
    def pos_embed_stage(self) -> int:
        """The position embedding is added at the input of the first transformer stage."""
        return self.outlook_attention.index(False)

    @property
    def pos_embed_stride(self) -> int:
        return self.patch_size * 2 ** sum(self.downsamples[: self.pos_embed_stage])


# timm's volo_d1_224 ... volo_d5_224 (Yuan et al. 2021, Table 1).
VOLO_VARIANTS: dict[str, VOLOArgs] = {
    "volo_d1": VOLOArgs(layers=(4, 4, 8, 2), embed_dims=(192, 384, 384, 384), num_heads=(6, 12, 12, 12)),
    "volo_d2": VOLOArgs(layers=(6, 4, 10, 4), embed_dims=(256, 512, 512, 512), num_heads=(8, 16, 16, 16)),
    "volo_d3": VOLOArgs(layers=(8, 8, 16, 4), embed_dims=(256, 512, 512, 512), num_heads=(8, 16, 16, 16)),
    "volo_d4": VOLOArgs(layers=(8, 8, 16, 4), embed_dims=(384, 768, 768, 768), num_heads=(12, 16, 16, 16)),
    "volo_d5": VOLOArgs(
        layers=(12, 12, 20, 4),
        embed_dims=(384, 768, 768, 768),
        num_heads=(12, 16, 16, 16),
        mlp_ratio=4.0,
        stem_hidden_dim=128,
    ),
}

VOLO_TINY_PATCH4 = VOLOArgs(
    layers=(2, 2, 2, 1),
    embed_dims=(96, 192, 192, 192),
    num_heads=(3, 6, 6, 6),
    mlp_ratio=2.0,
    stem_hidden_dim=32,
    patch_size=4,
    img_size=32,
)
"""A small VOLO for 32 px images (Fashion-MNIST resized): stem stride 4, so an 8x8 outlooker grid and a 4x4
transformer grid; 2.35M parameters and 85 MFLOPs a 1-channel image, near the default LocalViT's 93."""


class ConvStem(nn.Module):
    """Three conv-BN-ReLU layers (the first with stride 2), then a strided projection to tokens."""

    def __init__(self, in_chans: int, hidden: int, embed_dim: int, patch_size: int, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        layers: list[nn.Module] = []
        for index, (kernel, stride) in enumerate(((7, 2), (3, 1), (3, 1))):
            channels_in = in_chans if index == 0 else hidden
            layers.append(nn.Conv2d(channels_in, hidden, kernel, stride, kernel // 2, bias=False, **factory))
            layers.append(nn.BatchNorm2d(hidden, **factory))
            layers.append(nn.ReLU())
        self.conv = nn.Sequential(*layers)
        self.proj = nn.Conv2d(hidden, embed_dim, patch_size // 2, stride=patch_size // 2, **factory)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images -> (B, H/patch, W/patch, D) channels-last grid."""
        return self.proj(self.conv(images)).permute(0, 2, 3, 1)


class Downsample(nn.Module):
    """Halve a channels-last grid with a 2x2 stride-2 convolution."""

    def __init__(self, dim_in: int, dim_out: int, device=None, dtype=None):
        super().__init__()
        self.proj = nn.Conv2d(dim_in, dim_out, 2, stride=2, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


def _window_offsets(kernel: int, stride: int, out_hw: Grid) -> list[tuple[slice, slice]]:
    """For each of the kernel x kernel offsets, the rows and columns of a padded grid that the
    windows (``out_hw`` of them, ``stride`` apart) read at that offset."""
    rows, cols = out_hw
    return [
        (slice(i, i + stride * (rows - 1) + 1, stride), slice(j, j + stride * (cols - 1) + 1, stride))
        for i in range(kernel)
        for j in range(kernel)
    ]


def gather_windows(padded: torch.Tensor, heads: int, kernel: int, stride: int, out_hw: Grid) -> torch.Tensor:
    """(B, Hp, Wp, C) padded grid -> (B, windows, heads, K^2, C / heads): ``F.unfold`` for a channels-last
    grid, written straight into the layout outlook attention multiplies (one strided copy per offset).
    Windows outermost keep each window's K^2 x C values in one block: its weights come from the
    attention projection in that order, and the copies run on 64-byte head rows without a permute."""
    batch, _, _, dim = padded.shape
    windows = padded.new_empty(batch, *out_hw, heads, kernel * kernel, dim // heads)
    for index, (rows, cols) in enumerate(_window_offsets(kernel, stride, out_hw)):
        windows[:, :, :, :, index] = padded[:, rows, cols].unflatten(-1, (heads, -1))
    return windows.flatten(1, 2)


def scatter_windows(windows: torch.Tensor, padded_shape: torch.Size, kernel: int, stride: int, out_hw: Grid):
    """The adjoint of :func:`gather_windows` (``F.fold``): every window added back where it was read,
    overlaps summed, onto a zero (B, Hp, Wp, C) grid.

    Offsets i and i' (per axis) reach the same rows only when i = i' (mod stride), so the offsets
    below ``stride`` on both axes are the first to reach their rows and columns: they copy instead of
    adding onto zeros (4 of VOLO's 9 offsets; a copy took a third of an add's time)."""
    heads = windows.shape[2]
    windows = windows.unflatten(1, out_hw)
    grid = windows.new_zeros(padded_shape)
    for index, (rows, cols) in enumerate(_window_offsets(kernel, stride, out_hw)):
        target, source = grid[:, rows, cols].unflatten(-1, (heads, -1)), windows[:, :, :, :, index]
        first = all(offset < stride for offset in divmod(index, kernel))
        target.copy_(source) if first else target.add_(source)
    return grid


class GatherWindows(torch.autograd.Function):
    """:func:`gather_windows` with :func:`scatter_windows` as its backward. ``F.unfold``/``F.fold`` on the
    channels-first view of a channels-last grid run as im2col/col2im, far slower than these strided copies,
    and need a permuting copy each way besides (docs/benchmarks.md, "What each technique buys")."""

    @staticmethod
    def forward(ctx, padded: torch.Tensor, heads: int, kernel: int, stride: int, out_hw: Grid) -> torch.Tensor:
        ctx.shape, ctx.window = padded.shape, (kernel, stride, out_hw)
        return gather_windows(padded, heads, kernel, stride, out_hw)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return scatter_windows(grad, ctx.shape, *ctx.window), None, None, None, None


class ScatterWindows(torch.autograd.Function):
    """:func:`scatter_windows` with :func:`gather_windows` as its backward."""

    @staticmethod
    def forward(ctx, windows: torch.Tensor, padded_shape: torch.Size, kernel: int, stride: int, out_hw: Grid):
        ctx.heads, ctx.window = windows.shape[2], (kernel, stride, out_hw)
        return scatter_windows(windows, padded_shape, kernel, stride, out_hw)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_windows(grad, ctx.heads, *ctx.window), None, None, None, None


class ScaledSoftmax(torch.autograd.Function):
    """``(x * scale).softmax(-1)`` for short rows (outlook attention's K^2 = 9), computed in float32
    with whole-tensor ops. PyTorch's CPU softmax kernel vectorizes along the row, so 9-wide rows run
    slower through it, forward and backward; the scale rides along instead of a separate multiply.
    ``scale`` must be > 0."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, scale: float) -> torch.Tensor:
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
        exp = wide.sub_(wide.amax(-1, keepdim=True)).mul_(scale).exp_()
        probabilities = exp.div_(exp.sum(-1, keepdim=True)).to(logits.dtype)
        ctx.save_for_backward(probabilities)
        ctx.scale = scale
        return probabilities

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (probabilities,) = ctx.saved_tensors
        wide_p = probabilities.to(torch.promote_types(probabilities.dtype, torch.float32))
        wide = grad.to(wide_p.dtype, copy=True)
        wide.sub_((wide * wide_p).sum(-1, keepdim=True)).mul_(wide_p).mul_(ctx.scale)
        return wide.to(grad.dtype), None


class OutlookAttention(nn.Module):
    """Outlook attention (§3.1): per window, K^2 x K^2 weights from the window's pooled centre feature
    (a linear map, no query-key product) mix the window's values; overlapping windows are summed
    back onto the grid (fold)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        kernel_size: int = 3,
        stride: int = 2,
        qkv_bias: bool = False,
        attn_drop: float = 0.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_heads = num_heads
        self.kernel_size = kernel_size
        self.stride = stride
        self.scale = (dim // num_heads) ** -0.5
        self.v = nn.Linear(dim, dim, bias=qkv_bias, **factory)
        self.attn = nn.Linear(dim, kernel_size**4 * num_heads, **factory)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, height, width, dim = x.shape
        kernel, stride, padding = self.kernel_size, self.stride, self.kernel_size // 2
        out_hw = ((height + 2 * padding - kernel) // stride + 1, (width + 2 * padding - kernel) // stride + 1)
        padded = F.pad(self.v(x), (0, 0, padding, padding, padding, padding))
        values = GatherWindows.apply(padded, self.num_heads, kernel, stride, out_hw)  # (B, L, heads, K^2, hd)
        pooled = F.avg_pool2d(x.permute(0, 3, 1, 2), stride, stride, ceil_mode=True).permute(0, 2, 3, 1)
        logits = self.attn(pooled).reshape(batch, -1, self.num_heads, kernel**2, kernel**2)
        weights = self.attn_drop(ScaledSoftmax.apply(logits, self.scale))
        out = ScatterWindows.apply(weights @ values, padded.shape, kernel, stride, out_hw)
        return self.proj(out[:, padding : padding + height, padding : padding + width])


class SelfAttention(Attention):
    """Multi-head self-attention over a channels-last grid, flattened to tokens (the shared layer, so
    ``attn_impl`` and the attention probe apply to VOLO's transformer stages too)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, height, width, dim = x.shape
        return super().forward(x.reshape(batch, height * width, dim)).reshape(batch, height, width, dim)


class ClassAttention(nn.Module):
    """The CLS token attends to all tokens (itself included); only its update is returned (CaiT).

    One query row per head: explicit matmuls, as timm writes it; SDPA's CPU flash kernel has a slow
    backward for that single row. The softmax over it is taken in float32."""

    def __init__(
        self, dim: int, num_heads: int, qkv_bias: bool = False, attn_drop: float = 0.0, device=None, dtype=None
    ):
        super().__init__()
        self.num_heads = num_heads
        self.attn_drop = attn_drop
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias, device=device, dtype=dtype)
        self.q = nn.Linear(dim, dim, bias=qkv_bias, device=device, dtype=dtype)
        self.proj = nn.Linear(dim, dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        head_dim = dim // self.num_heads
        k, v = self.kv(x).reshape(batch, tokens, 2, self.num_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q = self.q(x[:, :1]).reshape(batch, 1, self.num_heads, head_dim).transpose(1, 2)
        scores = (q * head_dim**-0.5) @ k.transpose(-2, -1)
        weights = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        cls = F.dropout(weights.to(v.dtype), self.attn_drop, self.training) @ v
        return self.proj(cls.transpose(1, 2).reshape(batch, 1, dim))


class GridBlock(nn.Module):
    """Pre-norm block on a (B, H, W, C) grid: x + attention(LN(x)), then x + FFN(LN(x)). The
    attention module is the variant: outlook attention (an Outlooker) or self-attention (a
    transformer block)."""

    def __init__(self, dim: int, attn: nn.Module, mlp_hidden: int, drop_path: float = 0.0, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.norm1 = nn.LayerNorm(dim, **factory)
        self.attn = attn
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, **factory)
        self.mlp = Mlp(dim, mlp_hidden, **factory)
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x)))
        return x + self.drop_path2(self.mlp(self.norm2(x), _grid(x)))


class ClassBlock(nn.Module):
    """Class-attention block: updates the CLS token (first) from all tokens; patch tokens pass through."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_hidden: int,
        qkv_bias: bool = False,
        attn_drop: float = 0.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.norm1 = nn.LayerNorm(dim, **factory)
        self.attn = ClassAttention(dim, num_heads, qkv_bias, attn_drop, **factory)
        self.norm2 = nn.LayerNorm(dim, **factory)
        self.mlp = Mlp(dim, mlp_hidden, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cls, patches = split_prefix(x, 1)
        cls = cls + self.attn(self.norm1(x))
        cls = cls + self.mlp(self.norm2(cls), (1, 1))  # the CLS token alone: a 1x1 "grid"
        return torch.cat([cls, patches], dim=1)


def _grid(x: torch.Tensor) -> Grid:
    return (x.shape[1], x.shape[2])


def _build_block(args: VOLOArgs, stage: int, block_index: int, factory: dict) -> nn.Module:
    dim, heads = args.embed_dims[stage], args.num_heads[stage]
    mlp_hidden = int(dim * args.mlp_ratio)
    if args.outlook_attention[stage]:  # no stochastic depth in outlookers, as in the official code
        attn = OutlookAttention(
            dim, heads, args.outlook_kernel_size, args.outlook_stride, args.qkv_bias, args.attn_drop_rate, **factory
        )
        return GridBlock(dim, attn, mlp_hidden, **factory)
    drop_path = args.drop_path_rate * block_index / max(sum(args.layers) - 1, 1)
    attn = SelfAttention(
        dim,
        heads,
        attn_drop=args.attn_drop_rate,
        impl=args.attn_impl,
        softmax_fp32=args.attn_softmax_fp32,
        qkv_bias=args.qkv_bias,
        **factory,
    )
    return GridBlock(dim, attn, mlp_hidden, drop_path, **factory)


class VOLO(nn.Module):
    def __init__(self, args: VOLOArgs, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.args = args
        dim = args.embed_dims[-1]
        self.patch_embed = ConvStem(args.in_chans, args.stem_hidden_dim, args.embed_dims[0], args.patch_size, **factory)
        pos_side = args.img_size // args.pos_embed_stride
        pos_dim = args.embed_dims[args.pos_embed_stage]
        self.pos_embed = nn.Parameter(torch.zeros(1, pos_side, pos_side, pos_dim, **factory))
        self.pos_drop = nn.Dropout(args.pos_drop_rate)
        self.network, self._pos_embed_index = self._build_network(args, factory)
        mlp_hidden = int(dim * args.mlp_ratio)
        self.post_network = nn.ModuleList(
            ClassBlock(dim, args.num_heads[-1], mlp_hidden, args.qkv_bias, args.attn_drop_rate, **factory)
            for _ in args.post_layers
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim, **factory))
        self.aux_head = nn.Linear(dim, args.num_classes, **factory) if args.use_aux_head else None
        self.norm = nn.LayerNorm(dim, **factory)
        self.head_drop = nn.Dropout(args.drop_rate)
        self.head = nn.Linear(dim, args.num_classes, **factory)
        self._layer_ids = self._number_layers()
        self.aux_output = False
        """With an auxiliary head, ``forward`` returns ``(cls_logits, aux_logits)`` apart (``set_aux_output``)."""
        if device is None or torch.device(device).type != "meta":
            self.init_weights()

    @staticmethod
    def _build_network(args: VOLOArgs, factory: dict) -> tuple[nn.ModuleList, int]:
        """Stages interleaved with downsamplings (timm's ``network.{i}`` indices), and the index of
        the first transformer stage, where the position embedding is added."""
        network: list[nn.Module] = []
        pos_embed_index = -1
        for stage, num_blocks in enumerate(args.layers):
            first = sum(args.layers[:stage])
            blocks = [_build_block(args, stage, first + offset, factory) for offset in range(num_blocks)]
            if stage == args.pos_embed_stage:
                pos_embed_index = len(network)
            network.append(nn.Sequential(*blocks))
            if args.downsamples[stage]:
                network.append(Downsample(args.embed_dims[stage], args.embed_dims[stage + 1], **factory))
        return nn.ModuleList(network), pos_embed_index

    def _number_layers(self) -> dict[str, int]:
        """Parameter-name prefix -> layer id: blocks and downsamplings in the order they run."""
        prefixes = []
        for index, layer in enumerate(self.network):
            if isinstance(layer, Downsample):
                prefixes.append(f"network.{index}.")
            else:
                prefixes.extend(f"network.{index}.{block}." for block in range(len(layer)))
        prefixes.extend(f"post_network.{block}." for block in range(len(self.post_network)))
        return {prefix: layer_id for layer_id, prefix in enumerate(prefixes, start=1)}

    # --- the model protocol (docs/models.md) ------------------------------------------------

    @torch.no_grad()
    def init_weights(self) -> None:
        """timm's scheme: truncated normal (std 0.02) for linear layers, position embedding and CLS
        token; PyTorch defaults for convolutions, batch and layer norms."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.Conv2d, nn.BatchNorm2d, nn.LayerNorm)):
                module.reset_parameters()

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}

    def block_modules(self) -> list[nn.Module]:
        """The repeated blocks (outlookers, transformers, class attention), in the order they run:
        units of FSDP sharding and activation checkpointing."""
        blocks = [block for layer in self.network if isinstance(layer, nn.Sequential) for block in layer]
        return blocks + list(self.post_network)

    @property
    def num_layers(self) -> int:
        """Layers between the embeddings and the heads, as :meth:`layer_id` counts them: every block
        (outlooker, transformer, class attention) and every downsampling."""
        return len(self._layer_ids)

    def layer_id(self, param_name: str) -> int:
        """Depth for layer-wise LR decay: 0 stem and embeddings (CLS token included), then one id per
        block or downsampling in the order they run (timm's fine ``group_matcher``), ``num_layers + 1``
        for the final norm and the heads."""
        if param_name.startswith(("patch_embed.", "pos_embed", "cls_token")):
            return 0
        for prefix, layer_id in self._layer_ids.items():
            if param_name.startswith(prefix):
                return layer_id
        return self.num_layers + 1

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """Images -> (B, 1 + patches, D) tokens after the final norm, CLS token first."""
        height, width = images.shape[-2:]
        stride = self.args.total_stride
        if height % stride or width % stride:
            raise ValueError(f"input {height}x{width} is not divisible by VOLO's total stride {stride}")
        x = self.patch_embed(images)
        for index, layer in enumerate(self.network):
            if index == self._pos_embed_index:
                x = self.pos_drop(x + self._pos_embed_for(_grid(x)))
            x = layer(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x.flatten(1, 2)], dim=1)
        for block in self.post_network:
            x = block(x)
        return self.norm(x)

    def _pos_embed_for(self, grid: Grid) -> torch.Tensor:
        if _grid(self.pos_embed) == grid:
            return self.pos_embed
        # The shared ViT resampler takes (1, H*W, D) tokens: flatten our (1, H, W, D) grid for it.
        resampled = resample_pos_embed(self.pos_embed.flatten(1, 2), grid, num_prefix_tokens=0)
        return resampled.reshape(1, *grid, self.pos_embed.shape[-1])

    def forward_head_with_tokens(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(class logits (B, classes), per-patch auxiliary logits (B, patches, classes)) for token labeling."""
        if self.aux_head is None:
            raise ValueError("this VOLO has no auxiliary head; build it with use_aux_head=True")
        cls_logits = self.head(self.head_drop(tokens[:, 0]))
        return cls_logits, self.aux_head(self.head_drop(tokens[:, 1:]))

    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Class logits, plus 0.5 x the max over patches of the auxiliary logits when there is an
        auxiliary head (the paper's and timm's inference rule); with ``aux_output`` the two apart."""
        if pre_logits:
            return self.head_drop(tokens[:, 0])
        if self.aux_head is None:
            return self.head(self.head_drop(tokens[:, 0]))
        cls_logits, aux_logits = self.forward_head_with_tokens(tokens)
        return (cls_logits, aux_logits) if self.aux_output else cls_logits + 0.5 * aux_logits.amax(dim=1)

    def set_aux_output(self, enable: bool = True) -> None:
        self.aux_output = enable

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(images))


def volo_flops(args: VOLOArgs, img_size: int) -> int:
    """Forward FLOPs per image at a square ``img_size`` input: convolutions, linear layers and attention
    matmuls (what ``FlopCounterMode`` counts), not norms, softmax, pooling or unfold/fold."""
    if img_size % args.total_stride:
        raise ValueError(f"img_size {img_size} is not divisible by VOLO's total stride {args.total_stride}")
    hidden, side = args.stem_hidden_dim, img_size // 2
    flops = 2 * side * side * hidden * (args.in_chans * 7 * 7 + 2 * hidden * 3 * 3)
    side = img_size // args.patch_size
    flops += 2 * side * side * hidden * (args.patch_size // 2) ** 2 * args.embed_dims[0]
    for stage, num_blocks in enumerate(args.layers):
        dim, tokens = args.embed_dims[stage], side * side
        ffn = 2 * 2 * tokens * dim * int(dim * args.mlp_ratio)
        if args.outlook_attention[stage]:
            num_windows = math.ceil(side / args.outlook_stride) ** 2
            kernel_area = args.outlook_kernel_size**2
            weights = 2 * num_windows * dim * kernel_area**2 * args.num_heads[stage]
            mixing = 2 * num_windows * kernel_area**2 * dim  # (K^2 x K^2) @ (K^2 x head_dim) per head
            attention = 2 * 2 * tokens * dim * dim + weights + mixing  # v and proj, then the above
        else:
            attention = 2 * tokens * dim * 3 * dim + 2 * 2 * tokens * tokens * dim + 2 * tokens * dim * dim
        flops += num_blocks * (attention + ffn)
        if args.downsamples[stage]:
            side //= 2
            flops += 2 * side * side * dim * 2 * 2 * args.embed_dims[stage + 1]
    dim, patches = args.embed_dims[-1], side * side
    tokens = patches + 1
    class_attention = 2 * tokens * dim * 2 * dim + 2 * dim * dim + 2 * 2 * tokens * dim + 2 * dim * dim
    flops += len(args.post_layers) * (class_attention + 2 * 2 * dim * int(dim * args.mlp_ratio))
    flops += 2 * dim * args.num_classes * (1 + (patches if args.use_aux_head else 0))
    return flops
