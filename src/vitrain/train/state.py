"""Loop counters: with the modules and the RNG streams (``vitrain.checkpoint``), what a resumed run restores."""

from __future__ import annotations

import dataclasses
from typing import Any


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
    best_ema_top1: float | None = None
    """Best eval top-1 of the weight EMA (train.ema.decay)."""
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
