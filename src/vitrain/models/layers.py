"""Transformer building blocks shared by the ViT family.

Parameter names follow timm's ``VisionTransformer`` (``attn.qkv``, ``mlp.fc1`` ...) so state
dicts move between the two without renaming. Every constructor takes ``device``/``dtype`` so a
model can be built on the meta device and materialized later.
"""

from __future__ import annotations

import contextlib
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

Grid = tuple[int, int]


def tokens_as_image(tokens: torch.Tensor, grid: Grid) -> torch.Tensor:
    """View ``(B, H*W, C)`` patch tokens as a ``(B, C, H, W)`` image without copying.

    The view has channels_last strides, which PyTorch's convolutions and BatchNorm take natively,
    so the convolutional FFNs skip the NCHW copy in and out, which makes LocalViT's and the Borealis
    FFN's forward + backward faster on CPU (docs/benchmarks.md, "Convolutional FFN layout").
    """
    batch, count, channels = tokens.shape
    if count != grid[0] * grid[1]:
        raise ValueError(f"{count} patch tokens do not fill a {grid[0]}x{grid[1]} grid")
    return tokens.reshape(batch, grid[0], grid[1], channels).permute(0, 3, 1, 2)


def image_as_tokens(image: torch.Tensor) -> torch.Tensor:
    """Inverse of ``tokens_as_image``: ``(B, C, H, W)`` to ``(B, H*W, C)``, a view when the image
    is channels_last (what convolutions return for a channels_last input)."""
    return image.permute(0, 2, 3, 1).flatten(1, 2)


def split_prefix(tokens: torch.Tensor, num_prefix_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefix tokens, patch tokens) of (B, N, C) tokens, as views. ``split`` rather than two slices:
    the backward of a slice writes its gradient into a zero-filled tensor of the whole input's size,
    so two slices cost two full fills and an add; split's backward is one concatenation
    (docs/benchmarks.md, "What each technique buys")."""
    return tokens.split([num_prefix_tokens, tokens.shape[1] - num_prefix_tokens], dim=1)


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample (Huang et al. 2016)."""

    def __init__(self, rate: float = 0.0):
        super().__init__()
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rate == 0.0 or not self.training:
            return x
        keep = 1.0 - self.rate
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask.div_(keep)

    def extra_repr(self) -> str:
        return f"rate={self.rate}"


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> tokens, by a strided convolution (``bias=False``: CLIP's, which a
    LayerNorm follows)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, patch_size, stride=patch_size, bias=bias, device=device, dtype=dtype)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, Grid]:
        height, width = images.shape[-2:]
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(f"input {height}x{width} is not divisible by the patch size {self.patch_size}")
        x = self.proj(images)
        grid = (x.shape[-2], x.shape[-1])
        return x.flatten(2).transpose(1, 2), grid


def conv_stem_depth(patch_size: int) -> int:
    """How many stride-2 convolutions make a stride of ``patch_size``; ValueError unless a power of two."""
    depth = patch_size.bit_length() - 1
    if patch_size < 2 or patch_size != 1 << depth:
        raise ValueError(
            f"the convolutional stem needs a power-of-two patch size (one stride-2 convolution per halving), "
            f"got {patch_size}; use patch 8 or 16 (e.g. 32 px images with patch 8) or the patchify stem"
        )
    return depth


class ConvStem(nn.Module):
    """The convolutional stem of Xiao et al. 2021 ("Early Convolutions Help Transformers See
    Better", ViT_C) in place of the patchify convolution: k = log2(patch) 3x3 stride-2 convolutions,
    each with BatchNorm and ReLU, of widths embed_dim/2^k ... embed_dim/2, then a 1x1 convolution
    to embed_dim. Same token grid as ``PatchEmbed`` (patch must be a power of two)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int, device=None, dtype=None):
        super().__init__()
        depth = conv_stem_depth(patch_size)
        factory = {"device": device, "dtype": dtype}
        self.patch_size = patch_size
        layers: list[nn.Module] = []
        channels = in_chans
        for level in range(depth, 0, -1):
            width = max(1, embed_dim >> level)
            layers += [
                nn.Conv2d(channels, width, 3, stride=2, padding=1, bias=False, **factory),
                nn.BatchNorm2d(width, **factory),
                nn.ReLU(),
            ]
            channels = width
        self.convs = nn.Sequential(*layers)
        self.proj = nn.Conv2d(channels, embed_dim, 1, **factory)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, Grid]:
        height, width = images.shape[-2:]
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(f"input {height}x{width} is not divisible by the patch size {self.patch_size}")
        x = self.proj(self.convs(images))
        return x.flatten(2).transpose(1, 2), (x.shape[-2], x.shape[-1])


def conv_stem_flops(patch_size: int, in_chans: int, embed_dim: int, img_size: int) -> int:
    """Forward FLOPs per image of ``ConvStem`` (convolutions only, multiply-add = 2)."""
    depth = conv_stem_depth(patch_size)
    flops, channels, side = 0, in_chans, img_size
    for level in range(depth, 0, -1):
        side, width = -(-side // 2), max(1, embed_dim >> level)
        flops += 2 * side * side * channels * width * 9
        channels = width
    return flops + 2 * side * side * channels * embed_dim


_AUTOCAST_DEVICES = {name: torch.amp.is_autocast_available(name) for name in ("cpu", "cuda", "xpu", "mps", "meta")}
"""Which device types have autocast (not the meta device), asked once here: torch before 2.14 cannot
trace the question, and asking it inside ``torch.compile`` broke the graph at every attention."""


def _autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    available = _AUTOCAST_DEVICES.get(device.type)
    if available is None:  # a device type not listed: asked each time
        available = torch.amp.is_autocast_available(device.type)
    return torch.autocast(device.type, enabled=False) if available else contextlib.nullcontext()


class MatmulAttention(torch.autograd.Function):
    """softmax(scale * q k^T) v for all heads, from the fused (B, N, 3 * heads * head_dim) qkv
    projection to (B, N, heads * head_dim), with its backward written out.

    One copy in each direction puts q, k, v head-major, (3, B * heads, N, head_dim), and the result
    back token-major; the products are batched matmuls on those blocks and transposed views of them,
    the scale rides on the matmul (``baddbmm``'s alpha), and the backward writes dq, dk, dv straight
    into one head-major buffer. Autograd through the unbound q, k, v instead makes a contiguous copy
    of each per product, a scaled copy of q, and a stack of their gradients before the copy back:
    this is faster forward + backward (docs/benchmarks.md, "What each technique buys"). Holds the
    head-major q, k, v and the probabilities for the backward."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, head_dim: int, scale: float) -> torch.Tensor:
        with _autocast_off(qkv.device):  # qkv is already in the compute dtype
            return MatmulAttention._forward(ctx, qkv, head_dim, scale)

    @staticmethod
    def _forward(ctx, qkv: torch.Tensor, head_dim: int, scale: float) -> torch.Tensor:
        batch, tokens, width = qkv.shape
        heads = width // (3 * head_dim)
        blocks = qkv.reshape(batch, tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        blocks = blocks.reshape(3, batch * heads, tokens, head_dim)
        q, k, v = blocks.unbind(0)
        scores = q.new_empty(batch * heads, tokens, tokens)
        torch.baddbmm(scores, q, k.transpose(1, 2), beta=0, alpha=scale, out=scores)
        probabilities = scores.softmax(dim=-1)
        ctx.save_for_backward(blocks, probabilities)
        ctx.scale = scale
        out = torch.bmm(probabilities, v).view(batch, heads, tokens, head_dim)
        return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with _autocast_off(grad.device):
            return MatmulAttention._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad: torch.Tensor):
        blocks, probabilities = ctx.saved_tensors
        _, batch_heads, tokens, head_dim = blocks.shape
        batch = grad.shape[0]
        q, k, v = blocks.unbind(0)
        grad = grad.reshape(batch, tokens, -1, head_dim).transpose(1, 2).reshape(batch_heads, tokens, head_dim)
        grads = torch.empty_like(blocks)
        grad_q, grad_k, grad_v = grads.unbind(0)
        torch.bmm(probabilities.transpose(1, 2), grad, out=grad_v)
        grad_scores = torch._softmax_backward_data(
            torch.bmm(grad, v.transpose(1, 2)), probabilities, -1, probabilities.dtype
        )
        torch.baddbmm(grad_q, grad_scores, k, beta=0, alpha=ctx.scale, out=grad_q)
        torch.baddbmm(grad_k, grad_scores.transpose(1, 2), q, beta=0, alpha=ctx.scale, out=grad_k)
        grads = grads.view(3, batch, -1, tokens, head_dim).permute(1, 3, 0, 2, 4)
        return grads.reshape(batch, tokens, 3 * batch_heads // batch * head_dim), None, None


AttentionImpl = Literal["sdpa", "matmul", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math"]
"""Attention cores: ``sdpa`` (SDPA with torch's choice of kernel), ``matmul`` (explicit products), or SDPA
pinned to one of its kernels (``sdpa_<backend>``)."""

SDPA_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_math": "MATH",
}
"""The SDPA kernels an attention core can be pinned to, by ``SDPBackend`` member."""


class SdpaAttention(nn.Module):
    """Attention core by ``F.scaled_dot_product_attention``: fused qkv ``(B, N, 3 * heads * head_dim)`` to
    ``(B, N, heads * head_dim)``. The kernel (flash, memory-efficient, cuDNN or math) is torch's choice, or
    the one ``backend`` pins (a key of :data:`SDPA_BACKENDS`; the step fails where it cannot run)."""

    def __init__(self, head_dim: int, dropout: float = 0.0, backend: str | None = None):
        super().__init__()
        if backend is not None and backend not in SDPA_BACKENDS:
            raise ValueError(f"SDPA backend must be one of {sorted(SDPA_BACKENDS)}, not {backend!r}")
        self.head_dim, self.dropout, self.backend = head_dim, dropout, backend

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = qkv.shape
        # heads inferred (-1): under tensor parallelism each process holds only its share of them
        q, k, v = qkv.reshape(batch, tokens, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        dropout = self.dropout if self.training else 0.0
        if self.backend is None:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
        else:
            with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[self.backend])):
                x = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
        return x.transpose(1, 2).reshape(batch, tokens, -1)


class MatmulAttentionCore(nn.Module):
    """Attention core by explicit matmuls, ``softmax(scale q k^T) v``: :class:`MatmulAttention` (its
    backward written out); with dropout in training, or ``softmax_fp32``, the products through autograd.

    ``softmax_fp32`` is DeiT's fix for NaN losses in fp16: scores q.k^T and their softmax in fp32 (an fp16
    product overflows past 65504), the probabilities back in v's dtype for the second product. SDPA needs
    no switch: its fused kernels accumulate in fp32 and its math fallback upcasts fp16/bf16."""

    def __init__(self, head_dim: int, dropout: float = 0.0, softmax_fp32: bool = False):
        super().__init__()
        self.head_dim, self.dropout, self.softmax_fp32 = head_dim, dropout, softmax_fp32
        self.scale = head_dim**-0.5

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        if not dropout and not self.softmax_fp32:
            return MatmulAttention.apply(qkv, self.head_dim, self.scale)
        batch, tokens, _ = qkv.shape
        q, k, v = qkv.reshape(batch, tokens, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.softmax_fp32:
            with _autocast_off(q.device):
                probabilities = ((q.float() * self.scale) @ k.float().transpose(-2, -1)).softmax(dim=-1)
            probabilities = probabilities.to(v.dtype)
        else:
            probabilities = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        x = F.dropout(probabilities, dropout, self.training) @ v
        return x.transpose(1, 2).reshape(batch, tokens, -1)


def attention_core(impl: AttentionImpl, head_dim: int, dropout: float = 0.0, softmax_fp32: bool = False) -> nn.Module:
    """The attention core for ``impl``: what ``model.attn_impl`` (and the attention probe) choose."""
    if impl == "sdpa":
        return SdpaAttention(head_dim, dropout)
    if impl in SDPA_BACKENDS:
        return SdpaAttention(head_dim, dropout, backend=impl)
    if impl == "matmul":
        return MatmulAttentionCore(head_dim, dropout, softmax_fp32)
    raise ValueError(f"attention impl must be one of {sorted(['sdpa', 'matmul', *SDPA_BACKENDS])}, not {impl!r}")


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection; the product itself is ``self.core``
    (:func:`attention_core`)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        impl: AttentionImpl = "sdpa",
        softmax_fp32: bool = False,
        qkv_bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed dim {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_drop, self.softmax_fp32 = attn_drop, softmax_fp32
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, device=device, dtype=dtype)
        self.core = attention_core(impl, self.head_dim, attn_drop, softmax_fp32)
        self.proj = nn.Linear(dim, dim, device=device, dtype=dtype)
        self.proj_drop = nn.Dropout(proj_drop)

    @property
    def impl(self) -> AttentionImpl:
        if isinstance(self.core, SdpaAttention):
            return self.core.backend or "sdpa"
        return "matmul"

    @impl.setter
    def impl(self, impl: AttentionImpl) -> None:
        self.core = attention_core(impl, self.head_dim, self.attn_drop, self.softmax_fp32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_drop(self.proj(self.core(self.qkv(x))))


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)``: the GELU approximation of OpenAI's CLIP (Radford et al. 2021), which its
    released image towers were trained with (timm's ``act_layer="quick_gelu"``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class Mlp(nn.Module):
    """FFN of ViT: expand, GELU (or ``act_layer``), reduce."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        drop: float = 0.0,
        num_prefix_tokens: int = 0,
        act_layer: type[nn.Module] = nn.GELU,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, device=device, dtype=dtype)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden, dim, device=device, dtype=dtype)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class LocalityMlp(nn.Module):
    """FFN with locality (Borealis: Irandoust et al. 2022, §2.1): FC expand -> Seq2Im -> 3x3 depthwise conv
    -> h-swish -> Im2Seq -> FC reduce.

    Prefix tokens (CLS) have no grid position, so they bypass the convolution and take
    FC -> h-swish -> FC; the paper's figure shows only patch tokens.
    """

    def __init__(self, dim: int, hidden: int, drop: float = 0.0, num_prefix_tokens: int = 0, device=None, dtype=None):
        super().__init__()
        self.num_prefix_tokens = num_prefix_tokens
        self.fc1 = nn.Linear(dim, hidden, device=device, dtype=dtype)
        self.conv = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, device=device, dtype=dtype)
        self.act = nn.Hardswish()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden, dim, device=device, dtype=dtype)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        x = self.fc1(x)
        prefix, patches = split_prefix(x, self.num_prefix_tokens)
        patches = image_as_tokens(self.conv(tokens_as_image(patches, grid)))
        x = torch.cat([prefix, patches], dim=1) if self.num_prefix_tokens else patches
        return self.drop2(self.fc2(self.drop1(self.act(x))))


class LayerScale(nn.Module):
    """A learned per-channel factor ``gamma`` on a residual branch, starting at ``init_value`` (LayerScale:
    Touvron et al. 2021, CaiT sec. 2; DeiT III's ViTs). timm's module and parameter name."""

    def __init__(self, dim: int, init_value: float, device=None, dtype=None):
        super().__init__()
        self.init_value = init_value
        self.gamma = nn.Parameter(torch.full((dim,), init_value, device=device, dtype=dtype))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.gamma.fill_(self.init_value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    """Pre-norm transformer block: x + MSA(LN(x)), then x + FFN(LN(x)) (Irandoust et al. 2022, eq. 1);
    with ``layer_scale`` each branch is scaled by a learned per-channel factor (``ls1``, ``ls2``: LayerScale,
    identities without it, as in timm)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_hidden: int,
        mlp_type: type[nn.Module] = Mlp,
        num_prefix_tokens: int = 0,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        attn_impl: AttentionImpl = "sdpa",
        attn_softmax_fp32: bool = False,
        layer_scale: float | None = None,
        norm_eps: float = 1e-6,
        device=None,
        dtype=None,
    ):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps, **factory)
        self.attn = Attention(dim, num_heads, attn_drop, drop, attn_impl, attn_softmax_fp32, **factory)
        self.ls1 = LayerScale(dim, layer_scale, **factory) if layer_scale else nn.Identity()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps, **factory)
        self.mlp = mlp_type(dim, mlp_hidden, drop, num_prefix_tokens, **factory)
        self.ls2 = LayerScale(dim, layer_scale, **factory) if layer_scale else nn.Identity()
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x), grid)))


class Blocks(nn.ModuleList):
    """The stack of transformer blocks, applied in order (state-dict keys ``blocks.0...``, as a
    ``ModuleList``'s)."""

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        for block in self:
            x = block(x, grid)
        return x


def resample_pos_embed(pos_embed: torch.Tensor, new_grid: Grid, num_prefix_tokens: int) -> torch.Tensor:
    """Resize a learned ``(1, prefix + H*W, D)`` position embedding to ``new_grid`` (bicubic).

    Prefix-token embeddings (CLS) are kept apart and unchanged. The old grid must be square.
    """
    prefix, patches = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    old_side = math.isqrt(patches.shape[1])
    if old_side * old_side != patches.shape[1]:
        raise ValueError(f"cannot resample a non-square grid of {patches.shape[1]} position embeddings")
    if (old_side, old_side) == tuple(new_grid):
        return pos_embed
    dim = patches.shape[-1]
    image = patches.reshape(1, old_side, old_side, dim).permute(0, 3, 1, 2).float()
    image = F.interpolate(image, size=new_grid, mode="bicubic", align_corners=False, antialias=True)
    patches = image.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(pos_embed.dtype)
    return torch.cat([prefix, patches], dim=1)
