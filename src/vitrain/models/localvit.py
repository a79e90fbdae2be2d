"""LocalViT (Li et al., "LocalViT: Bringing Locality to Vision Transformers", arXiv 2104.05707):
a DeiT whose FFN is an inverted residual block, the locality baseline of Irandoust et al. 2022 (Borealis, §2.1
and §3.2: "LocalViT uses 2D BatchNorm ... convolution layers ... h-swish and squeeze-and-excitation").

The FFN (``LocalViTMlp``) reshapes the patch tokens to their grid and applies 1x1 conv expand ->
BatchNorm -> h-swish -> 3x3 depthwise conv -> BatchNorm -> h-swish -> squeeze-and-excitation ->
1x1 conv reduce -> BatchNorm. The rest of the network is our ``VisionTransformer`` with
``ViTArgs.ffn="localvit"`` (``vitrain.models.vit.build_localvit``).

Choices that differ from the official code (github.com/ofsoundof/LocalViT, ``models/localvit.py``,
the implementation Irandoust et al. 2022 trained):
- Our transformer block keeps its LayerNorm and stochastic depth around the FFN
  (``x + drop_path(ffn(norm2(x)))``); the official block has neither (``x + ffn(x)``). This adds
  ``2 * embed_dim`` parameters per block (9,216 for LocalViT-S).
- ``drop_rate`` also drops out inside the FFN (after SE and after the reduce), as in our ``Mlp``;
  the official FFN has no dropout. Both default to 0.
Kept from the official code: the CLS token skips the FFN entirely (its FFN output is zero, so the
residual leaves it unchanged); convolutions have no bias; the SE squeezes ``hidden`` channels to
``hidden // embed_dim`` (its ``reduction`` is the embedding width: ``localvit_small_mlp4_act3_r384``,
4 channels at MLP ratio 4), which is what gives the paper's 22.4M parameters (a reduction of 4
would give 36M); SE gates with ReLU and a hard sigmoid; LocalViT-S has 8 heads, LocalViT-T 4
(DeiT-S/T have 6/3; heads change neither parameters nor FLOPs). Initialization: 1x1 and
depthwise convs keep PyTorch's default, SE linear layers truncated normal (std 0.02), BatchNorm
weight 1 and bias 0 (timm's ``_init_weights``, which the official code applies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.models.layers import Grid, image_as_tokens, split_prefix, tokens_as_image

# Official variants (models/localvit.py: localvit_tiny_mlp4_act3_r192, localvit_small_mlp4_act3_r384)
# as ViTArgs fields; the paper reports 5.9M and 22.4M parameters for them (Li et al. 2021).
LOCALVIT_SIZES: dict[str, dict[str, int | str]] = {
    "tiny": {"embed_dim": 192, "depth": 12, "num_heads": 4, "patch_size": 16, "ffn": "localvit"},
    "small": {"embed_dim": 384, "depth": 12, "num_heads": 8, "patch_size": 16, "ffn": "localvit"},
}


class SqueezeExcitation(nn.Module):
    """Channel gate from the spatial mean (Hu et al. 2018): FC -> ReLU -> FC -> hard sigmoid."""

    def __init__(self, channels: int, hidden: int, device=None, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(channels, hidden, device=device, dtype=dtype)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, channels, device=device, dtype=dtype)
        self.gate = nn.Hardsigmoid()

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        scale = self.gate(self.fc2(self.act(self.fc1(image.mean(dim=(2, 3))))))
        return image * scale[:, :, None, None]


class LocalViTMlp(nn.Module):
    """LocalViT's FFN over the patch grid; prefix tokens (CLS) bypass it with a zero output.

    ``se_reduction`` divides ``hidden`` for the SE bottleneck; ``None`` means ``dim`` (official).
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        drop: float = 0.0,
        num_prefix_tokens: int = 0,
        device=None,
        dtype=None,
        *,
        se_reduction: int | None = None,
    ):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_prefix_tokens = num_prefix_tokens
        self.expand = nn.Conv2d(dim, hidden, 1, bias=False, **factory)
        self.expand_norm = nn.BatchNorm2d(hidden, **factory)
        self.depthwise = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False, **factory)
        self.depthwise_norm = nn.BatchNorm2d(hidden, **factory)
        self.act = nn.Hardswish()
        self.se = SqueezeExcitation(hidden, max(1, hidden // (se_reduction or dim)), **factory)
        self.drop1 = nn.Dropout(drop)
        self.reduce = nn.Conv2d(hidden, dim, 1, bias=False, **factory)
        self.reduce_norm = nn.BatchNorm2d(dim, **factory)
        self.drop2 = nn.Dropout(drop)

    @staticmethod
    def pointwise(tokens: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
        """A 1x1 convolution applied to ``(B, N, C)`` tokens: the matmul it is."""
        return F.linear(tokens, conv.weight.flatten(1), conv.bias)

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        # Tokens stay (B, N, C): the 1x1 convolutions run as the matmuls they are (``pointwise``), and
        # the depthwise conv and the BatchNorms see channels_last views of the same memory; no NCHW copy
        # is made. Same numbers as the official NCHW code (tested).
        prefix, patches = split_prefix(x, self.num_prefix_tokens)
        image = self.act(self.expand_norm(tokens_as_image(self.pointwise(patches, self.expand), grid)))
        image = self.act(self.depthwise_norm(self.depthwise(image)))
        hidden = image_as_tokens(self.drop1(self.se(image)))
        patches = tokens_as_image(self.pointwise(hidden, self.reduce), grid)
        patches = self.drop2(image_as_tokens(self.reduce_norm(patches)))
        return torch.cat([torch.zeros_like(prefix), patches], dim=1) if self.num_prefix_tokens else patches


def localvit_mlp_flops(dim: int, hidden: int, num_tokens: int, grid: Grid, se_reduction: int | None = None) -> int:
    """Forward FLOPs per image of one ``LocalViTMlp`` (multiply-add = 2; convolutions and linear
    layers, what ``FlopCounterMode`` counts). The ``num_tokens - H*W`` prefix tokens cost nothing."""
    patches = grid[0] * grid[1]
    if num_tokens < patches:
        raise ValueError(f"{num_tokens} tokens cannot hold a {grid[0]}x{grid[1]} grid")
    se_hidden = max(1, hidden // (se_reduction or dim))
    pointwise = 2 * patches * dim * hidden * 2  # 1x1 expand and reduce
    depthwise = 2 * patches * hidden * 3 * 3
    squeeze_excitation = 2 * hidden * se_hidden * 2  # once per image, on the pooled vector
    return pointwise + depthwise + squeeze_excitation
