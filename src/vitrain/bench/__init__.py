"""Benchmarks: training-step throughput and MFU through the training code path, timm as reference."""

from vitrain.bench.throughput import (
    BenchSettings,
    bench_overrides,
    format_table,
    measure_training_step,
    time_training_steps,
)
from vitrain.bench.timm_reference import TimmReference, compare_with_timm, timm_reference

__all__ = [
    "BenchSettings",
    "TimmReference",
    "bench_overrides",
    "compare_with_timm",
    "format_table",
    "measure_training_step",
    "time_training_steps",
    "timm_reference",
]
