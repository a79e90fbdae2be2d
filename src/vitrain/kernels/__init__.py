"""Fused CPU kernels for bf16 training, applied to a plain model from outside by :func:`convert`.

- ``build``: the C++ extension (one source per op family, ``kernels.h`` declaring what ``module.cpp``
  binds), compiled on first use for the host's vector ISA and cached by torch; the fallback to PyTorch's
  ops when it cannot be built, and which fused paths this CPU takes (:func:`paths`);
- one module per op family, each registering its ops with ``torch.library.custom_op`` (namespace
  ``vitrain``: typed, keyword arguments, named results, fake and autograd implementations, so that
  ``torch.compile`` traces through them) and a function that runs the op where it applies and PyTorch's
  op elsewhere: ``layer_norm`` / ``add_layer_norm``, ``gelu``, ``linear`` / ``linear_gelu``,
  ``depthwise_conv3x3`` / ``locality_front`` and ``attention`` (AMX tiles only);
- ``convert``: the model converter that swaps a model's modules for fused ones.

Where the ops apply: CPU tensors in bf16 outside autocast, which is what ``precision_mode=o2`` (and
``full``) run (the attention also under autocast: its result is what autocast gives); elsewhere the ops
are PyTorch's. The run builder converts the model on CPU bf16 runs where :func:`wanted` says so for the
plan's mode (``performance.cpu_kernels``): a model not converted never reaches the fused ops. Whether the AMX tiles
run is the plan's too (:func:`use_amx_tiles`).
What each one buys is in the docstring of its module and in docs/benchmarks.md.
"""

from vitrain.kernels.attention import MAX_ATTENTION_TOKENS, attention
from vitrain.kernels.build import (
    HEADERS,
    SOURCES,
    KernelBuildError,
    Paths,
    extension,
    load,
    paths,
    reset_paths,
    use_amx_tiles,
    wanted,
)
from vitrain.kernels.converter import convert
from vitrain.kernels.depthwise import depthwise_conv3x3, locality_front
from vitrain.kernels.gelu import gelu
from vitrain.kernels.layer_norm import add_layer_norm, layer_norm
from vitrain.kernels.linear import linear, linear_gelu

__all__ = [
    "HEADERS",
    "MAX_ATTENTION_TOKENS",
    "SOURCES",
    "KernelBuildError",
    "Paths",
    "add_layer_norm",
    "attention",
    "convert",
    "depthwise_conv3x3",
    "extension",
    "gelu",
    "layer_norm",
    "linear",
    "linear_gelu",
    "load",
    "locality_front",
    "paths",
    "reset_paths",
    "use_amx_tiles",
    "wanted",
]
