"""Preemption: SIGTERM (schedulers, ``kill``, Slurm at the end of a job) and SIGUSR1 (Slurm's warning
before the time limit, ``#SBATCH --signal``) ask a run to stop. While training, their handlers only
record the request; the loop finishes the step it is in, writes a checkpoint and the summary, and
raises :class:`Preempted`, which the CLI turns into exit code 3 (``vitrain.cli.EXIT_PREEMPTED``).
Several processes agree on the step to stop at (``vitrain.parallel.distributed.any_rank``).
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

log = logging.getLogger("vitrain")

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped early on a signal, after saving a checkpoint; ``--resume auto`` continues it."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path | None):
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        super().__init__(
            f"preempted by {signal_name} at step {step}; checkpoint {checkpoint} saved; "
            "continue the run with --resume auto (same config)"
        )


class StopSignals:
    """While entered, the preemption signals only set ``received`` (the first signal's name); the
    handlers before are back on exit. Handlers can only be set from the main thread: elsewhere the
    signals keep their handlers and a warning says so."""

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS):
        self.signals = signals
        self.received: str | None = None
        self.previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            log.warning("training outside the main thread: SIGTERM/SIGUSR1 will not checkpoint before stopping")
            return self
        for number in self.signals:
            self.previous[number] = signal.signal(number, self._record)
        return self

    def _record(self, number: int, frame) -> None:
        # no logging here: the handler interrupts the main thread anywhere, possibly inside logging
        self.received = self.received or signal.Signals(number).name

    def __exit__(self, *exc_info) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        self.previous.clear()
