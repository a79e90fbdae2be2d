"""Atomic checkpoints.

A checkpoint is one file ``checkpoints/step-NNNNNNNNN.pt``. It is written under a temporary
name, fsynced, then renamed into place and the folder fsynced, so the final name is the completion
marker: a file with that name is always complete, and a crash or SIGKILL at any moment (mid-save
included) leaves at most a ``.tmp-`` file that is ignored and cleaned up by the next save. Older
checkpoints are pruned only after the new one is in place. ``checkpoints/best.json`` names the
checkpoint with the best eval top-1, which pruning keeps beside the newest ``keep_last``. By name: ``last``
is the newest complete checkpoint of a run folder, ``best`` the one ``best.json`` names.
Loading uses ``weights_only=True``: nothing but tensors and plain containers is unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from vitrain.io import (
    CheckpointError,
    fsync_dir,
    read_torch_file,
    write_file_atomic,
)

CHECKPOINT_PATTERN = re.compile(r"^step-(\d{9})(\.pt)?$")
"""A single-file checkpoint ``step-N.pt`` or a sharded one, the folder ``step-N`` (checkpoint/sharded.py)."""
BEST_RECORD = "best.json"

log = logging.getLogger("vitrain")


class _RecordingWriter:
    """A file for torch.save that keeps the OSError of a failed write: torch reports a full disk
    only as 'unexpected pos' (a RuntimeError); this keeps the real reason for the message."""

    def __init__(self, handle):
        self.handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.handle.flush()


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


def read_best_record(folder: Path) -> dict[str, Any] | None:
    """``{"step", "top1", "file"}`` of the best checkpoint in ``folder``, or None."""
    try:
        record = json.loads((Path(folder) / BEST_RECORD).read_text())
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return None
    if not isinstance(record, dict) or not isinstance(record.get("file"), str) or "/" in record["file"]:
        return None
    if not isinstance(record.get("top1"), (int, float)) or not isinstance(record.get("step"), int):
        return None
    return record


def find_best_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint with the best eval top-1 of the run, when it still exists."""
    folder = Path(run_dir) / "checkpoints"
    record = read_best_record(folder)
    path = folder / record["file"] if record else None
    return path if path is not None and (path.is_file() or (path / "COMPLETE").is_file()) else None


def find_last_checkpoint(run_dir: Path) -> Path:
    """``last``: the newest complete checkpoint of the run folder; CheckpointError when it holds none."""
    latest = find_latest_checkpoint(run_dir)
    if latest is None:
        raise CheckpointError(
            f"run folder {run_dir} holds no complete checkpoint (checkpoints/step-*); train it first, or give "
            "the run folder that holds the checkpoints"
        )
    return latest


def find_named_best_checkpoint(run_dir: Path) -> Path:
    """``best``: the checkpoint with the best recorded eval top-1; CheckpointError when none is recorded."""
    best = find_best_checkpoint(run_dir)
    if best is None:
        find_last_checkpoint(run_dir)  # no checkpoint at all: say that first
        raise CheckpointError(
            f"run folder {run_dir} records no best checkpoint (checkpoints/{BEST_RECORD} is written when a "
            "checkpoint of an evaluated step is saved as a single file); use last instead"
        )
    return best


def _is_checkpoint_folder(path: Path) -> bool:
    """A sharded checkpoint (``step-N`` or a copy holding DCP's ``.metadata``), not a run folder."""
    return CHECKPOINT_PATTERN.match(path.name) is not None or (path / ".metadata").is_file()


def resolve_checkpoint_argument(path: Path) -> Path:
    """What ``eval`` and ``export`` read: a checkpoint (``step-N.pt`` file or sharded ``step-N`` folder) as
    given; for a run folder (or its ``checkpoints`` folder), its best checkpoint by eval top-1, or its
    newest, with a warning, when no best is recorded. A folder that is neither is a CheckpointError."""
    path = Path(path)
    if not path.is_dir() or _is_checkpoint_folder(path):
        return path
    run_dir = path.parent if path.name == "checkpoints" else path
    if (path / "config.json").is_file() and any((path / name).is_file() for name in TIMM_WEIGHTS_FILES):
        raise CheckpointError(_timm_folder_message(path))
    if not (run_dir / "checkpoints").is_dir():
        raise CheckpointError(
            f"{path} is neither a checkpoint nor a run folder (it has no checkpoints/ folder); give a run "
            "folder, a step-*.pt file or a sharded step-* folder"
        )
    best = find_best_checkpoint(run_dir)
    if best is not None:
        return best
    latest = find_last_checkpoint(run_dir)
    log.warning("%s records no best checkpoint (no evaluated save); using its newest, %s", run_dir, latest.name)
    return latest


TIMM_WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")
"""The weights file of a timm model folder (``vitrain export --format timm``, a Hugging Face hub copy)."""


def _timm_folder_message(path: Path) -> str:
    """What to do with a timm model folder given where a vitrain checkpoint belongs: its architecture
    (config.json's, when it can be read) and how vitrain reads timm weights."""
    try:
        config = json.loads((path / "config.json").read_text())
        architecture = config.get("architecture") if isinstance(config, dict) else None
    except (OSError, ValueError):
        architecture = None
    name = architecture if isinstance(architecture, str) and architecture else "ARCH"
    weights = next((path / file for file in TIMM_WEIGHTS_FILES if (path / file).is_file()), path / "model.safetensors")
    return (
        f"{path} is a timm model folder (config.json and {weights.name}), not a vitrain checkpoint or run folder; "
        f"give the run folder or step-*.pt file it was exported from, or read its weights as timm's: "
        f"finetune --from timm:{name} --set train.init_weights={weights} (a teacher: train.distill.teacher={name} "
        f"train.distill.teacher_weights={weights})"
    )


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint file's content (tensors and plain containers only: ``weights_only=True``); whatever keeps
    it from being read is a CheckpointError naming the file and what to do (:func:`read_torch_file`)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; pass the path of a step-*.pt file or --resume auto")
    return read_torch_file(path)


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int):
        self.folder = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.folder / f"step-{step:09d}.pt"

    def save(self, payload: dict[str, Any], step: int, top1: float | None = None) -> Path:
        """Write the checkpoint of ``step`` atomically; ``top1``: its eval accuracy, when it has one."""
        final = self.path_for(step)
        temporary = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        writer = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(temporary, "wb") as handle:
                writer = _RecordingWriter(handle)
                torch.save(payload, writer)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, final)
            fsync_dir(self.folder)
        except (OSError, RuntimeError) as error:
            temporary.unlink(missing_ok=True)
            reason = writer.error if writer is not None and writer.error is not None else error
            if not isinstance(reason, OSError):
                raise  # not an I/O failure: a bug, with its traceback
            raise CheckpointError(
                f"cannot write checkpoint {final}: {reason.strerror or reason}; free disk space or choose a "
                "writable train.out_dir (the previous checkpoint is intact)"
            ) from None
        if top1 is not None:
            self.record_if_best(final.name, step, top1)
        self._prune()
        return final

    def prune(self) -> None:
        """Remove what crashed saves left and all but the newest ``keep_last`` checkpoints (and the best)."""
        self._prune()

    def record_if_best(self, name: str, step: int, top1: float) -> None:
        """Name checkpoint ``name`` (a file or sharded folder in the folder) of ``step`` in ``best.json`` when
        its eval ``top1`` beats the recorded best, or the recorded one is gone."""
        best = read_best_record(self.folder)
        if best is not None and top1 <= best["top1"] and (self.folder / best["file"]).exists():
            return
        record = {"step": step, "top1": top1, "file": name}
        try:
            write_file_atomic(self.folder / BEST_RECORD, (json.dumps(record) + "\n").encode())
        except OSError as error:
            raise CheckpointError(
                f"cannot write {self.folder / BEST_RECORD}: {error.strerror or error}; free disk space "
                f"(checkpoint {name} itself is complete)"
            ) from None

    def _prune(self) -> None:
        for leftover in self.folder.glob("*.tmp-*"):
            leftover.unlink(missing_ok=True)
        for leftover in self.folder.glob("step-*.tmp"):  # a sharded save cut off before its rename
            shutil.rmtree(leftover, ignore_errors=True)
        best = read_best_record(self.folder)
        for _, path in list_checkpoints(self.folder)[: -self.keep_last]:
            if best is not None and path.name == best["file"]:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
