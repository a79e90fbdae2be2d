"""Learning-rate schedule and run progress: linear warmup, then cosine (or constant) decay to a floor.

The schedule is a pure function of where the run is (optimizer steps, images seen, or training
seconds for a wall-clock budget), so a resumed run continues exactly the same plan and a
curriculum may change the batch size without bending it.
"""

from __future__ import annotations

import math

import torch

from vitrain.config import SchedulePlan
from vitrain.train.state import TrainState


def lr_factor(position: float, length: float, warmup: float, name: str, warmup_start: float, min_ratio: float) -> float:
    """Multiplier of the peak LR at ``position`` (0-based) of a run of ``length`` with ``warmup``."""
    if position < warmup:
        return warmup_start + (1.0 - warmup_start) * position / warmup
    if name == "constant":
        return 1.0
    decay = max(1e-12, length - warmup)
    progress = min(1.0, (position - warmup) / decay)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def run_progress(schedule: SchedulePlan, state: TrainState, train_s: float) -> float:
    """Fraction of the run done (may pass 1.0 on the last step): steps, images or budget seconds."""
    position = {"steps": state.step, "samples": state.images_seen, "seconds": train_s}[schedule.duration_unit]
    return position / schedule.run_length


def scheduled_lr(schedule: SchedulePlan, state: TrainState, train_s: float) -> float:
    """Peak LR x schedule x the current curriculum stage's multiplier.

    Budget runs warm up over images (the warmup is a count of steps' worth of images, known in
    advance) and then decay over the fraction of the budget spent, reaching the floor as the
    budget runs out. (The decay's clock runs during the warmup too: at a warmup of w of the
    budget the peak is cos(pi w) lower, under 1 % for w < 6 %.)
    """
    shape = (schedule.name, schedule.warmup_start, schedule.min_lr_ratio)
    if schedule.duration_unit == "steps":
        factor = lr_factor(state.step, schedule.run_length, schedule.warmup, *shape)
    elif schedule.duration_unit == "samples":
        factor = lr_factor(state.images_seen, schedule.run_length, schedule.warmup, *shape)
    elif state.images_seen < schedule.warmup:
        factor = lr_factor(state.images_seen, math.inf, schedule.warmup, *shape)
    else:
        factor = lr_factor(train_s, schedule.run_length, 0.0, *shape)
    stage = schedule.stage_at(run_progress(schedule, state, train_s), state.epoch_position(schedule.num_train))
    return schedule.lr * factor * stage.lr_scale


def apply_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's LR to the scheduled ``lr`` times the group's ``lr_scale`` (layer-wise LR
    decay, ``optim.layer_decay``; 1 where a group has none)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def scheduled_lr_of(optimizer: torch.optim.Optimizer) -> float:
    """The LR last set by :func:`apply_lr` before any group's scale: the head's under layer decay."""
    group = optimizer.param_groups[0]
    return group["lr"] / group.get("lr_scale", 1.0)
