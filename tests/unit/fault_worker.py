"""``vitrain`` with fault-injection seams, run as a subprocess by test_fault_injection.py (pytest does
not collect this file). The seams live here, not in vitrain: each one waits at a moment worth
killing the process in and first creates a marker file, so the test knows the moment has come.

    python fault_worker.py MARKER_DIR SEAM -- <vitrain arguments>

SEAM: ``none``; ``mid-write`` (each checkpoint write stops halfway: half the bytes are in the
temporary file); ``before-prune`` (the new checkpoint is in place, older ones not yet pruned).
Every seam also marks the start of training (``training-<pid>``).
"""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

PAUSE_S = 30.0  # long enough for any test to notice the marker and kill


def _mark(folder: Path, name: str) -> None:
    (folder / f"{name}-{os.getpid()}").touch()


def install_seams(markers: Path, seam: str) -> None:
    import torch

    from vitrain.checkpoint.manager import CheckpointManager
    from vitrain.train.loop import Trainer

    start_training = Trainer.train

    def train(self):
        _mark(markers, "training")
        return start_training(self)

    Trainer.train = train
    if seam == "mid-write":
        save = torch.save

        def save_halfway(payload, handle, *args, **kwargs):
            buffer = io.BytesIO()
            save(payload, buffer, *args, **kwargs)
            data = buffer.getvalue()
            handle.write(data[: len(data) // 2])
            handle.flush()
            _mark(markers, "writing")
            time.sleep(PAUSE_S)
            handle.write(data[len(data) // 2 :])

        torch.save = save_halfway
    elif seam == "before-prune":
        prune = CheckpointManager._prune

        def pause_then_prune(self):
            _mark(markers, "pruning")
            time.sleep(PAUSE_S)
            prune(self)

        CheckpointManager._prune = pause_then_prune
    elif seam != "none":
        raise SystemExit(f"unknown seam {seam!r}")


if __name__ == "__main__":
    marker_dir, seam, separator, *vitrain_args = sys.argv[1:]
    assert separator == "--", sys.argv
    install_seams(Path(marker_dir), seam)
    from vitrain.cli import main

    sys.exit(main(vitrain_args))
