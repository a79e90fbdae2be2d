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
