"""The model converter: swap a model's modules for ones that run the fused ops, in place (the pattern
of torchao's ``quantize_`` and torchtitan's float8 converter). The models themselves stay plain.

Each fused module is a subclass of the module it replaces that overrides only ``forward``: parameters,
buffers, state-dict keys, hooks and ``isinstance`` checks are unchanged, so activation checkpointing,
FSDP, DDP and ``torch.compile`` (which traces through the registered ops) apply to a converted model as
to a plain one. Each fused forward falls back to the plain module's where its op does not apply (not
bf16, on another device, under autocast, DTensor parameters of tensor parallelism).

What is swapped: every ``nn.LayerNorm`` and exact ``nn.GELU``; the linear layers of attention and FFN
modules (not classifier heads); the depthwise convolutions of the locality FFNs; the ViT FFN as
linear + GELU in one op; the locality FFN's front as one op; the explicit attention core for the AMX
kernel; and a ViT's block stack for one that chains each block's last residual sum into the next
block's first norm (``add_layer_norm``), which owns that fusion across block boundaries.
"""

from __future__ import annotations

import torch
from torch import nn

from vitrain.kernels.attention import attention
from vitrain.kernels.depthwise import depthwise_conv3x3, locality_front
from vitrain.kernels.gelu import gelu
from vitrain.kernels.layer_norm import add_layer_norm, layer_norm
from vitrain.kernels.linear import linear, linear_gelu
from vitrain.models.layers import Attention, Block, Blocks, Grid, LocalityMlp, MatmulAttentionCore, Mlp
from vitrain.models.localvit import LocalViTMlp
from vitrain.models.volo import ClassAttention, OutlookAttention


class FusedLayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class FusedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class FusedGELU(nn.GELU):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu(x) if self.approximate == "none" else super().forward(x)


class FusedDepthwiseConv2d(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return depthwise_conv3x3(x, self)


class FusedMlp(Mlp):
    """fc1 and the exact GELU as one op (its backward sums fc1's bias gradient as it goes)."""

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        hidden = None
        if (
            isinstance(self.act, nn.GELU)
            and self.act.approximate == "none"
            and not (self.fc1._forward_hooks or self.fc1._forward_pre_hooks)
        ):
            hidden = linear_gelu(x, self.fc1.weight, self.fc1.bias)
        if hidden is None:
            return super().forward(x, grid)
        return self.drop2(self.fc2(self.drop1(hidden)))


class FusedLocalityMlp(LocalityMlp):
    """fc1, the depthwise convolution over the patch rows and the h-swish as one op."""

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        front = locality_front(x, self.fc1, self.conv, grid, self.num_prefix_tokens)
        if front is None:
            return super().forward(x, grid)
        return self.drop2(self.fc2(self.drop1(front)))


class FusedLocalViTMlp(LocalViTMlp):
    @staticmethod
    def pointwise(tokens: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
        return linear(tokens, conv.weight.flatten(1), conv.bias)


class FusedMatmulAttention(MatmulAttentionCore):
    """The AMX attention kernel (float32 scores and softmax) where it applies, else the explicit one."""

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.dropout):
            fused = attention(qkv, self.head_dim, self.scale)
            if fused is not None:
                return fused
        return super().forward(qkv)


def _chains(block: nn.Module) -> bool:
    """Whether the stack may run ``block`` piece by piece: a plain block, not compiled on its own, nothing
    hooked on it (FSDP and activation checkpointing act through its forward hooks)."""
    hooked = block._forward_hooks or block._forward_pre_hooks
    return type(block) is Block and getattr(block, "_compiled_call_impl", None) is None and not hooked


def _chained_block(
    block: Block, x: torch.Tensor, branch: torch.Tensor | None, grid: Grid
) -> tuple[torch.Tensor, torch.Tensor]:
    """``block`` with the residual sums at both ends left open: takes the previous block's pending
    ``(x, branch)`` (``branch`` None: ``x`` is complete) and returns its own."""
    if branch is None:
        normed = block.norm1(x)
    else:
        x, normed = add_layer_norm(x, branch, block.norm1)
    x, normed = add_layer_norm(x, block.drop_path1(block.ls1(block.attn(normed))), block.norm2)
    return x, block.drop_path2(block.ls2(block.mlp(normed, grid)))


class ChainedBlocks(Blocks):
    """The block stack with each residual sum and the norm after it as one pass (``add_layer_norm``),
    across block boundaries; a block that must run as a module (hooked or compiled) runs as one, and
    the chain resumes after it. Bit for bit the blocks called one by one."""

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        branch = None  # a residual branch not yet added to x
        for block in self:
            if _chains(block):
                x, branch = _chained_block(block, x, branch, grid)
                continue
            if branch is not None:
                x, branch = x + branch, None
            x = block(x, grid)
        return x if branch is None else x + branch


_SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    nn.LayerNorm: FusedLayerNorm,
    nn.GELU: FusedGELU,
    Mlp: FusedMlp,
    LocalityMlp: FusedLocalityMlp,
    LocalViTMlp: FusedLocalViTMlp,
    MatmulAttentionCore: FusedMatmulAttention,
    Blocks: ChainedBlocks,
}
LINEAR_OWNERS = (Attention, Mlp, LocalityMlp, OutlookAttention, ClassAttention)
"""Modules whose linear layers run ``vitrain::linear`` (classifier heads and SE gates keep ``F.linear``)."""
_DEPTHWISE_OWNERS = {LocalityMlp: "conv", LocalViTMlp: "depthwise"}


def _swap(module: nn.Module, fused: type[nn.Module]) -> None:
    module.__class__ = fused  # a subclass that only overrides forward: same state, same hooks


def owned_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the plain linear layers of attention and FFN modules (:data:`LINEAR_OWNERS`): the ones
    the fused kernels and FP8 swap (classifier heads, patch embeddings and SE gates are not among them)."""
    owned = {
        id(child) for module in model.modules() if isinstance(module, LINEAR_OWNERS) for child in module.children()
    }
    return [
        (name, module) for name, module in model.named_modules() if type(module) is nn.Linear and id(module) in owned
    ]


def convert(model: nn.Module) -> int:
    """Swap ``model``'s modules for the fused ones, in place; returns how many were swapped. Call it on
    the plain model, before parallelism and the optimizer (it keeps the parameter objects, so either order
    works). Where the extension is not loaded the fused modules run the plain forward."""
    linears = owned_linears(model)
    for _, linear_module in linears:
        _swap(linear_module, FusedLinear)
    swapped = len(linears)
    for module in list(model.modules()):
        owner = type(module)
        attribute = _DEPTHWISE_OWNERS.get(owner)
        if attribute is not None and type(getattr(module, attribute)) is nn.Conv2d:
            _swap(getattr(module, attribute), FusedDepthwiseConv2d)
            swapped += 1
        if owner in _SWAPS:
            _swap(module, _SWAPS[owner])
            swapped += 1
    return swapped
