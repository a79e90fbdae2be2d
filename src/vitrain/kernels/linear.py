"""Linear layers in bf16 (``vitrain::linear``, ``vitrain::linear_gelu``, ``vitrain::linear_backward``):
the bias added inside oneDNN's product, optionally the exact GELU after it, and a backward whose weight
gradient never multiplies a transposed view.

Forward: oneDNN's linear primitive with the bias inside it where this CPU and this torch have it
(``mkldnn._linear_pointwise``, the op inductor emits on CPU; oneDNN has no bf16 inner product on
AVX2-only CPUs, where ``F.linear`` runs): ``F.linear`` on bf16 adds the bias in a second pass over the
output, and adds it after rounding to bf16.

Backward: the weight gradient ``g^T x`` sums over every token; oneDNN's AMX matmul runs it slower when an
operand is a transposed view. Where the CPU has AMX-BF16 and both widths are multiples of 32 it runs on AMX
tiles from the token-major operands (``weight_gradient.cpp``), which also sums the bias gradient and, after
a GELU (a ViT FFN's fc1), forms the pre-activation gradient. Elsewhere one operand is copied feature-major
(``transpose_rows``, faster than PyTorch's copy). In a layer that expands by at least 2 (qkv, fc1) that is
the narrower input ``x``: the product is ``xT @ g``, whose small (in, out) result is copied back to the
weight's layout. In every other layer it is ``g``, and the copy sums the bias gradient on the way:
``gT @ x`` is in the weight's layout, and oneDNN runs it faster than ``xT @ g``. With the GELU, its backward
sums the bias gradient as it writes the pre-activation gradient. Timings: docs/benchmarks.md, "Linear weight
gradients and GELU by table" and "Linear layers on AMX tiles".
"""

import torch
from torch import Tensor

from vitrain.kernels import build
from vitrain.kernels.applies import applies


def expands(weight: Tensor) -> bool:
    """Whether the weight gradient copies the layer's input feature-major (a layer that expands by at
    least 2) rather than its output gradient (every other layer)."""
    out_features, in_features = weight.shape
    return out_features >= 2 * in_features


def tiled_weight_gradient(weight: Tensor) -> bool:
    """Whether ``weight_gradient.cpp`` takes the layer's weight gradient: AMX tiles, both widths
    multiples of 32."""
    out_features, in_features = weight.shape
    return out_features % 32 == 0 and in_features % 32 == 0 and build.paths().amx_tiles


def dense_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear``; with a bias, oneDNN's linear primitive with the bias inside it where available."""
    if bias is not None and build.paths().bias_in_product:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


def _out(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(
    "vitrain::linear", mutates_args=(), schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor y"
)
def linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return dense_linear(x, weight, bias).contiguous()


@linear_op.register_fake
def _(x, weight, bias):
    return _out(x, weight)


@torch.library.custom_op(
    "vitrain::linear_gelu",
    mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor? bias) -> (Tensor y, Tensor pre_activation)",
)
def linear_gelu_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    pre_activation = dense_linear(x, weight, bias).contiguous()
    return build.extension().gelu_forward(pre_activation), pre_activation


@linear_gelu_op.register_fake
def _(x, weight, bias):
    return _out(x, weight), _out(x, weight)


def copied_weight_gradient(g: Tensor, rows: Tensor, weight: Tensor, bias_pending: bool) -> tuple[Tensor, Tensor | None]:
    """``g^T rows`` from a feature-major copy of one operand, and the float32 bias gradient sums where
    they are still to be taken (else None)."""
    module = build.extension()
    if expands(weight):
        x_t, _ = module.transpose_rows(rows.contiguous(), False)
        dweight, _ = module.transpose_rows(x_t @ g, False)
        return dweight, module.column_sums(g) if bias_pending else None
    g_t, sums = module.transpose_rows(g, bias_pending)
    return g_t @ rows, sums if bias_pending else None


@torch.library.custom_op(
    "vitrain::linear_backward",
    mutates_args=(),
    schema="(Tensor grad_y, Tensor x, Tensor weight, Tensor? pre_activation, *, bool has_bias, bool input_grad) "
    "-> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)",
)
def linear_backward_op(
    grad_y: Tensor, x: Tensor, weight: Tensor, pre_activation: Tensor | None, *, has_bias: bool, input_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``linear`` (``pre_activation`` None) or of ``linear_gelu``; ``grad_x`` is empty
    unless ``input_grad``, ``grad_bias`` empty unless ``has_bias``."""
    module = build.extension()
    g = grad_y.reshape(-1, grad_y.shape[-1]).contiguous()
    rows = x.reshape(-1, x.shape[-1])
    gelu_input = None if pre_activation is None else pre_activation.view(g.shape)
    if tiled_weight_gradient(weight):  # token-major operands, bias sums (and GELU backward) inside
        dweight, sums, g_out = module.weight_gradient(g, rows.contiguous(), has_bias, gelu_input=gelu_input)
        g = g if gelu_input is None else g_out
    else:
        sums = None
        if gelu_input is not None:  # the GELU's backward sums the bias gradient as it writes g
            g, sums = module.gelu_backward(g, gelu_input, has_bias)
        dweight, pending_sums = copied_weight_gradient(g, rows, weight, has_bias and sums is None)
        sums = sums if pending_sums is None else pending_sums
    dbias = sums.to(weight.dtype) if has_bias else weight.new_empty(0)
    dx = (g @ weight).view(x.shape) if input_grad else x.new_empty(0)
    return dx, dweight, dbias


@linear_backward_op.register_fake
def _(grad_y, x, weight, pre_activation, *, has_bias, input_grad):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if input_grad else x.new_empty(0)
    return dx, torch.empty_like(weight), weight.new_empty(weight.shape[0] if has_bias else 0)


def _setup(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.has_bias = bias is not None
    ctx.set_materialize_grads(False)
    pre_activation = output[1] if isinstance(output, tuple) else None
    ctx.save_for_backward(x, weight, pre_activation)


def _backward(ctx, grad_y, *unused):
    x, weight, pre_activation = ctx.saved_tensors
    input_grad = ctx.needs_input_grad[0]
    dx, dweight, dbias = linear_backward_op(
        grad_y, x, weight, pre_activation, has_bias=ctx.has_bias, input_grad=input_grad
    )
    return (dx if input_grad else None), dweight, (dbias if ctx.has_bias else None)


linear_op.register_autograd(_backward, setup_context=_setup)
linear_gelu_op.register_autograd(_backward, setup_context=_setup)


def _linear_applies(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    return (
        weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and weight.is_contiguous()
        and applies(x, weight, *(() if bias is None else (bias,)))
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear``, through ``vitrain::linear`` where the kernels apply."""
    if _linear_applies(x, weight, bias):
        return linear_op(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """``gelu(F.linear(x, weight, bias))`` as one ``vitrain::linear_gelu`` where the kernels apply, else
    None (the caller then runs its own modules)."""
    if not _linear_applies(x, weight, bias):
        return None
    return linear_gelu_op(x, weight, bias)[0]
