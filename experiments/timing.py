"""The wall-clock timer the micro-benchmarks here share (run them as ``python experiments/NAME.py``,
which puts this folder on the import path)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(function: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of ``repeats`` calls of ``function`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        function()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)
