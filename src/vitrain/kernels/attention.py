"""``softmax(scale q k^T) v`` per image and head on AMX tiles (``attention.cpp``): from the fused qkv
projection's output to the token-major result, float32 scores and softmax, no head-major copies; ops
``vitrain::attention`` and ``vitrain::attention_backward``. The backward recomputes the scores; besides
qkv it keeps one float per query and head (the log of its softmax denominator), not the probabilities.
Faster than the explicit attention, forward and backward (docs/benchmarks.md, "Attention on AMX tiles").
"""

import torch
from torch import Tensor

from vitrain.kernels import build
from vitrain.kernels.applies import applies

MAX_ATTENTION_TOKENS = 2048
"""Beyond this the backward's per-thread scratch (two N x N bf16 matrices) leaves L2 far behind; the
model's own attention runs instead."""


@torch.library.custom_op(
    "vitrain::attention",
    mutates_args=(),
    schema="(Tensor qkv, *, int heads, float scale) -> (Tensor out, Tensor stats)",
)
def attention_op(qkv: Tensor, *, heads: int, scale: float) -> tuple[Tensor, Tensor]:
    out, stats = build.extension().attention_forward(qkv.contiguous(), heads, scale, False)
    return out, stats


@attention_op.register_fake
def _(qkv, *, heads, scale):
    batch, tokens, width = qkv.shape
    out = qkv.new_empty((batch, tokens, width // 3))
    return out, qkv.new_empty((batch, heads, tokens), dtype=torch.float32)


@torch.library.custom_op(
    "vitrain::attention_backward",
    mutates_args=(),
    schema="(Tensor grad_out, Tensor qkv, Tensor stats, *, int heads, float scale) -> Tensor grad_qkv",
)
def attention_backward_op(grad_out: Tensor, qkv: Tensor, stats: Tensor, *, heads: int, scale: float) -> Tensor:
    return build.extension().attention_backward(grad_out.contiguous(), qkv, stats, heads, scale, False)


@attention_backward_op.register_fake
def _(grad_out, qkv, stats, *, heads, scale):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, keyword_only_inputs, output) -> None:
    ctx.heads, ctx.scale = keyword_only_inputs["heads"], keyword_only_inputs["scale"]
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(inputs[0].contiguous(), output[1])


def _backward(ctx, grad_out, grad_stats):
    qkv, stats = ctx.saved_tensors
    return attention_backward_op(grad_out, qkv, stats, heads=ctx.heads, scale=ctx.scale)


attention_op.register_autograd(_backward, setup_context=_setup)


def attention(qkv: Tensor, head_dim: int, scale: float) -> Tensor | None:
    """``softmax(scale q k^T) v`` for all heads from the fused ``(B, N, 3 * heads * head_dim)`` qkv to
    ``(B, N, heads * head_dim)``, by ``vitrain::attention`` where it applies (bf16 CPU tensors, with or
    without autocast; head_dim a multiple of 32; at most ``MAX_ATTENTION_TOKENS`` tokens; a CPU with
    AMX-BF16), else None. Scores and softmax are float32, so it also meets ``model.attn_softmax_fp32``."""
    if qkv.dim() != 3 or head_dim % 32 or qkv.shape[-1] % (3 * head_dim) or qkv.shape[1] > MAX_ATTENTION_TOKENS:
        return None
    if not applies(qkv, under_autocast=True) or not build.paths().amx_tiles:
        return None
    return attention_op(qkv, heads=qkv.shape[-1] // (3 * head_dim), scale=scale)[0]
