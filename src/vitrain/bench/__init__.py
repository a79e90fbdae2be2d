"""Benchmarks: training-step throughput and MFU through the training code path, timm as reference."""

from vitrain.bench.ladder import format_ladder, ladder_rungs, plot_ladder, run_ladder
from vitrain.bench.throughput import (
    BenchSettings,
    bench_overrides,
    format_table,
    measure_training_step,
    time_training_steps,
    window_ms,
)
from vitrain.bench.timm_reference import TimmReference, compare_with_timm, timm_reference

__all__ = [
    "BenchSettings",
    "TimmReference",
    "bench_overrides",
    "compare_with_timm",
    "format_ladder",
    "format_table",
    "ladder_rungs",
    "measure_training_step",
    "plot_ladder",
    "run_ladder",
    "time_training_steps",
    "timm_reference",
    "window_ms",
]
