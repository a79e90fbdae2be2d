"""Peak FLOP/s of a device for a compute dtype, the denominator of MFU.

GPUs: one table of vendor datasheet figures, each entry naming its datasheet. The figures are
dense tensor-core throughput; datasheets print the 2:4-sparsity figure (marked with an
asterisk), which is twice the dense one. fp32 training uses the TF32 tensor-core figure only
when torch lets matmuls use TF32 (``torch.set_float32_matmul_precision("high")``), otherwise the
plain fp32 figure. CPUs have no table: a matmul probe measures the peak once per process
(per dtype, size and thread count), and MFU on a CPU divides by the best of the precisions it trains in
(:func:`cpu_best_peak`), so a run in the slower one shows the share of the machine it leaves unused.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class PeakFlops:
    """Peak TFLOP/s for a device and dtype; ``source`` says where it comes from, or why it is unknown."""

    tflops: float | None
    source: str


@dataclasses.dataclass(frozen=True)
class GpuPeaks:
    """Dense TFLOP/s of one GPU model per matmul dtype (fp32, tf32, bf16, fp16, fp8)."""

    pattern: str
    """Regular expression searched (case-insensitively) in ``torch.cuda.get_device_name()``."""
    label: str
    tflops: dict[str, float]
    source: str


# First match wins: specific names (PCIe, NVL) come before the family name.
CUDA_PEAKS: tuple[GpuPeaks, ...] = (
    GpuPeaks(
        r"GH200",
        "GH200",
        {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
        "NVIDIA GH200 Grace Hopper Superchip datasheet (H100 SXM compute)",
    ),
    GpuPeaks(
        r"H100.*PCIe",
        "H100 PCIe",
        {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0},
        "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column (dense = sparse / 2)",
    ),
    GpuPeaks(
        r"H100.*NVL",
        "H100 NVL",
        {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
        "NVIDIA H100 Tensor Core GPU datasheet, H100 NVL column (dense = sparse / 2)",
    ),
    GpuPeaks(
        r"H100",
        "H100 SXM",
        {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
        "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (dense = sparse / 2)",
    ),
    GpuPeaks(
        r"H200.*NVL",
        "H200 NVL",
        {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
        "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL column (dense = sparse / 2)",
    ),
    GpuPeaks(
        r"H200",
        "H200 SXM",
        {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
        "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (dense = sparse / 2)",
    ),
    GpuPeaks(
        r"A100",
        "A100",
        {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
        "NVIDIA A100 Tensor Core GPU datasheet (SXM and PCIe; dense = sparse / 2)",
    ),
    GpuPeaks(
        r"L40S",
        "L40S",
        {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0},
        "NVIDIA L40S GPU datasheet (dense = sparse / 2)",
    ),
    GpuPeaks(
        r"\bL40\b",
        "L40",
        {"fp32": 90.5, "tf32": 90.5, "bf16": 181.0, "fp16": 181.0, "fp8": 362.0},
        "NVIDIA L40 GPU datasheet (dense = sparse / 2)",
    ),
    GpuPeaks(
        r"\bL4\b",
        "L4",
        {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5},
        "NVIDIA L4 Tensor Core GPU datasheet (dense = sparse / 2)",
    ),
    GpuPeaks(
        r"\bA10\b",
        "A10",
        {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
        "NVIDIA A10 Tensor Core GPU datasheet (dense = sparse / 2)",
    ),
    GpuPeaks(
        r"V100.*PCIe",
        "V100 PCIe",
        {"fp32": 14.0, "fp16": 112.0},
        "NVIDIA Tesla V100 GPU datasheet, PCIe column (no bf16 or TF32 tensor cores)",
    ),
    GpuPeaks(
        r"V100",
        "V100 SXM2",
        {"fp32": 15.7, "fp16": 125.0},
        "NVIDIA Tesla V100 GPU datasheet, SXM2 column (no bf16 or TF32 tensor cores)",
    ),
    GpuPeaks(
        r"\bT4\b",
        "T4",
        {"fp32": 8.1, "fp16": 65.0},
        "NVIDIA T4 Tensor Core GPU datasheet (fp16 mixed precision; no bf16 or TF32 tensor cores)",
    ),
)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def find_gpu_peaks(device_name: str) -> GpuPeaks | None:
    """The table entry for a CUDA device name (as ``torch.cuda.get_device_name`` spells it)."""
    for entry in CUDA_PEAKS:
        if re.search(entry.pattern, device_name, flags=re.IGNORECASE):
            return entry
    return None


def cuda_matmul_dtype(precision: str, float32_matmul_precision: str | None = None) -> str:
    """The table column a precision runs its matmuls in: fp32 runs on TF32 tensor cores when allowed."""
    if precision != "fp32":
        return precision
    setting = float32_matmul_precision or torch.get_float32_matmul_precision()
    return "fp32" if setting == "highest" else "tf32"


def cuda_peak(device_name: str, precision: str, float32_matmul_precision: str | None = None) -> PeakFlops:
    """Datasheet peak of a named GPU for ``precision`` (fp32, bf16, fp16); unknown GPUs give a reason."""
    entry = find_gpu_peaks(device_name)
    if entry is None:
        return PeakFlops(None, f"no datasheet peak for {device_name!r}; add it to vitrain.metrics.peak.CUDA_PEAKS")
    column = cuda_matmul_dtype(precision, float32_matmul_precision)
    if column not in entry.tflops:
        return PeakFlops(None, f"{entry.label} has no {column} tensor-core figure ({entry.source})")
    return PeakFlops(entry.tflops[column], f"{entry.source}: {entry.label} {column} dense")


@functools.cache
def _cpu_matmul_tflops(precision: str, size: int, num_threads: int, seconds: float, trials: int) -> float:
    """Best-of-``trials`` matmul throughput; ``num_threads`` is part of the cache key only.

    ``F.linear`` is the op the models' matmuls run (autocast casts it); on CPUs without native fp16
    it takes oneDNN's path while ``torch.mm`` falls back to a much slower kernel.
    """
    dtype = _DTYPES[precision]
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(size, size, generator=generator).to(dtype)
    weight = torch.randn(size, size, generator=generator).to(dtype)
    F.linear(inputs, weight)  # warm-up: first-call kernel selection and page faults
    # Each trial runs for its share of ``seconds`` (not a repeat count sized from the warm-up call:
    # that call can be far slower than the rest, and a one-matmul trial then reads a fraction of the peak).
    best = 0.0
    for _ in range(trials):
        calls, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds / trials or calls == 0:
            F.linear(inputs, weight)
            calls += 1
        best = max(best, 2 * size**3 * calls / elapsed)
    return best / 1e12


def measure_cpu_peak(precision: str, size: int = 2048, seconds: float = 0.5, trials: int = 3) -> PeakFlops:
    """Measured CPU matmul peak for ``precision`` (about ``seconds`` of ``size``² matmuls, best of
    ``trials``), cached per process, dtype, size and thread count."""
    if precision not in _DTYPES:
        raise ValueError(f"precision must be one of {', '.join(_DTYPES)}, got {precision!r}")
    num_threads = torch.get_num_threads()
    tflops = _cpu_matmul_tflops(precision, size, num_threads, seconds, trials)
    return PeakFlops(tflops, f"measured: CPU matmul probe {size}x{size} {precision}, {num_threads} thread(s)")


CPU_TRAINING_PRECISIONS = ("fp32", "bf16")


def cpu_best_peak() -> PeakFlops:
    """The CPU's best measured matmul peak over the precisions vitrain trains in on it: bf16 where the CPU has
    native bf16 (AVX512-BF16, AMX), fp32 where bf16 is emulated. A run in emulated bf16 thus shows the low MFU
    it really has, and an fp32 run on a bf16 CPU the speed it leaves unused."""
    peaks = {precision: measure_cpu_peak(precision) for precision in CPU_TRAINING_PRECISIONS}
    best = max(peaks, key=lambda precision: peaks[precision].tflops or 0.0)
    figures = ", ".join(f"{precision} {peak.tflops:.3g}" for precision, peak in peaks.items())
    return PeakFlops(
        peaks[best].tflops,
        f"measured: the CPU's best matmul probe, {best} (TFLOP/s {figures}; 2048x2048, "
        f"{torch.get_num_threads()} thread(s))",
    )


def fp8_weighted_peak(bf16: PeakFlops, fp8: PeakFlops, fp8_share: float) -> PeakFlops:
    """The peak of a step whose ``fp8_share`` of FLOPs run at the FP8 peak and the rest at the bf16 one: the
    time each part takes at its peak, summed (a FLOP-weighted harmonic mean). MFU against it is the share of
    the device's peak the step reaches, FP8 counted at FP8's rate."""
    if not (bf16.tflops and fp8.tflops):
        return fp8 if not fp8.tflops else bf16
    tflops = 1.0 / ((1.0 - fp8_share) / bf16.tflops + fp8_share / fp8.tflops)
    return PeakFlops(
        tflops,
        f"FLOP-weighted: {100 * fp8_share:.1f} % of the FLOPs at {fp8.tflops:.4g} ({fp8.source}), "
        f"the rest at {bf16.tflops:.4g} ({bf16.source})",
    )


def peak_flops(device: str, precision: str, fp8_share: float = 0.0) -> PeakFlops:
    """MFU's denominator on ``device`` (cpu, cuda, cuda:N) for a run in ``precision``: the datasheet peak of the
    precision on CUDA (fp8: :func:`fp8_weighted_peak` with ``fp8_share`` of the FLOPs in FP8); on a CPU the
    best measured peak of any precision it trains in (:func:`cpu_best_peak`; its FP8 is emulated in bf16)."""
    if not device.startswith("cuda"):
        return cpu_best_peak()
    name = torch.cuda.get_device_name(torch.device(device))
    if precision != "fp8":
        return cuda_peak(name, precision)
    return fp8_weighted_peak(cuda_peak(name, "bf16"), cuda_peak(name, "fp8"), fp8_share)


__all__ = [
    "CPU_TRAINING_PRECISIONS",
    "CUDA_PEAKS",
    "cpu_best_peak",
    "GpuPeaks",
    "PeakFlops",
    "cuda_matmul_dtype",
    "cuda_peak",
    "find_gpu_peaks",
    "fp8_weighted_peak",
    "measure_cpu_peak",
    "peak_flops",
]
