"""Peak memory of a measured region: CUDA allocator peak, or the CPU process's peak RSS increase."""

from __future__ import annotations

from pathlib import Path

import torch

from vitrain.metrics.utilization import max_rss_bytes
from vitrain.train.host_memory import return_free_heap_to_os

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` size field (VmRSS, VmHWM) in bytes; None off Linux."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the process's peak RSS to its current RSS (Linux >= 4.0: ``5`` > clear_refs)."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


class PeakMemory:
    """``start()`` before building the model, ``stop()`` after timing; ``bytes`` is None with a ``reason``
    when it cannot be known.

    CUDA: ``torch.cuda.max_memory_allocated`` since start (tensors only, not the allocator cache).
    CPU: the increase of the process's peak resident set size over its RSS at start (free heap is
    returned to the OS first; library code paged in on first use counts too); where the peak cannot be
    reset, ``ru_maxrss`` is a high-water mark for the whole process, so an earlier, higher
    peak hides this one.
    """

    def __init__(self, device: str):
        self.device = device
        self.bytes: int | None = None
        self.source = ""
        self.reason: str | None = None
        self._baseline = 0
        self._resettable = False

    def start(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        # glibc keeps freed heap pages resident; untrimmed, a second measurement in the same process
        # would reuse them and show almost no RSS increase
        return_free_heap_to_os()
        self._resettable = _reset_peak_rss() and _status_bytes("VmHWM") is not None
        if self._resettable:
            self._baseline = _status_bytes("VmRSS") or 0
        else:
            self._baseline = max_rss_bytes()

    def stop(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device)
            self.source = "torch.cuda.max_memory_allocated"
            return
        if self._resettable:
            self.bytes = max(0, (_status_bytes("VmHWM") or 0) - self._baseline)
            self.source = (
                "CPU peak RSS increase (VmHWM after a reset, minus VmRSS at start; the first measurement "
                "in a process also counts library pages loaded on first use)"
            )
            return
        increase = max_rss_bytes() - self._baseline
        self.source = "CPU peak RSS increase (ru_maxrss)"
        if increase > 0:
            self.bytes = increase
        else:
            self.reason = "the process's peak RSS was already higher before the benchmark (ru_maxrss cannot be reset)"
