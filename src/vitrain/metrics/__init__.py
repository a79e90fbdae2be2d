"""Metrics: the JSONL record is the source of truth; console output is derived from it."""

from vitrain.metrics.records import JsonlWriter, NullWriter, read_jsonl, run_environment

__all__ = ["JsonlWriter", "NullWriter", "read_jsonl", "run_environment"]
