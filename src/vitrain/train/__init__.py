"""Training: optimizer, schedule, step, evaluation, loop."""

from vitrain.train.loop import build_model_for, train

__all__ = ["build_model_for", "train"]
