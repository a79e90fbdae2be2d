"""``train.profile=START:N``: a ``torch.profiler`` trace of N training steps from step START.

Each process writes, into ``<run>/profile/``:

- ``rank<R>.pt.trace.json``: the Chrome trace (chrome://tracing, https://ui.perfetto.dev), also what
  TensorBoard's profiler plugin reads (``tensorboard --logdir <run>/profile``); each step is a
  ``ProfilerStep#S`` span, S the run's 0-based step;
- ``rank<R>-ops.txt``: the operators by self time (CPU, and CUDA on GPUs), as ``key_averages()`` tables;
- on CUDA, ``rank<R>-memory.pickle``: a memory snapshot of the traced steps (allocations with their stacks;
  drag it into https://pytorch.org/memory_viz).

The profiler starts before step START and stops after step START + N - 1, or at the end of the run if
it comes first; a run resumed past START traces nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

log = logging.getLogger(__name__)

PROFILE_FOLDER = "profile"


class StepProfiler:
    """Traces the steps of ``window`` (START, N) of a run writing into ``out_dir``; ``before_step(step)``
    and ``after_step(step)`` bracket every training step (``step``: 0-based, the one being taken), and
    ``close()`` ends a trace the run outlived. ``files`` names what was written, for the summary."""

    def __init__(self, window: tuple[int, int] | None, out_dir: Path, rank: int, device: str | torch.device):
        self.window, self.folder, self.rank = window, Path(out_dir) / PROFILE_FOLDER, rank
        self.cuda = torch.device(device).type == "cuda"
        self.profiler: profile | None = None
        self.span: record_function | None = None
        self.traced: list[int] = []
        self.files: dict[str, Any] = {}

    def before_step(self, step: int) -> None:
        if self.window is not None and self.profiler is None and step == self.window[0]:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            if self.cuda:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            self.profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
            self.profiler.__enter__()
            log.info("profiling steps %d to %d (train.profile)", step, step + self.window[1] - 1)
        if self.profiler is not None:  # the span TensorBoard's plugin splits the trace into steps by
            self.span = record_function(f"ProfilerStep#{step}")
            self.span.__enter__()

    def after_step(self, step: int) -> None:
        if self.profiler is None:
            return
        self.span.__exit__(None, None, None)
        self.traced.append(step)
        if len(self.traced) == self.window[1]:
            self.close()

    def close(self) -> None:
        """Stop a running trace and write its files (nothing when none runs)."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{self.rank}.pt.trace.json"
        profiler.export_chrome_trace(str(trace))
        ops = self.folder / f"rank{self.rank}-ops.txt"
        ops.write_text(_operator_tables(profiler, self.cuda))
        self.files = {"steps": [self.traced[0], self.traced[-1]], "trace": str(trace), "ops": str(ops)}
        if self.cuda:
            snapshot = self.folder / f"rank{self.rank}-memory.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.files["memory_snapshot"] = str(snapshot)
        log.info("profile of steps %d-%d written to %s", self.traced[0], self.traced[-1], self.folder)


def _operator_tables(profiler: profile, cuda: bool) -> str:
    """The traced operators by self CPU time (and by self CUDA time on GPUs), 30 rows each."""
    averages = profiler.key_averages()
    sorts = ["self_cpu_time_total"] + (["self_cuda_time_total"] if cuda else [])
    return "\n\n".join(f"by {key}:\n{averages.table(sort_by=key, row_limit=30)}" for key in sorts)
