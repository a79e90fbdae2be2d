"""Metrics: the JSONL record is the source of truth; console output and the metric sinks (TensorBoard,
MLflow, W&B, CSV) are derived from it."""

from vitrain.metrics.meter import ThroughputMeter
from vitrain.metrics.records import JsonlWriter, NullWriter, read_jsonl, run_environment
from vitrain.metrics.sinks import MetricsSinks, build_metrics_sinks

__all__ = [
    "JsonlWriter",
    "MetricsSinks",
    "NullWriter",
    "ThroughputMeter",
    "build_metrics_sinks",
    "read_jsonl",
    "run_environment",
]
