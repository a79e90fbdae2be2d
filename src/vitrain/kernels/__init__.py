"""Fused CPU kernels for bf16 training: LayerNorm (with the residual sum before it), GELU, linear
layers' bias and weight gradients, the backward of depthwise 3x3 convolutions, the locality FFN's
convolution and h-swish, and on AMX CPUs the attention and the weight gradients on AMX tiles.

The kernels (``cpu.cpp``, ``attention.cpp`` and ``weight_gradient.cpp`` beside this file) are
compiled on first use by torch's JIT extension loader for the host's vector ISA
(``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2 or plain C++) and cached by torch under
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``); building needs a C++ compiler and
ninja (a dependency of the package). If the build fails the native PyTorch ops run instead and a
warning says why once; ``train.cpu_kernels=fused`` makes the failure an error instead.

Where they apply: CPU tensors in bf16 outside autocast, which is what ``precision_mode=o2`` (and
``full``) run (the attention also under autocast: its result is what autocast gives); under autocast,
and for DTensors, under ``torch.compile`` and on other devices, the ops are PyTorch's. Measured on a
2-core AMX Xeon (docs/benchmarks.md, "Fused CPU kernels", "Linear weight gradients and GELU by
table", "Attention on AMX tiles" and "Linear layers on AMX tiles"):

- LayerNorm backward 0.45-0.59 ms against PyTorch's 1.30-1.36 ms for 8320 rows of 192, its weight
  and bias gradients summed in float32 (PyTorch's bf16 kernel: 7-12 % off the largest value); with
  the residual sum before it in the same pass each way (``add_layer_norm``; a ViT chains its blocks'
  last sums into the next norm): ViT-Ti/4 steps 1.03x, gradients bit-identical to the separate ops;
- GELU forward and backward by table (a bf16 input has 65536 values): 0.97 and 1.27 ms against
  PyTorch's 1.72 and 3.31 ms for 8320 x 768 (cold caches), exact to double precision before rounding;
- linear layers (``_Linear``): the bias added inside oneDNN's product (``F.linear`` on bf16 adds it
  in a second pass; ViT-Ti/4 steps 1.06x); weight gradients on AMX tiles from the token-major
  operands, bias sums and an FFN's GELU backward inside (``weight_gradient.cpp``: 1.05-1.42 against
  1.73-2.26 ms alone for ViT-Ti/4's qkv, fc1 and fc2, ViT-Ti/4 steps 1.09x); without AMX, or at widths that are not multiples of 32,
  from a feature-major copy of one operand (oneDNN runs ``g^T x`` on a transposed view at half speed;
  ViT-Ti/4 steps 3 % faster, locality ViT-S 3.7 %);
- depthwise 3x3 backward 7.3 ms against 12.6 ms (32 x 1536 x 14 x 14; 19.8 ms in a locality ViT-S
  step, where the input is a view that skips the CLS rows); with the locality FFN's fc1 and h-swish
  in one function (``_LocalityFront``) it also takes the gradient through the h-swish and writes
  fc1's output gradient in place, so no concatenation is copied either way (step 1.027x);
- attention on AMX tiles (``_Attention``, ``attention.cpp``), per image and head from the fused qkv
  projection, forward and backward: 1.6-2.5x the explicit attention's speed alone, ViT-Ti/4 steps
  1.08x, locality ViT-S/16 1.14x, VOLO-D1 1.11x.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch

from vitrain import cpu_features

log = logging.getLogger("vitrain")

Mode = Literal["auto", "fused", "native"]
SOURCES = [Path(__file__).with_name(name) for name in ("cpu.cpp", "attention.cpp", "weight_gradient.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("common.h", "tiles.h")]

_mode: Mode = "auto"
_module: ModuleType | None = None
_failure: str | None = None
_lock = threading.Lock()


class KernelBuildError(RuntimeError):
    """``train.cpu_kernels=fused`` but the extension could not be built or loaded."""


def _compile_flags(capability: str) -> list[str]:
    flags = ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={capability}"]
    if capability.startswith("AVX512"):  # what ATen's own AVX512 kernels are compiled with
        flags += ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
        flags += ["-mamx-tile", "-mamx-bf16"]  # the attention's AMX path, taken only where the CPU has AMX
    elif capability == "AVX2":
        flags += ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
    return flags


def _build() -> ModuleType:
    # importing cpp_extension warns that no CUDA runtime was found: irrelevant to a CPU extension
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        quiet.setLevel(level)

    missing = [path.name for path in SOURCES + HEADERS if not path.is_file()]
    if missing:  # an install that left them out; the compiler's own message would not say so
        raise FileNotFoundError(
            f"kernel sources missing from {Path(__file__).parent}: {', '.join(missing)}; reinstall vitrain"
        )
    capability = torch.backends.cpu.get_cpu_capability()
    capability = "AVX512" if capability.startswith("AVX512") else capability  # AVX512 / AVX2 / DEFAULT
    return cpp_extension.load(
        name=f"vitrain_cpu_kernels_{capability.lower()}",
        sources=[str(source) for source in SOURCES],
        extra_cflags=_compile_flags(capability),
        extra_ldflags=["-fopenmp"],
        verbose=os.environ.get("VITRAIN_KERNELS_VERBOSE") == "1",
    )


def set_mode(mode: Mode) -> None:
    """``auto``: use the kernels where they apply if they build; ``fused``: build now, fail loudly if
    they cannot; ``native``: PyTorch's ops only (``train.cpu_kernels``)."""
    global _mode
    if mode not in ("auto", "fused", "native"):
        raise ValueError(f"cpu kernels mode must be auto, fused or native, not {mode!r}")
    _mode = mode
    if mode == "fused" and load() is None:
        raise KernelBuildError(
            f"train.cpu_kernels=fused, but the fused CPU kernels could not be built: {_failure}. "
            "Install a C++ compiler (g++) and ninja, or set train.cpu_kernels=auto to fall back to PyTorch's ops."
        )


def load() -> ModuleType | None:
    """The compiled extension (built on the first call), or None when it cannot be built."""
    global _module, _failure
    if _module is not None or _failure is not None:
        return _module
    with _lock:
        if _module is None and _failure is None:
            try:
                _module = _build()
            except Exception as error:  # noqa: BLE001 - any build failure falls back to native ops
                _failure = (
                    f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
                )
                log.warning("fused CPU kernels unavailable, using PyTorch's ops (%s)", _failure)
    return _module


@dataclasses.dataclass(frozen=True)
class Paths:
    """The fused paths this process takes beyond the kernels' portable C++, decided once by
    :func:`paths` from what this CPU and this build of torch support; where one is not taken,
    PyTorch's ops (or the kernels' portable path) run instead."""

    bias_in_product: bool
    """Linear layers add the bias inside oneDNN's bf16 product (``cpu_features.onednn_bf16_linear``)."""
    amx_tiles: bool
    """Attention and weight gradients on AMX tiles: the CPU has AMX-BF16, the kernels were built with
    it, and ``VITRAIN_AMX`` does not forbid it."""


@functools.cache
def paths() -> Paths:
    """:class:`Paths` for this process (the extension is built first if it is not yet)."""
    module = load()
    chosen = Paths(
        bias_in_product=cpu_features.onednn_bf16_linear(),
        amx_tiles=module is not None and cpu_features.amx_allowed() and bool(module.amx_available()),
    )
    if module is not None:
        log.debug(
            "fused CPU kernels: bias inside oneDNN's bf16 product %s, AMX tiles %s",
            "yes" if chosen.bias_in_product else "no (PyTorch's F.linear)",
            "yes" if chosen.amx_tiles else "no (feature-major copies, explicit or SDPA attention)",
        )
    return chosen


def _applies(x: torch.Tensor, *params: torch.Tensor | None, under_autocast: bool = False) -> bool:
    """The fused path: enabled, eager, a plain non-empty bf16 CPU tensor, outside autocast (unless the
    op's result is what autocast would give too: ``under_autocast``)."""
    if _mode == "native" or x.dtype != torch.bfloat16 or x.device.type != "cpu" or type(x) is not torch.Tensor:
        return False
    if x.numel() == 0 or torch.compiler.is_compiling():
        return False
    if torch.is_autocast_enabled("cpu") and not under_autocast:
        return False
    for param in params:  # DTensor parameters (FSDP, TP) take the native ops
        if param is None or param.dtype not in (torch.bfloat16, torch.float32):
            return False
        if type(param) not in (torch.Tensor, torch.nn.Parameter):
            return False
    return load() is not None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        y, mean, rstd, _ = _module.layer_norm_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = _module.layer_norm_backward(grad_out.contiguous(), x, mean, rstd, weight)
        return dx, dweight, dbias, None


class _AddLayerNorm(torch.autograd.Function):
    """``s = x + branch`` and ``LayerNorm(s)`` in one pass each way: a residual connection and the
    pre-norm after it. The backward adds the gradient reaching ``s`` past the norm to the norm's input
    gradient as it writes it, and hands the sum to both inputs. Every value is rounded where the add,
    the norm and autograd's sum of the two gradients round it apart: the same bits, so a chained model
    and one whose blocks run one by one (activation checkpointing, FSDP) train identically."""

    @staticmethod
    def forward(ctx, x, branch, weight, bias, eps: float):  # noqa: ANN001
        y, mean, rstd, s = _module.layer_norm_forward(x.contiguous(), weight, bias, eps, branch.contiguous())
        ctx.save_for_backward(s, weight, mean, rstd)
        return s, y

    @staticmethod
    def backward(ctx, grad_s: torch.Tensor | None, grad_y: torch.Tensor | None):
        s, weight, mean, rstd = ctx.saved_tensors
        if grad_y is None:
            return grad_s, grad_s, None, None, None
        residual = None if grad_s is None else grad_s.contiguous()
        dx, dweight, dbias = _module.layer_norm_backward(grad_y.contiguous(), s, mean, rstd, weight, residual)
        return dx, dx, dweight, dbias, None


def add_layer_norm(
    x: torch.Tensor, branch: torch.Tensor, norm: torch.nn.LayerNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + branch`` and ``norm(s)``: one ``_AddLayerNorm`` where the kernels apply (an affine norm
    over the last dimension, no hooks on it), else the add and the module."""
    if (
        len(norm.normalized_shape) == 1
        and norm.elementwise_affine
        and norm.bias is not None
        and branch.shape == x.shape
        and branch.dtype == x.dtype
        and not (norm._forward_hooks or norm._forward_pre_hooks)
        and _applies(x, branch, norm.weight, norm.bias)
    ):
        return _AddLayerNorm.apply(x, branch, norm.weight, norm.bias, norm.eps)
    s = x + branch
    return s, norm(s)


def layer_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """``F.layer_norm`` over the last dimension, through the fused kernels where they apply."""
    if len(normalized_shape) == 1 and _applies(x, weight, bias):
        return _LayerNorm.apply(x, weight, bias, eps)
    return torch.nn.functional.layer_norm(x, normalized_shape, weight, bias, eps)


class _Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x)
        return _module.gelu_forward(x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        return _module.gelu_backward(grad_out.contiguous(), x, False)[0]


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The exact (erf) GELU, by table where the kernels apply (bf16 CPU tensors; ``cpu.cpp``)."""
    if _applies(x):
        return _Gelu.apply(x)
    return torch.nn.functional.gelu(x)


def _channels_last_within_images(x: torch.Tensor) -> bool:
    _, channels, height, width = x.shape
    return (
        x.stride(1) == 1
        and (width == 1 or x.stride(3) == channels)
        and (height == 1 or x.stride(2) == width * channels)
    )


class _DepthwiseConv3x3(torch.autograd.Function):
    """PyTorch's (oneDNN's) forward; the backward from ``depthwise_conv3x3_backward``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.nn.functional.conv2d(x, weight, bias, padding=1, groups=x.shape[1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        if not _channels_last_within_images(grad_out):  # the batch stride is free (the kernel takes views)
            grad_out = grad_out.contiguous(memory_format=torch.channels_last)
        dx, dweight, dbias, _ = _module.depthwise_conv3x3_backward(
            grad_out, x, weight, ctx.has_bias, ctx.needs_input_grad[0], None, None, False
        )
        return (dx if ctx.needs_input_grad[0] else None), dweight, (dbias if ctx.has_bias else None)


def depthwise_conv3x3(x: torch.Tensor, conv: torch.nn.Conv2d) -> torch.Tensor:
    """``conv(x)`` for a depthwise 3x3 convolution (stride 1, zero padding 1) on a channels-last bf16
    image, its backward through the fused kernel where it applies; any other convolution is ``conv(x)``."""
    channels = x.shape[1] if x.dim() == 4 else -1
    if (
        conv.kernel_size == (3, 3)
        and conv.stride == (1, 1)
        and conv.padding == (1, 1)
        and conv.dilation == (1, 1)
        and conv.padding_mode == "zeros"
        and conv.groups == channels == conv.in_channels == conv.out_channels
        and _channels_last_within_images(x)
        and conv.weight.is_contiguous()
        and conv.weight.dtype == x.dtype
        and _applies(x, conv.weight, *(() if conv.bias is None else (conv.bias,)))
    ):
        return _DepthwiseConv3x3.apply(x, conv.weight, conv.bias)
    return conv(x)


def _expands(weight: torch.Tensor) -> bool:
    """Whether ``_Linear``'s weight gradient copies the layer's input feature-major (a layer that
    expands by at least 2) rather than its output gradient (every other layer)."""
    out_features, in_features = weight.shape
    return out_features >= 2 * in_features


def _tiled_weight_gradient(weight: torch.Tensor) -> bool:
    """Whether ``weight_gradient.cpp`` takes the layer's weight gradient: AMX tiles, both widths
    multiples of 32."""
    out_features, in_features = weight.shape
    return out_features % 32 == 0 and in_features % 32 == 0 and paths().amx_tiles


def _bias_in_product() -> bool:
    return paths().bias_in_product


def _dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``; with a bias, oneDNN's linear primitive with the bias inside it where this CPU and
    this torch have it (``mkldnn._linear_pointwise``, the op inductor emits on CPU; oneDNN has no bf16
    inner product on AVX2-only CPUs, where ``F.linear`` runs): ``F.linear`` on bf16 adds the
    bias as a separate pass over the output, 1.10 against 0.73 ms for 8320 x 192 -> 768 (docs/
    benchmarks.md, "Linear layers on AMX tiles"). It also adds the bias before rounding to bf16."""
    if bias is not None and _bias_in_product():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


class _Linear(torch.autograd.Function):
    """``F.linear``'s forward with the bias inside oneDNN's product (``_dense_linear``), optionally the
    exact GELU after it; a backward whose weight gradient never multiplies a transposed view.

    The weight gradient ``g^T x`` sums over every token; oneDNN's AMX matmul runs it at about half
    speed when an operand is a transposed view (6.8 against 3.5 ms for 6304 tokens, 1536 -> 384).
    Where the CPU has AMX-BF16 and both widths are multiples of 32 it runs on AMX tiles from the
    token-major operands (``weight_gradient.cpp``), which also sums the bias gradient and, after a
    GELU (a ViT FFN's fc1), forms the pre-activation gradient: 1.05-1.42 against 1.73-2.26 ms for
    ViT-Ti/4's qkv, fc1 and fc2 (docs/benchmarks.md, "Linear layers on AMX tiles").

    Elsewhere one operand is copied feature-major (``transpose_rows``, 0.4 ms for 6304 x 384, against
    2.3 for PyTorch's copy). In a layer that expands by at least 2 (qkv, fc1) that is the narrower
    input ``x``: the product is ``xT @ g``, whose small (in, out) result is copied back to the
    weight's layout. In every other layer it is ``g``, and the copy sums the bias gradient on the way:
    the product ``gT @ x`` is in the weight's layout, and oneDNN runs it faster than ``xT @ g`` (1.09
    against 1.53 ms for 8320 tokens, 192 -> 768); a square layer (192 -> 192) took 0.83 ms with
    PyTorch's ``g.t() @ x`` and separate bias sums, 0.67 this way. With the GELU, its backward sums
    the bias gradient as it writes the pre-activation gradient.
    """

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, expands: bool, gelu: bool
    ) -> torch.Tensor:
        out = _dense_linear(x, weight, bias)
        ctx.has_bias, ctx.expands, ctx.gelu = bias is not None, expands, gelu
        if gelu:
            out = out.contiguous()
            ctx.save_for_backward(x, weight, out)
            return _module.gelu_forward(out)
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, *pre_activation = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        rows = x.reshape(-1, x.shape[-1])
        if _tiled_weight_gradient(weight):  # token-major operands, bias sums (and GELU backward) inside
            gelu_input = pre_activation[0].view(g.shape) if ctx.gelu else None
            dweight, sums, g_out = _module.weight_gradient(g, rows.contiguous(), ctx.has_bias, gelu_input=gelu_input)
            g = g_out if ctx.gelu else g
            dbias = sums.to(weight.dtype) if ctx.has_bias else None
            dx = (g @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
            return dx, dweight, dbias, None, None
        dbias = None
        if ctx.gelu:
            g, sums = _module.gelu_backward(g, pre_activation[0].view(g.shape), ctx.has_bias)
            dbias = sums.to(weight.dtype) if ctx.has_bias else None
        dx = (g @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        bias_pending = ctx.has_bias and dbias is None
        if ctx.expands:
            x_t, _ = _module.transpose_rows(rows.contiguous(), False)
            dweight, _ = _module.transpose_rows(x_t @ g, False)
            if bias_pending:
                dbias = _module.column_sums(g).to(weight.dtype)
        else:
            g_t, sums = _module.transpose_rows(g, bias_pending)
            dweight = g_t @ rows
            if bias_pending:
                dbias = sums.to(weight.dtype)
        return dx, dweight, dbias, None, None


def _linear_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and weight.is_contiguous()
        and _applies(x, weight, *(() if bias is None else (bias,)))
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` as ``_Linear`` where the kernels apply: the bias added inside oneDNN's product, the
    weight gradient on AMX tiles or from a feature-major copy of one operand."""
    if _linear_applies(x, weight, bias):
        return _Linear.apply(x, weight, bias, _expands(weight), False)
    return torch.nn.functional.linear(x, weight, bias)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``gelu(F.linear(x, weight, bias))`` as one ``_Linear`` where the kernels apply, else None (the
    caller then runs its own modules, so their hooks, tensor parallelism's among them, still run)."""
    if not _linear_applies(x, weight, bias):
        return None
    return _Linear.apply(x, weight, bias, _expands(weight), True)


class _LocalityFront(torch.autograd.Function):
    """The locality FFN up to its second linear layer: ``u = fc1(x)``, the depthwise 3x3 convolution
    over the patch rows of ``u``, the prefix (CLS) rows passed by, and the h-swish over both, as one
    function: ``h-swish(cat(u[:, :P], conv(u[:, P:])))``.

    Forward: fc1 and the convolution are PyTorch's (oneDNN's); ``cat_hardswish`` writes the
    activation from both sources in one pass (no concatenated copy). Backward: the depthwise kernel
    takes the gradient through the h-swish as it loads it and writes the patch rows of fc1's output
    gradient in place, summing them for fc1's bias gradient; the prefix rows are PyTorch's
    ``hardswish_backward`` (B x P rows). Saves fc1's input, its output and the convolution's output:
    what fc1, the convolution and the h-swish saved apart (the concatenation is not kept)."""

    @staticmethod
    def forward(ctx, x, fc1_weight, fc1_bias, conv_weight, conv_bias, grid, prefix: int):  # noqa: ANN001
        u = _dense_linear(x, fc1_weight, fc1_bias).contiguous()
        batch, _, hidden = u.shape
        image = u[:, prefix:].reshape(batch, grid[0], grid[1], hidden).permute(0, 3, 1, 2)
        conv_out = torch.nn.functional.conv2d(image, conv_weight, conv_bias, padding=1, groups=hidden)
        conv_out = conv_out.contiguous(memory_format=torch.channels_last)
        ctx.save_for_backward(x, fc1_weight, u, conv_out, conv_weight)
        ctx.grid, ctx.prefix = grid, prefix
        ctx.has_fc1_bias, ctx.has_conv_bias = fc1_bias is not None, conv_bias is not None
        return _module.cat_hardswish(u, conv_out, prefix)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, fc1_weight, u, conv_out, conv_weight = ctx.saved_tensors
        prefix, (height, width) = ctx.prefix, ctx.grid
        grad_out = grad_out.contiguous()
        batch, _, hidden = u.shape
        grad_u = torch.empty_like(u)

        def image(tokens: torch.Tensor) -> torch.Tensor:
            return tokens[:, prefix:].reshape(batch, height, width, hidden).permute(0, 3, 1, 2)

        _, dconv_weight, dconv_bias, patch_sums = _module.depthwise_conv3x3_backward(
            image(grad_out), image(u), conv_weight, ctx.has_conv_bias, True, conv_out, image(grad_u), True
        )
        dfc1_bias = patch_sums
        if prefix:
            grad_prefix = torch.ops.aten.hardswish_backward(grad_out[:, :prefix], u[:, :prefix])
            grad_u[:, :prefix] = grad_prefix
            dfc1_bias = dfc1_bias + grad_prefix.float().sum((0, 1))
        g = grad_u.view(-1, hidden)
        rows = x.reshape(-1, x.shape[-1])
        dx = (g @ fc1_weight).view(x.shape) if ctx.needs_input_grad[0] else None
        if _tiled_weight_gradient(fc1_weight):  # as ``_Linear`` does
            dfc1_weight = _module.weight_gradient(g, rows.contiguous(), False)[0]
        else:
            x_t, _ = _module.transpose_rows(rows.contiguous(), False)  # fc1 expands: copy its input
            dfc1_weight, _ = _module.transpose_rows(x_t @ g, False)
        return (
            dx,
            dfc1_weight,
            dfc1_bias.to(fc1_weight.dtype) if ctx.has_fc1_bias else None,
            dconv_weight,
            dconv_bias if ctx.has_conv_bias else None,
            None,
            None,
        )


def locality_front(
    x: torch.Tensor, fc1: torch.nn.Linear, conv: torch.nn.Conv2d, grid: tuple[int, int], prefix: int
) -> torch.Tensor | None:
    """``h-swish(cat(u[:, :prefix], depthwise_conv(u[:, prefix:])))`` with ``u = fc1(x)`` as one
    ``_LocalityFront`` where the kernels apply (bf16 CPU, plain parameters, a depthwise 3x3 convolution
    with stride 1 and zero padding 1, fc1 expanding by at least 2), else None: the caller runs its
    modules (and their hooks) instead."""
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
        or any(p.dtype != x.dtype or not p.is_contiguous() for p in params)
        or not _applies(x, *params)
    ):
        return None
    return _LocalityFront.apply(x, fc1.weight, fc1.bias, conv.weight, conv.bias, grid, prefix)


class _Attention(torch.autograd.Function):
    """softmax(scale q k^T) v per image and head on AMX tiles (``attention.cpp``): from the fused qkv
    projection's output to the token-major result, float32 scores and softmax, no head-major copies.
    The backward recomputes the scores; besides qkv it keeps one float per query and head (the log of
    its softmax denominator), not the probabilities."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
        out, stats = _module.attention_forward(qkv, heads, scale, False)
        ctx.save_for_backward(qkv, stats)
        ctx.heads, ctx.scale = heads, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        qkv, stats = ctx.saved_tensors
        grad = _module.attention_backward(grad_out.contiguous(), qkv, stats, ctx.heads, ctx.scale, False)
        return grad, None, None


MAX_ATTENTION_TOKENS = 2048
"""Beyond this the backward's per-thread scratch (two N x N bf16 matrices) leaves L2 far behind; the
explicit or SDPA attention runs instead."""


def attention(qkv: torch.Tensor, head_dim: int, scale: float) -> torch.Tensor | None:
    """``softmax(scale q k^T) v`` for all heads from the fused ``(B, N, 3 * heads * head_dim)`` qkv to
    ``(B, N, heads * head_dim)``, by the AMX kernel where it applies (bf16 CPU tensors, with or without
    autocast; head_dim a multiple of 32; at most ``MAX_ATTENTION_TOKENS`` tokens; a CPU with AMX-BF16),
    else None. Scores and softmax are float32, so it also meets ``model.attn_softmax_fp32``."""
    if qkv.dim() != 3 or head_dim % 32 or qkv.shape[-1] % (3 * head_dim) or qkv.shape[1] > MAX_ATTENTION_TOKENS:
        return None
    if not _applies(qkv, under_autocast=True) or not paths().amx_tiles:
        return None
    return _Attention.apply(qkv.contiguous(), qkv.shape[-1] // (3 * head_dim), scale)
