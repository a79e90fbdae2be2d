"""LR schedule shape."""

from __future__ import annotations

import math

import pytest

from vitrain.train.schedule import lr_factor


def test_linear_warmup_then_cosine_to_floor():
    factors = [lr_factor(step, 110, 10, "cosine", 0.0, 0.1) for step in range(110)]
    assert factors[0] == 0.0
    assert factors[5] == pytest.approx(0.5)
    assert factors[10] == pytest.approx(1.0)
    assert factors[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))
    assert lr_factor(110, 110, 10, "cosine", 0.0, 0.1) == pytest.approx(0.1)
    assert lr_factor(500, 110, 10, "cosine", 0.0, 0.1) == pytest.approx(0.1)


def test_constant_and_warmup_start():
    assert lr_factor(0, 100, 10, "constant", 0.2, 0.0) == pytest.approx(0.2)
    assert lr_factor(50, 100, 10, "constant", 0.2, 0.0) == 1.0
    assert lr_factor(0, 100, 0, "cosine", 0.0, 0.0) == 1.0


def _plan(*overrides):
    from tests.conftest import make_config
    from vitrain.config import DatasetInfo, Hardware, resolve
    from vitrain.models import model_facts

    data = DatasetInfo(num_train=1000, num_eval=100, num_classes=10, channels=1, mean=(0.5,), std=(0.25,))
    config = make_config("train.batch_size=100", "optim.lr=1.024", "schedule.min_lr_ratio=0.1", *overrides)
    return resolve(config, data, Hardware(cuda_available=False, bf16_supported=False), model_facts)


def test_budget_warms_up_over_images_then_decays_over_budget_seconds_to_the_floor():
    from vitrain.train.schedule import run_progress, scheduled_lr
    from vitrain.train.state import TrainState

    plan = _plan("train.budget=100s", "schedule.warmup_epochs=0.5")  # peak 0.1; warmup 500 images
    assert scheduled_lr(plan.schedule, TrainState(images_seen=0), 0.0) == 0.0
    assert scheduled_lr(plan.schedule, TrainState(images_seen=250), 3.0) == pytest.approx(0.05)
    peak_after_warmup = scheduled_lr(plan.schedule, TrainState(images_seen=500), 5.0)
    assert peak_after_warmup == pytest.approx(0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * 0.05)))
    # the decay follows seconds, whatever the number of images: a slow and a fast machine agree
    assert (
        scheduled_lr(plan.schedule, TrainState(images_seen=900), 50.0)
        == scheduled_lr(plan.schedule, TrainState(images_seen=90000), 50.0)
        == pytest.approx(0.055)
    )
    assert scheduled_lr(plan.schedule, TrainState(images_seen=9000), 100.0) == pytest.approx(0.01)  # floor at the end
    assert run_progress(plan.schedule, TrainState(images_seen=10**6), 25.0) == 0.25


def test_sample_measured_schedule_ignores_batch_changes_and_applies_stage_scale():
    from vitrain.train.schedule import scheduled_lr
    from vitrain.train.state import TrainState

    plan = _plan("train.epochs=10", "curriculum.stages=[{until: 0.5, image_size: 14, batch_size: 50, lr_scale: 0.5}]")
    # 10 epochs of 1000 images; halfway through the LR is the cosine's midpoint, at each stage's scale
    assert scheduled_lr(plan.schedule, TrainState(images_seen=4999), 0.0) == pytest.approx(0.5 * 0.055, rel=1e-3)
    assert scheduled_lr(plan.schedule, TrainState(images_seen=5000), 0.0) == pytest.approx(0.055)
