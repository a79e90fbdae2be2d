"""Depthwise 3x3 convolutions (stride 1, zero padding 1) on channels-last bf16 images, and the locality
FFN's front (fc1, the depthwise convolution over the patch rows, h-swish) as one op:
``vitrain::depthwise_conv3x3``, ``vitrain::locality_front`` and their backward ops (``depthwise.cpp``).

The forward convolution is PyTorch's (oneDNN's); the backward is the fused kernel, which also takes the
input as the view that skips the CLS rows, where PyTorch's is slowest. The locality front also takes the
gradient through the h-swish and writes fc1's output gradient in place, so no concatenation is copied
either way. Timings: docs/benchmarks.md, "Fused CPU kernels".
"""

import torch
from torch import Tensor

from vitrain.kernels import build
from vitrain.kernels.applies import applies
from vitrain.kernels.linear import copied_weight_gradient, dense_linear, tiled_weight_gradient


def channels_last_within_images(x: Tensor) -> bool:
    _, channels, height, width = x.shape
    return (
        x.stride(1) == 1
        and (width == 1 or x.stride(3) == channels)
        and (height == 1 or x.stride(2) == width * channels)
    )


def _image_like(x: Tensor) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last)


@torch.library.custom_op(
    "vitrain::depthwise_conv3x3", mutates_args=(), schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor y"
)
def depthwise_conv3x3_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    out = torch.nn.functional.conv2d(x, weight, bias, padding=1, groups=x.shape[1])
    return out.contiguous(memory_format=torch.channels_last)


@depthwise_conv3x3_op.register_fake
def _(x, weight, bias):
    return _image_like(x)


@torch.library.custom_op(
    "vitrain::depthwise_conv3x3_backward",
    mutates_args=(),
    schema="(Tensor grad_y, Tensor x, Tensor weight, *, bool has_bias, bool input_grad) "
    "-> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)",
)
def depthwise_conv3x3_backward_op(
    grad_y: Tensor, x: Tensor, weight: Tensor, *, has_bias: bool, input_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    if not channels_last_within_images(grad_y):  # the batch stride is free (the kernel takes views)
        grad_y = grad_y.contiguous(memory_format=torch.channels_last)
    dx, dweight, dbias, _ = build.extension().depthwise_conv3x3_backward(
        grad_y, x, weight, has_bias, input_grad, None, None, False
    )
    return (
        dx if input_grad else x.new_empty(0),
        dweight,
        dbias if has_bias else weight.new_empty(0),
    )


@depthwise_conv3x3_backward_op.register_fake
def _(grad_y, x, weight, *, has_bias, input_grad):
    dx = _image_like(x) if input_grad else x.new_empty(0)
    return dx, torch.empty_like(weight), weight.new_empty(weight.shape[0] if has_bias else 0)


def _setup_depthwise(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight)


def _depthwise_backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    input_grad = ctx.needs_input_grad[0]
    dx, dweight, dbias = depthwise_conv3x3_backward_op(grad_y, x, weight, has_bias=ctx.has_bias, input_grad=input_grad)
    return (dx if input_grad else None), dweight, (dbias if ctx.has_bias else None)


depthwise_conv3x3_op.register_autograd(_depthwise_backward, setup_context=_setup_depthwise)


def depthwise_conv3x3(x: Tensor, conv: torch.nn.Conv2d) -> Tensor:
    """``conv(x)`` for a depthwise 3x3 convolution (stride 1, zero padding 1) on a channels-last bf16
    image, through ``vitrain::depthwise_conv3x3`` where it applies; any other convolution is the module's
    own (``nn.Conv2d.forward``)."""
    channels = x.shape[1] if x.dim() == 4 else -1
    if (
        conv.kernel_size == (3, 3)
        and conv.stride == (1, 1)
        and conv.padding == (1, 1)
        and conv.dilation == (1, 1)
        and conv.padding_mode == "zeros"
        and conv.groups == channels == conv.in_channels == conv.out_channels
        and channels_last_within_images(x)
        and conv.weight.is_contiguous()
        and conv.weight.dtype == x.dtype
        and applies(x, conv.weight, *(() if conv.bias is None else (conv.bias,)))
    ):
        return depthwise_conv3x3_op(x, conv.weight, conv.bias)
    return torch.nn.Conv2d.forward(conv, x)


# --- the locality FFN's front ---------------------------------------------------------------------


def _patch_image(tokens: Tensor, prefix: int, height: int, width: int) -> Tensor:
    batch, _, hidden = tokens.shape
    return tokens[:, prefix:].reshape(batch, height, width, hidden).permute(0, 3, 1, 2)


@torch.library.custom_op(
    "vitrain::locality_front",
    mutates_args=(),
    schema="(Tensor x, Tensor fc1_weight, Tensor? fc1_bias, Tensor conv_weight, Tensor? conv_bias, *, "
    "int prefix, int height, int width) -> (Tensor y, Tensor fc1_out, Tensor conv_out)",
)
def locality_front_op(
    x: Tensor,
    fc1_weight: Tensor,
    fc1_bias: Tensor | None,
    conv_weight: Tensor,
    conv_bias: Tensor | None,
    *,
    prefix: int,
    height: int,
    width: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``h-swish(cat(u[:, :prefix], depthwise_conv(u[:, prefix:])))`` with ``u = fc1(x)``: fc1 and the
    convolution are PyTorch's (oneDNN's); ``cat_hardswish`` writes the activation from both sources in
    one pass (no concatenated copy). Also returns ``u`` and the convolution's output, for the backward."""
    u = dense_linear(x, fc1_weight, fc1_bias).contiguous()
    image = _patch_image(u, prefix, height, width)
    conv_out = torch.nn.functional.conv2d(image, conv_weight, conv_bias, padding=1, groups=u.shape[-1])
    conv_out = conv_out.contiguous(memory_format=torch.channels_last)
    return build.extension().cat_hardswish(u, conv_out, prefix), u, conv_out


@locality_front_op.register_fake
def _(x, fc1_weight, fc1_bias, conv_weight, conv_bias, *, prefix, height, width):
    u = x.new_empty((*x.shape[:-1], fc1_weight.shape[0]))
    conv_out = torch.empty(
        (x.shape[0], fc1_weight.shape[0], height, width), dtype=x.dtype, memory_format=torch.channels_last
    )
    return torch.empty_like(u), u, conv_out


@torch.library.custom_op(
    "vitrain::locality_front_backward",
    mutates_args=(),
    schema="(Tensor grad_y, Tensor x, Tensor fc1_weight, Tensor fc1_out, Tensor conv_out, Tensor conv_weight, *, "
    "int prefix, bool has_fc1_bias, bool has_conv_bias, bool input_grad) -> (Tensor grad_x, "
    "Tensor grad_fc1_weight, Tensor grad_fc1_bias, Tensor grad_conv_weight, Tensor grad_conv_bias)",
)
def locality_front_backward_op(
    grad_y: Tensor,
    x: Tensor,
    fc1_weight: Tensor,
    fc1_out: Tensor,
    conv_out: Tensor,
    conv_weight: Tensor,
    *,
    prefix: int,
    has_fc1_bias: bool,
    has_conv_bias: bool,
    input_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The depthwise kernel takes the gradient through the h-swish as it loads it and writes the patch
    rows of fc1's output gradient in place, summing them for fc1's bias gradient; the prefix rows are
    PyTorch's ``hardswish_backward`` (B x P rows)."""
    u, module = fc1_out, build.extension()
    height, width = conv_out.shape[-2:]
    grad_y = grad_y.contiguous()
    grad_u = torch.empty_like(u)
    _, dconv_weight, dconv_bias, dfc1_bias = module.depthwise_conv3x3_backward(
        *(_patch_image(t, prefix, height, width) for t in (grad_y, u)),
        conv_weight,
        has_conv_bias,
        True,
        conv_out,
        _patch_image(grad_u, prefix, height, width),
        True,
    )
    if prefix:
        grad_prefix = torch.ops.aten.hardswish_backward(grad_y[:, :prefix], u[:, :prefix])
        grad_u[:, :prefix] = grad_prefix
        dfc1_bias = dfc1_bias + grad_prefix.float().sum((0, 1))
    g, rows = grad_u.view(-1, u.shape[-1]), x.reshape(-1, x.shape[-1])
    dx = (g @ fc1_weight).view(x.shape) if input_grad else x.new_empty(0)
    if tiled_weight_gradient(fc1_weight):  # as the linear layers do
        dfc1_weight = module.weight_gradient(g, rows.contiguous(), False)[0]
    else:
        dfc1_weight, _ = copied_weight_gradient(g, rows, fc1_weight, False)
    return (
        dx,
        dfc1_weight,
        dfc1_bias.to(fc1_weight.dtype) if has_fc1_bias else fc1_weight.new_empty(0),
        dconv_weight,
        dconv_bias if has_conv_bias else conv_weight.new_empty(0),
    )


@locality_front_backward_op.register_fake
def _(grad_y, x, fc1_weight, fc1_out, conv_out, conv_weight, *, prefix, has_fc1_bias, has_conv_bias, input_grad):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if input_grad else x.new_empty(0)
    hidden = fc1_weight.shape[0]
    return (
        dx,
        torch.empty_like(fc1_weight),
        fc1_weight.new_empty(hidden if has_fc1_bias else 0),
        torch.empty_like(conv_weight),
        conv_weight.new_empty(hidden if has_conv_bias else 0),
    )


def _setup_front(ctx, inputs, keyword_only_inputs, output) -> None:
    x, fc1_weight, fc1_bias, conv_weight, conv_bias = inputs
    _, u, conv_out = output
    ctx.prefix = keyword_only_inputs["prefix"]
    ctx.has_fc1_bias, ctx.has_conv_bias = fc1_bias is not None, conv_bias is not None
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, fc1_weight, u, conv_out, conv_weight)


def _front_backward(ctx, grad_y, *unused):
    x, fc1_weight, u, conv_out, conv_weight = ctx.saved_tensors
    input_grad = ctx.needs_input_grad[0]
    dx, dfc1_weight, dfc1_bias, dconv_weight, dconv_bias = locality_front_backward_op(
        grad_y,
        x,
        fc1_weight,
        u,
        conv_out,
        conv_weight,
        prefix=ctx.prefix,
        has_fc1_bias=ctx.has_fc1_bias,
        has_conv_bias=ctx.has_conv_bias,
        input_grad=input_grad,
    )
    return (
        dx if input_grad else None,
        dfc1_weight,
        dfc1_bias if ctx.has_fc1_bias else None,
        dconv_weight,
        dconv_bias if ctx.has_conv_bias else None,
    )


locality_front_op.register_autograd(_front_backward, setup_context=_setup_front)


def locality_front(
    x: Tensor, fc1: torch.nn.Linear, conv: torch.nn.Conv2d, grid: tuple[int, int], prefix: int
) -> Tensor | None:
    """``h-swish(cat(u[:, :prefix], depthwise_conv(u[:, prefix:])))`` with ``u = fc1(x)`` as one
    ``vitrain::locality_front`` where the kernels apply (bf16 CPU, plain parameters, a depthwise 3x3
    convolution with stride 1 and zero padding 1, fc1 expanding by at least 2, nothing hooked on either
    module), else None: the caller runs its modules instead."""
    hidden = fc1.out_features
    params = [fc1.weight, conv.weight, *(p for p in (fc1.bias, conv.bias) if p is not None)]
    if (
        x.dim() != 3
        or x.shape[1] != prefix + grid[0] * grid[1]
        or hidden < 2 * fc1.in_features
        or conv.kernel_size != (3, 3)
        or conv.stride != (1, 1)
        or conv.padding != (1, 1)
        or conv.dilation != (1, 1)
        or conv.padding_mode != "zeros"
        or not conv.groups == conv.in_channels == conv.out_channels == hidden
        or any(module._forward_hooks or module._forward_pre_hooks for module in (fc1, conv))
        or any(p.dtype != x.dtype or not p.is_contiguous() for p in params)
        or not applies(x, *params)
    ):
        return None
    return locality_front_op(
        x, fc1.weight, fc1.bias, conv.weight, conv.bias, prefix=prefix, height=grid[0], width=grid[1]
    )[0]
