"""Counting the steps that ``TrainStep`` skipped for a non-finite loss or gradient norm.

The counters live on the device and are read at log steps, the loop's only host syncs; the run
stops when the longest run of consecutive skipped steps exceeds ``train.max_skipped_steps``. The
decision does not depend on the log cadence, only when it is taken: skipped steps change nothing,
so the steps in between train on nothing bad.
"""

from __future__ import annotations

import torch


class SkipCounter:
    """Skipped steps: in total, in the current streak, and the longest streak since the last read."""

    def __init__(self, device: str | torch.device, total: int = 0, streak: int = 0):
        self.total = torch.tensor(total, dtype=torch.int64, device=device)
        self.streak = torch.tensor(streak, dtype=torch.int64, device=device)
        self.longest = self.streak.clone()

    def add(self, skipped: torch.Tensor) -> None:
        """Count one step; ``skipped`` is the step's device flag (1.0: skipped). No host sync."""
        step = skipped.to(torch.int64)
        self.total.add_(step)
        self.streak.add_(step).mul_(step)  # a step that trains ends the streak
        torch.maximum(self.longest, self.streak, out=self.longest)

    def read(self) -> tuple[int, int, int]:
        """``(total, streak, longest streak since the last read)``: one host sync."""
        total, streak, longest = torch.stack([self.total, self.streak, self.longest]).tolist()
        self.longest.copy_(self.streak)
        return total, streak, longest
