"""Atomic checkpoints.

A checkpoint is one file ``checkpoints/step-NNNNNNNNN.pt``. It is written under a temporary
name, fsynced, then renamed into place, so a file with the final name is always complete; a
crash mid-save leaves only a ``.tmp`` file that is ignored and cleaned up by the next save.
Loading uses ``weights_only=True``: nothing but tensors and plain containers is unpickled.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_PATTERN = re.compile(r"^step-(\d{9})(\.pt)?$")
"""A single-file checkpoint ``step-N.pt`` or a sharded one, the folder ``step-N`` (checkpoint/sharded.py)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which file and why."""


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``folder``, oldest first, as ``(step, path)``."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = CHECKPOINT_PATTERN.match(path.name)
        if match and (path.is_file() or (path / "COMPLETE").is_file()):  # a folder counts once marked complete
            found.append((int(match.group(1)), path))
    return sorted(found)


def find_latest_checkpoint(run_dir: Path) -> Path | None:
    checkpoints = list_checkpoints(Path(run_dir) / "checkpoints")
    return checkpoints[-1][1] if checkpoints else None


def load_checkpoint(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; pass the path of a step-*.pt file or --resume auto")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"checkpoint {path} holds objects that need arbitrary unpickling, which vitrain refuses "
            f"(weights_only=True): {str(error).splitlines()[0]}"
        ) from None
    except (RuntimeError, EOFError, OSError) as error:
        raise CheckpointError(f"checkpoint {path} cannot be read (truncated or not a checkpoint?): {error}") from None


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int):
        self.folder = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.folder / f"step-{step:09d}.pt"

    def save(self, payload: dict[str, Any], step: int) -> Path:
        final = self.path_for(step)
        temporary = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(temporary, "wb") as handle:
                torch.save(payload, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, final)
            _fsync_dir(self.folder)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            raise CheckpointError(
                f"cannot write checkpoint {final}: {error.strerror or error}; free disk space or choose a "
                "writable train.out_dir (the previous checkpoint is intact)"
            ) from None
        self._prune()
        return final

    def prune(self) -> None:
        """Remove what crashed saves left and all but the newest ``keep_last`` checkpoints."""
        self._prune()

    def _prune(self) -> None:
        for leftover in self.folder.glob("*.tmp-*"):
            leftover.unlink(missing_ok=True)
        for leftover in self.folder.glob("step-*.tmp"):  # a sharded save cut off before its rename
            shutil.rmtree(leftover, ignore_errors=True)
        for _, path in list_checkpoints(self.folder)[: -self.keep_last]:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
