"""Loop counters and RNG state: everything besides modules that a resumed run must restore."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import torch


@dataclasses.dataclass
class TrainState:
    step: int = 0
    """Optimizer steps taken."""
    images_seen: int = 0
    epoch: int = 0
    """Epochs completed."""
    epoch_images: int = 0
    """Images of the current epoch already trained on; with ``epoch`` it fixes the data position."""
    train_s: float = 0.0
    """Training seconds (evaluation and checkpoint time excluded)."""
    eval_s: float = 0.0
    checkpoint_s: float = 0.0
    best_top1: float | None = None
    last_eval: dict[str, float] | None = None
    skipped_steps: int = 0
    """Steps whose update was skipped because their loss or gradient norm was not finite."""
    skip_streak: int = 0
    """Skipped steps in a row up to now (train.max_skipped_steps bounds it)."""

    def epoch_position(self, num_train: int) -> float:
        """Epochs done, with the current one's fraction."""
        return self.epoch + self.epoch_images / num_train

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> TrainState:
        return cls(**state)


def capture_rng_state() -> dict[str, Any]:
    """All RNG streams as plain tensors, lists and ints (loadable with weights_only=True)."""
    numpy_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def restore_rank_rng_state(payload: dict[str, Any], rank: int, world_size: int, fallback_seed: int) -> None:
    """Restore this rank's RNG streams from a checkpoint payload. Every rank draws its own dropout, so
    each rank's streams are saved (``rng_by_rank``); a checkpoint written by another number of processes
    gives rank 0's streams and then a distinct torch stream per rank (``fallback_seed``)."""
    by_rank = payload.get("rng_by_rank")
    if by_rank and len(by_rank) == world_size:
        restore_rng_state(by_rank[rank])
        return
    restore_rng_state(payload["rng"])
    if world_size > 1:
        torch.manual_seed(fallback_seed)
