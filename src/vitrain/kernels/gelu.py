"""The exact (erf) GELU of bf16 values by table (a bf16 input has 65536 values): ``vitrain::gelu`` and
``vitrain::gelu_backward`` (``gelu.cpp``), exact to double precision before rounding; a lookup in place of
PyTorch's arithmetic, so faster both ways (docs/benchmarks.md, "Linear weight gradients and GELU by table")."""

import torch
from torch import Tensor

from vitrain.kernels import build
from vitrain.kernels.applies import applies


@torch.library.custom_op("vitrain::gelu", mutates_args=(), schema="(Tensor x) -> Tensor y")
def gelu_op(x: Tensor) -> Tensor:
    return build.extension().gelu_forward(x.contiguous())


@gelu_op.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op(
    "vitrain::gelu_backward",
    mutates_args=(),
    schema="(Tensor grad_y, Tensor x, *, bool column_sums) -> (Tensor grad_x, Tensor sums)",
)
def gelu_backward_op(grad_y: Tensor, x: Tensor, *, column_sums: bool) -> tuple[Tensor, Tensor]:
    """The input gradient and, with ``column_sums``, its float32 sums over all rows (the bias gradient of
    the linear layer before the GELU); else ``sums`` is empty."""
    grad, sums = build.extension().gelu_backward(grad_y.contiguous(), x.contiguous(), column_sums)
    return grad, sums if column_sums else grad.new_empty(0, dtype=torch.float32)


@gelu_backward_op.register_fake
def _(grad_y, x, *, column_sums):
    sums = x.new_empty(x.shape[-1] if column_sums else 0, dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), sums


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0].contiguous())


def _backward(ctx, grad_y):
    (x,) = ctx.saved_tensors
    return gelu_backward_op(grad_y, x, column_sums=False)[0]


gelu_op.register_autograd(_backward, setup_context=_setup)


def gelu(x: Tensor) -> Tensor:
    """The exact (erf) GELU, through ``vitrain::gelu`` where the kernels apply (bf16 CPU tensors)."""
    if applies(x):
        return gelu_op(x)
    return torch.nn.functional.gelu(x)
