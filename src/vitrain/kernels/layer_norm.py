"""LayerNorm over the last dimension with float32 statistics and weight/bias gradient sums, and the
residual sum before a pre-norm fused into it (``add_layer_norm``): ops ``vitrain::layer_norm``,
``vitrain::add_layer_norm`` and their backward ``vitrain::layer_norm_backward`` (``layer_norm.cpp``).

PyTorch's bf16 LayerNorm backward sums the weight and bias gradients in bf16, losing much of their
precision over thousands of rows; these sum them in float32, and the backward is faster too
(docs/benchmarks.md, "Fused CPU kernels").
"""

import torch
from torch import Tensor

from vitrain.kernels import build
from vitrain.kernels.applies import applies


def _stats(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op(
    "vitrain::layer_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor bias, *, float eps) -> (Tensor y, Tensor mean, Tensor rstd)",
)
def layer_norm_op(x: Tensor, weight: Tensor, bias: Tensor, *, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    y, mean, rstd, _ = build.extension().layer_norm_forward(x.contiguous(), weight, bias, eps, None)
    return y, mean, rstd


@layer_norm_op.register_fake
def _(x, weight, bias, *, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), _stats(x), _stats(x)


@torch.library.custom_op(
    "vitrain::add_layer_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor branch, Tensor weight, Tensor bias, *, float eps) "
    "-> (Tensor sum, Tensor y, Tensor mean, Tensor rstd)",
)
def add_layer_norm_op(
    x: Tensor, branch: Tensor, weight: Tensor, bias: Tensor, *, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    y, mean, rstd, s = build.extension().layer_norm_forward(x.contiguous(), weight, bias, eps, branch.contiguous())
    return s, y, mean, rstd


@add_layer_norm_op.register_fake
def _(x, branch, weight, bias, *, eps):
    plain = torch.empty_like(x, memory_format=torch.contiguous_format)
    return plain, torch.empty_like(plain), _stats(x), _stats(x)


@torch.library.custom_op(
    "vitrain::layer_norm_backward",
    mutates_args=(),
    schema="(Tensor grad_y, Tensor x, Tensor mean, Tensor rstd, Tensor weight, Tensor? residual) "
    "-> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)",
)
def layer_norm_backward_op(
    grad_y: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, residual: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``residual``: a gradient reaching the norm's input past it (the residual stream), added to the
    input gradient as it is written."""
    residual = None if residual is None else residual.contiguous()
    dx, dweight, dbias = build.extension().layer_norm_backward(grad_y.contiguous(), x, mean, rstd, weight, residual)
    return dx, dweight, dbias


@layer_norm_backward_op.register_fake
def _(grad_y, x, mean, rstd, weight, residual):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(weight),
        torch.empty_like(weight),
    )


def _setup_layer_norm(ctx, inputs, keyword_only_inputs, output) -> None:
    x, weight, _ = inputs
    _, mean, rstd = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x.contiguous(), weight, mean, rstd)


def _layer_norm_backward(ctx, grad_y, grad_mean, grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = layer_norm_backward_op(grad_y, x, mean, rstd, weight, None)
    return dx, dweight, dbias


layer_norm_op.register_autograd(_layer_norm_backward, setup_context=_setup_layer_norm)


def _setup_add_layer_norm(ctx, inputs, keyword_only_inputs, output) -> None:
    s, _, mean, rstd = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(s, inputs[2], mean, rstd)


def _add_layer_norm_backward(ctx, grad_s, grad_y, grad_mean, grad_rstd):
    """Both inputs get the sum of the gradient at ``s`` past the norm and through it: every value rounded
    where the add, the norm and autograd's sum of the two gradients round it apart, so a chained model
    and one whose blocks run one by one train identically."""
    s, weight, mean, rstd = ctx.saved_tensors
    if grad_y is None:
        return grad_s, grad_s, None, None
    dx, dweight, dbias = layer_norm_backward_op(grad_y, s, mean, rstd, weight, grad_s)
    return dx, dx, dweight, dbias


add_layer_norm_op.register_autograd(_add_layer_norm_backward, setup_context=_setup_add_layer_norm)


def layer_norm(
    x: Tensor, normalized_shape: tuple[int, ...], weight: Tensor | None, bias: Tensor | None, eps: float
) -> Tensor:
    """``F.layer_norm``, through ``vitrain::layer_norm`` where the kernels apply (bf16 CPU input, an
    affine norm over the last dimension)."""
    if len(normalized_shape) == 1 and applies(x, weight, bias):
        return layer_norm_op(x, weight, bias, eps=eps)[0]
    return torch.nn.functional.layer_norm(x, normalized_shape, weight, bias, eps)


def add_layer_norm(x: Tensor, branch: Tensor, norm: torch.nn.LayerNorm) -> tuple[Tensor, Tensor]:
    """``s = x + branch`` and ``norm(s)``: a residual connection and the pre-norm after it, in one pass
    each way where the kernels apply (an affine norm over the last dimension, nothing hooked on it);
    else the add and the module."""
    if (
        len(norm.normalized_shape) == 1
        and norm.elementwise_affine
        and norm.bias is not None
        and branch.shape == x.shape
        and branch.dtype == x.dtype
        and not (norm._forward_hooks or norm._forward_pre_hooks)
        and applies(x, branch, norm.weight, norm.bias)
    ):
        s, y, _, _ = add_layer_norm_op(x, branch, norm.weight, norm.bias, eps=norm.eps)
        return s, y
    s = x + branch
    return s, norm(s)
