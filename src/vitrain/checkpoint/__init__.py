"""Checkpoints: atomic single-file saves, keep-last-k plus best, newest-complete lookup, safe loading;
what a training checkpoint holds and how a run saves and resumes it (:class:`RunCheckpoints`)."""

from vitrain.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    find_best_checkpoint,
    find_last_checkpoint,
    find_latest_checkpoint,
    load_checkpoint,
    resolve_checkpoint_argument,
)
from vitrain.checkpoint.training import (
    CHECKPOINT_FORMAT,
    RunCheckpoints,
    find_resume_checkpoint,
    load_resume_payload,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "CheckpointManager",
    "RunCheckpoints",
    "find_best_checkpoint",
    "find_last_checkpoint",
    "find_latest_checkpoint",
    "find_resume_checkpoint",
    "load_checkpoint",
    "load_resume_payload",
    "resolve_checkpoint_argument",
]
