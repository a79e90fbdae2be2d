"""Checkpoints: atomic single-file saves, keep-last-k plus best, newest-complete lookup, safe loading."""

from vitrain.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    find_best_checkpoint,
    find_latest_checkpoint,
    load_checkpoint,
)

__all__ = ["CheckpointError", "CheckpointManager", "find_best_checkpoint", "find_latest_checkpoint", "load_checkpoint"]
