"""What this CPU and this build of PyTorch can do in bf16, asked once per process.

Fast CPU paths are chosen by measurement (:mod:`vitrain.train.choices`); these answers say what the
hardware *is*, for the doctor, the warnings, the cache keys of measured choices and the candidates worth
measuring. A library's capability flag is not such an answer: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``
is true on every AVX-512 CPU, where oneDNN *emulates* bf16 without AVX512-BF16, slower than fp32
(docs/benchmarks.md). So native bf16 is read from the CPU's own flags (``/proc/cpuinfo``), as limited by the
three switches that lower what the libraries use:

- ``ONEDNN_MAX_CPU_ISA`` (oneDNN): e.g. ``AVX2`` makes oneDNN behave as on an AVX2-only CPU, ``AVX512_CORE``
  as on an AVX-512 CPU without bf16 instructions (it emulates bf16 there);
- ``ATEN_CPU_CAPABILITY`` (PyTorch): the vector ISA of ATen's kernels, and of vitrain's own kernels,
  which are compiled for the same one (``vitrain.kernels``);
- ``VITRAIN_AMX=off`` (vitrain): vitrain's AMX tile kernels are not used even where the CPU has AMX.
  A training run sets this process's answer from its plan, which heeds the switch (:func:`allow_amx_tiles`).

The test suite sets all three to run its precision and kernel tests as the lower CPU levels would
(``tests/unit/test_cpu_levels.py``).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger("vitrain")

AMX_SWITCH = "VITRAIN_AMX"
"""Environment variable: ``off`` (or ``0``) forbids vitrain's AMX tile kernels; ``auto`` (unset) uses
them where the CPU has AMX-BF16 and the kernels were built with it."""

_AMX_VALUES = {"auto": True, "on": True, "1": True, "off": False, "0": False}

ONEDNN_ISA_SWITCH = "ONEDNN_MAX_CPU_ISA"
_ONEDNN_ISA_ORDER = {
    "SSE41": 0,
    "AVX": 1,
    "AVX2": 2,
    "AVX2_VNNI": 3,
    "AVX2_VNNI_2": 4,
    "AVX512_CORE": 5,
    "AVX512_CORE_VNNI": 6,
    "AVX512_CORE_BF16": 7,
    "AVX512_CORE_FP16": 8,
    "AVX10_1_512": 8,
    "AVX512_CORE_AMX": 9,
    "AVX10_1_512_AMX": 9,
    "AVX512_CORE_AMX_FP16": 10,
    "AVX10_1_512_AMX_FP16": 10,
    "AVX10_2_512": 11,
    "AVX10_2_512_AMX_2": 12,
}
"""oneDNN's ISA levels in order (its ``dnnl_cpu_isa_t``); ``DEFAULT``/``ALL`` and unset mean no limit."""
_BF16_LEVEL = {"avx512_bf16": _ONEDNN_ISA_ORDER["AVX512_CORE_BF16"], "amx_bf16": _ONEDNN_ISA_ORDER["AVX512_CORE_AMX"]}
"""The CPU flags that give oneDNN native bf16 products, and the lowest level at which it uses each."""


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (Linux); empty where it cannot be read."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); None where the system does not say."""
    info = cpu_info()
    text = info.get("flags", info.get("Features"))
    return set(text.split()) if text is not None else None


def cpu_model() -> str:
    """The CPU's model name as the system reports it, with its family and model numbers where the system gives
    them (a virtual machine may name only "AMD EPYC": family 25 is Zen 3/4, 26 Zen 5)."""
    info = cpu_info()
    name = info.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if "cpu family" in info:
        name += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    return name


def onednn_isa_limit() -> str | None:
    """``ONEDNN_MAX_CPU_ISA`` as oneDNN reads it (upper case); None when unset or no limit."""
    value = os.environ.get(ONEDNN_ISA_SWITCH, "").strip().upper()
    return None if value in ("", "ALL", "DEFAULT") else value


def _onednn_allows(level: int) -> bool:
    limit = onednn_isa_limit()
    return limit is None or _ONEDNN_ISA_ORDER.get(limit, len(_ONEDNN_ISA_ORDER)) >= level


@functools.cache
def cpu_bf16_native() -> bool:
    """oneDNN computes bf16 natively on this CPU: it has AVX512-BF16 or AMX-BF16 and ``ONEDNN_MAX_CPU_ISA``
    lets oneDNN use it. Elsewhere bf16 still runs, converted in software, slower than fp32.
    Where the system lists no CPU flags (not Linux), PyTorch's answer is taken."""
    torch_says = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    flags = cpu_flags()
    if flags is None or platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return torch_says
    return torch_says and any(flag in flags and _onednn_allows(level) for flag, level in _BF16_LEVEL.items())


def bf16_state() -> str:
    """Why bf16 is native or emulated here, in words (the doctor's line)."""
    flags = cpu_flags() or set()
    present = [name for flag, name in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16")) if flag in flags]
    if cpu_bf16_native():
        return f"native ({' and '.join(present) or 'as PyTorch reports'}, used by oneDNN)"
    if present and onednn_isa_limit() is not None:
        return f"emulated: {ONEDNN_ISA_SWITCH}={onednn_isa_limit()} keeps oneDNN from the CPU's {' and '.join(present)}"
    if present:
        return f"emulated: this build of PyTorch's oneDNN does not use the CPU's {' and '.join(present)}"
    return "emulated: the CPU has neither AVX512-BF16 nor AMX-BF16; bf16 runs converted in software"


def amx_tiles_possible() -> bool:
    """The CPU has AMX-BF16 tiles that vitrain's kernels may use (the flag, and :func:`amx_allowed`);
    whether the built kernels can use them is the kernels' own check (``kernels.paths()``)."""
    return _has_amx_bf16() and amx_allowed()


def amx_tiles_in_environment() -> bool:
    """The CPU has AMX-BF16 tiles and ``VITRAIN_AMX`` does not forbid them, whatever a run set with
    :func:`allow_amx_tiles`: the machine's fact (``Hardware.amx_tiles``)."""
    return _has_amx_bf16() and amx_allowed_by_environment()


def _has_amx_bf16() -> bool:
    return "amx_bf16" in (cpu_flags() or set())


def cpu_key() -> str:
    """What decides how fast (and bitwise how) a CPU computes: its model, the ISA ATen and oneDNN use, whether
    vitrain's AMX tiles may run (:func:`amx_tiles_possible`), the thread count and torch. The key of measured
    choices and of recorded weight digests."""
    return " | ".join(
        [
            cpu_model(),
            f"aten {torch.backends.cpu.get_cpu_capability()}",
            f"onednn {onednn_isa_limit() or 'all'}",
            f"amx tiles {'on' if amx_tiles_possible() else 'off'}",
            f"{torch.get_num_threads()} threads",
            f"torch {torch.__version__}",
        ]
    )


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


_amx_setting: bool | None = None


def allow_amx_tiles(allowed: bool | None) -> None:
    """Set whether this process may use vitrain's AMX tile kernels (a run's plan: ``RuntimePlan.amx_tiles``);
    None: the environment's answer again (:func:`amx_allowed_by_environment`). The kernels read it when they
    decide their paths (``kernels.use_amx_tiles`` sets both)."""
    global _amx_setting
    _amx_setting = allowed


def amx_allowed() -> bool:
    """Whether vitrain may use its AMX tile kernels in this process: what :func:`allow_amx_tiles` set, else
    what ``VITRAIN_AMX`` says (whether the CPU has AMX is the kernels' own check)."""
    return _amx_setting if _amx_setting is not None else amx_allowed_by_environment()


@functools.cache
def amx_allowed_by_environment() -> bool:
    """Whether ``VITRAIN_AMX`` lets vitrain use its AMX tile kernels; a value it does not understand is a
    ValueError."""
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
        "precision=bf16 on a CPU without native bf16 (%s): it trains correctly but slower than fp32 "
        "(2-4x seen); precision=auto measures both and takes the faster",
        bf16_state(),
    )
