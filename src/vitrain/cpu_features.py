"""What this CPU and this build of PyTorch can do in bf16, asked once per process.

Fast CPU paths are chosen from these answers, never from the CPU's name. Each answer is what the
libraries will actually do here, so the three switches that lower them are honoured:

- ``ONEDNN_MAX_CPU_ISA`` (oneDNN): e.g. ``AVX2`` makes oneDNN behave as on an AVX2-only CPU, where it
  has no bf16 inner product and reports no native bf16;
- ``ATEN_CPU_CAPABILITY`` (PyTorch): the vector ISA of ATen's kernels, and of vitrain's own kernels,
  which are compiled for the same one (``vitrain.kernels``);
- ``VITRAIN_AMX=off`` (vitrain): vitrain's AMX tile kernels are not used even where the CPU has AMX.

The test suite sets all three to run its precision and kernel tests as an AVX2-only machine would
(``tests/unit/test_avx2_emulation.py``).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger("vitrain")

AMX_SWITCH = "VITRAIN_AMX"
"""Environment variable: ``off`` (or ``0``) forbids vitrain's AMX tile kernels; ``auto`` (unset) uses
them where the CPU has AMX-BF16 and the kernels were built with it."""

_AMX_VALUES = {"auto": True, "on": True, "1": True, "off": False, "0": False}


@functools.cache
def cpu_bf16_native() -> bool:
    """oneDNN computes bf16 natively on this CPU (AVX512-BF16 or AMX, within ``ONEDNN_MAX_CPU_ISA``).
    Elsewhere bf16 still runs, converted in software, many times slower than fp32."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def onednn_bf16_linear() -> bool:
    """oneDNN's linear primitive takes bf16 operands with the bias inside the product
    (``torch.ops.mkldnn._linear_pointwise``). Probed on a tiny product: on a CPU without native bf16
    the op exists but fails to create its primitive (``RuntimeError: could not create a primitive
    descriptor``), while ``F.linear`` on the same tensors works."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    # small integers: every product, sum and result is exact in bf16, so the check can be equality
    x = torch.tensor([[1.0] * 16, [2.0] * 16], dtype=torch.bfloat16)
    weight = torch.ones(4, 16, dtype=torch.bfloat16)
    bias = torch.arange(4, dtype=torch.bfloat16)
    try:
        with torch.no_grad():
            out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    except RuntimeError as error:
        log.debug("oneDNN has no bf16 linear primitive here (%s)", str(error).splitlines()[0])
        return False
    return bool(torch.equal(out.float(), torch.nn.functional.linear(x.float(), weight.float(), bias.float())))


@functools.cache
def amx_allowed() -> bool:
    """Whether ``VITRAIN_AMX`` lets vitrain use its AMX tile kernels (whether the CPU has AMX is the
    kernels' own check)."""
    value = os.environ.get(AMX_SWITCH, "auto").strip().lower()
    if value not in _AMX_VALUES:
        raise ValueError(
            f"{AMX_SWITCH}={value!r} is not understood; use {AMX_SWITCH}=off to forbid the AMX tiles, or unset it"
        )
    return _AMX_VALUES[value]


_warned_emulated_bf16 = False


def warn_if_bf16_emulated(device: str, precision: str) -> None:
    """One warning per process when a CPU run computes in bf16 that this CPU can only emulate."""
    global _warned_emulated_bf16
    if device != "cpu" or precision != "bf16" or cpu_bf16_native() or _warned_emulated_bf16:
        return
    _warned_emulated_bf16 = True
    log.warning(
        "precision=bf16 on a CPU without native bf16 (no AVX512-BF16 or AMX, as oneDNN sees it): bf16 is "
        "emulated in software here and trains correctly but many times slower than fp32; "
        "precision=fp32 (or auto) is faster on this machine"
    )
