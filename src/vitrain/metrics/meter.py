"""Training throughput: the figures of each ``train`` line of ``metrics.jsonl`` and the session's means in
``summary.json``, counted on the host with no device sync.

A :class:`ThroughputMeter` counts a **window** of steps (opened after each metrics line, closed at the next)
and the **session** (this process's run since it started or resumed): images, training seconds, seconds
waiting on the data loader, training FLOPs (:func:`~vitrain.metrics.utilization.training_flops`), the
training loader's bytes read and files opened, and peak memory. The caller passes the times (its clock) and
the loader's read counts; the meter holds no reference to the run.
"""

from __future__ import annotations

import dataclasses

from vitrain.metrics.peak import PeakFlops
from vitrain.metrics.utilization import WindowPeakMemory, achieved_tflops, training_flops, utilization

ReadCounts = tuple[int, int]
"""A loader's image bytes decoded and files opened so far (None for in-memory data)."""


@dataclasses.dataclass
class Window:
    """What the steps since the last metrics line did."""

    started: float
    """The clock when it opened."""
    reads: ReadCounts | None
    """The loader's read counts when it opened."""
    images: int = 0
    data_wait_s: float = 0.0
    flops: int = 0


class ThroughputMeter:
    """Windows of training steps and the session's totals. ``peak``: the device's peak FLOP/s, the MFU
    denominator (None: no MFU, as on processes that write no metrics); ``devices``: the processes of the job
    (``tflops`` is the job's, MFU per device); ``device``: where peak memory is read."""

    def __init__(
        self, device: str, devices: int = 1, peak: PeakFlops | None = None, bf16_peak: PeakFlops | None = None
    ):
        self.devices, self.peak, self.bf16_peak = devices, peak, bf16_peak
        self.memory = WindowPeakMemory(device)
        self.forward_flops = 0
        """Analytic forward FLOPs per image at the current image size (0: unknown, no TFLOP/s)."""
        self.window = Window(0.0, None)
        self.images, self.train_s, self.data_wait_s, self.flops = 0, 0.0, 0.0, 0
        self.bytes_read, self.files_opened = 0, 0
        self.peak_mem_gib: float | None = None

    def open_window(self, now: float, reads: ReadCounts | None) -> None:
        """A new window from ``now`` (the loader has read ``reads`` so far)."""
        self.window = Window(now, reads)
        self.memory.start()

    def waited_for_data(self, seconds: float) -> None:
        self.window.data_wait_s += seconds

    def stepped(self, images: int) -> None:
        """One training step on ``images`` images (the global batch), at the current ``forward_flops``."""
        self.window.images += images
        self.window.flops += training_flops(self.forward_flops, images)

    def close_window(self, now: float, reads: ReadCounts | None) -> tuple[float, dict[str, float | None]]:
        """Add the window to the session; return its seconds and its ``img_s``, ``tflops``, ``mfu``,
        ``peak_mem_gib``, ``data_wait_frac``, ``read_mb_s`` and ``files_s`` (in that order)."""
        window = self.window
        elapsed = now - window.started
        self.train_s += elapsed
        self.images += window.images
        self.data_wait_s += window.data_wait_s
        figures = {
            "img_s": window.images / elapsed if elapsed > 0 else None,
            **self._utilization(elapsed),
            "data_wait_frac": window.data_wait_s / elapsed if elapsed > 0 else None,
            **self._reads(elapsed, reads),
        }
        return elapsed, figures

    def _utilization(self, elapsed: float) -> dict[str, float | None]:
        """``tflops`` (the whole job's), ``mfu`` (per device) and ``peak_mem_gib`` of the window closing."""
        self.flops += self.window.flops
        tflops = achieved_tflops(self.window.flops, elapsed)
        peak_mem_gib = self.memory.peak_gib()
        self.peak_mem_gib = max(self.peak_mem_gib or 0.0, peak_mem_gib)
        return {"tflops": tflops, "mfu": self.mfu(tflops), "peak_mem_gib": peak_mem_gib}

    def _reads(self, elapsed: float, now: ReadCounts | None) -> dict[str, float | None]:
        """``read_mb_s`` and ``files_s`` of the window closing: bytes of the image files the training loader
        decoded (MB = 10^6 bytes) and files it opened, per second (None for in-memory data)."""
        before = self.window.reads
        if now is None or before is None or elapsed <= 0:
            return {"read_mb_s": None, "files_s": None}
        num_bytes, num_files = now[0] - before[0], now[1] - before[1]
        self.bytes_read += num_bytes
        self.files_opened += num_files
        return {"read_mb_s": num_bytes / elapsed / 1e6, "files_s": num_files / elapsed}

    def mfu(self, tflops: float | None) -> float | None:
        """MFU of the job's ``tflops``: per device, against this device's peak (None when unknown)."""
        if self.peak is None or tflops is None:
            return None
        return utilization(tflops / self.devices, self.peak)[0]

    def session_utilization(self) -> dict[str, float | str | None]:
        """The session's ``mean_tflops``, ``mean_mfu``, the peak MFU divides by (``mfu_peak_tflops``,
        ``mfu_peak_source``) and ``peak_mem_gib``."""
        tflops = achieved_tflops(self.flops, self.train_s)
        return {
            "mean_tflops": tflops,
            "mean_mfu": self.mfu(tflops),
            "mfu_peak_tflops": self.peak.tflops if self.peak is not None else None,
            "mfu_peak_source": self.peak.source if self.peak is not None else None,
            "peak_mem_gib": self.peak_mem_gib,
            **self.bf16_equivalent(tflops),
        }

    def bf16_equivalent(self, tflops: float | None) -> dict[str, float | None]:
        """precision=fp8: MFU against the bf16 peak as well (``mean_mfu_bf16_equivalent``); else nothing."""
        if self.bf16_peak is None:
            return {}
        mfu = None if tflops is None else utilization(tflops / self.devices, self.bf16_peak)[0]
        return {"mean_mfu_bf16_equivalent": mfu}

    def session_reads(self, reads: ReadCounts | None) -> dict[str, float | None]:
        """``mean_read_mb_s`` and ``mean_files_s`` of the session's training seconds (None for in-memory data,
        whose loader's ``reads`` are None)."""
        if reads is None or self.train_s <= 0:
            return {"mean_read_mb_s": None, "mean_files_s": None}
        return {
            "mean_read_mb_s": self.bytes_read / self.train_s / 1e6,
            "mean_files_s": self.files_opened / self.train_s,
        }
