"""Training: optimizer, schedule, step, evaluation, loop."""

from vitrain.train.build import build_model_for
from vitrain.train.loop import train
from vitrain.train.plan import make_plan

__all__ = ["build_model_for", "make_plan", "train"]
