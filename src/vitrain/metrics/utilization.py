"""Achieved FLOP/s, model FLOPs utilization (MFU) and peak memory: the figures ``vitrain bench`` reports
and every ``train`` line of ``metrics.jsonl`` carries, from one formula.

Training FLOPs = 3 x the analytic forward FLOPs (``vitrain.models.flops``; the backward costs twice the
forward) x images; MFU = achieved TFLOP/s per device / the device's peak TFLOP/s for the precision
(``vitrain.metrics.peak``).
"""

from __future__ import annotations

import resource
import sys

import torch

from vitrain.metrics.peak import PeakFlops

GIB = 2**30


def training_flops(forward_flops_per_image: int, images: int) -> int:
    """FLOPs of training on ``images`` images: forward plus a backward that costs twice the forward."""
    return 3 * forward_flops_per_image * images


def achieved_tflops(flops: float, seconds: float = 1.0) -> float | None:
    """TFLOP/s of ``flops`` done in ``seconds`` (None for no time)."""
    return flops / seconds / 1e12 if seconds > 0 else None


def utilization(tflops_per_device: float | None, peak: PeakFlops) -> tuple[float | None, str | None]:
    """(MFU, None), or (None, why): the peak is unknown, or lower than what was achieved (then that peak
    does not represent this model's kernels)."""
    if tflops_per_device is None:
        return None, "no training time measured"
    if not peak.tflops:
        return None, peak.source
    if tflops_per_device > peak.tflops:
        return None, (
            f"achieved {tflops_per_device:.4g} TFLOP/s exceeds the peak {peak.tflops:.4g} ({peak.source}): "
            "that peak does not represent this model's kernels"
        )
    return tflops_per_device / peak.tflops, None


def max_rss_bytes() -> int:
    """The process's peak resident set size so far (``getrusage``; it never decreases)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB on Linux


class WindowPeakMemory:
    """Peak memory of a window of training steps, without a device sync: on CUDA the allocator's peak
    (``torch.cuda.max_memory_allocated``, tensors only), reset at each :meth:`start`; on the CPU the
    process's peak RSS since it started (``ru_maxrss``: not per window, it only grows)."""

    def __init__(self, device: str):
        self.device = device
        self.cuda = device.startswith("cuda")

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float:
        peak = torch.cuda.max_memory_allocated(self.device) if self.cuda else max_rss_bytes()
        return peak / GIB


__all__ = ["GIB", "WindowPeakMemory", "achieved_tflops", "max_rss_bytes", "training_flops", "utilization"]
