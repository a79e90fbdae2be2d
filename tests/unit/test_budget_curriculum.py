"""Wall-clock budgets and image-size curricula in the training loop, with an injected clock."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import make_config
from vitrain.checkpoint import load_checkpoint
from vitrain.metrics import read_jsonl
from vitrain.train import loop, make_plan, train


def _train_records(plan):
    return [record for record in read_jsonl(plan.out_dir / "metrics.jsonl") if record["event"] == "train"]


def _weights(path):
    return load_checkpoint(path)["model"]


BUDGET = ["train.budget=20s", "train.log_every_steps=1", "schedule.min_lr_ratio=0.1", "schedule.warmup_epochs=0"]


@pytest.mark.parametrize("seconds_per_step", [1.0, 2.0])
def test_budget_stops_when_spent_with_the_lr_at_its_floor(small_synthetic_overrides, step_clock, seconds_per_step):
    step_clock.seconds_per_step = seconds_per_step
    plan = make_plan(make_config(*small_synthetic_overrides, *BUDGET))
    summary = train(plan, clock=step_clock)
    steps = round(20 / seconds_per_step)  # a machine twice as slow takes half the steps
    assert summary["steps"] == steps and summary["train_s"] == 20.0
    records = _train_records(plan)
    learning_rates = [record["lr"] for record in records]
    peak = plan.schedule.lr
    # the LR of the update at training second t is the cosine at t / 20, reaching the floor at 20 s
    expected = [peak * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * t / 20)).item())) for t in range(20)]
    assert learning_rates == pytest.approx(expected[:: int(seconds_per_step)], rel=1e-6)
    assert learning_rates[-1] < 0.11 * peak * (1 + 2 * seconds_per_step)
    assert summary["final_top1"] is not None  # evaluated once the budget is spent


def test_budget_excludes_evaluation_and_checkpoint_time(small_synthetic_overrides, step_clock, monkeypatch):
    """Each evaluation takes 7 fake seconds and each checkpoint 3: the budget still buys 20 steps."""
    evaluate, save = loop.Trainer.evaluate, loop.Trainer.save_checkpoint

    def slow(method, seconds):
        def wrapper(self):
            step_clock.now += seconds
            return method(self)

        return wrapper

    monkeypatch.setattr(loop.Trainer, "evaluate", slow(evaluate, 7.0))
    monkeypatch.setattr(loop.Trainer, "save_checkpoint", slow(save, 3.0))
    plan = make_plan(make_config(*small_synthetic_overrides, *BUDGET))
    summary = train(plan, clock=step_clock)
    evals = [record for record in read_jsonl(plan.out_dir / "metrics.jsonl") if record["event"] == "eval"]
    assert summary["steps"] == 20 and summary["train_s"] == 20.0
    assert len(evals) == 20 // 6 + 1  # every epoch of 6 steps, then at the end
    assert summary["wall_s"] == 20.0 + 7.0 * len(evals) + 3.0 * (20 // 6 + 1)


def test_resume_mid_budget_continues_the_same_plan(small_synthetic_overrides, step_clock, tmp_path):
    overrides = [*small_synthetic_overrides, *BUDGET, "checkpoint.keep_last=5"]
    straight = make_plan(make_config(*overrides))
    train(straight, clock=step_clock)
    checkpoints = straight.out_dir / "checkpoints"
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(checkpoints / "step-000000012.pt", resumed_dir / "checkpoints")
    step_clock.now = 1000.0  # another session: the clock reads anything; the plan follows training seconds
    resumed = make_plan(make_config(*overrides, f"train.out_dir={resumed_dir}"))
    summary = train(resumed, resume="auto", clock=step_clock)
    assert summary["steps"] == 20 and summary["train_s"] == 20.0
    final, resumed_final = (
        _weights(checkpoints / "step-000000020.pt"),
        _weights(resumed_dir / "checkpoints" / "step-000000020.pt"),
    )
    for key in final:
        assert torch.equal(final[key], resumed_final[key]), key
    assert [record["lr"] for record in _train_records(resumed)] == [
        record["lr"] for record in _train_records(straight) if record["step"] > 12
    ]


CURRICULUM = [
    "data.image_size=28",
    "curriculum.start_size=14",
    "curriculum.grow_by=7",
    "curriculum.grow_every_epochs=1",
    "curriculum.batch_rule=constant_tokens",
    "train.epochs=4",
    "checkpoint.keep_last=5",
]


def test_linear_curriculum_changes_size_and_batch_at_the_rule_s_epochs(small_synthetic_overrides, step_clock):
    plan = make_plan(make_config(*small_synthetic_overrides, *CURRICULUM))
    summary = train(plan, clock=step_clock)
    # 96 images per epoch: 14 px at batch 64 (1 step), 21 px at 28 (3 steps), then 28 px at 16 (6 steps);
    # the run is 4 x 96 images long, and the big early batches dropped 32 + 12, so it ends in epoch 4
    expected = [(64, 3, 14, 14)] + [(28, 3, 21, 21)] * 3 + [(16, 3, 28, 28)] * 15
    assert step_clock.shapes == expected
    stages = [record for record in read_jsonl(plan.out_dir / "metrics.jsonl") if record["event"] == "stage"]
    assert [(record["epoch"], record["image_size"], record["batch_size"]) for record in stages] == [
        (0.0, 14, 64),
        (1.0, 21, 28),
        (2.0, 28, 16),
    ]
    assert summary["images_seen"] == 64 + 84 + 2 * 96 + 48 >= 4 * 96
    assert summary["epochs"] == 4.5


def test_fractional_stage_ends_mid_epoch_and_resume_inside_a_stage_is_bitwise(
    small_synthetic_overrides, step_clock, tmp_path
):
    """A stage ending at 30 % of 4 x 96 images switches after 8 steps, in the middle of epoch 1; a run
    resumed from the checkpoint after epoch 1 (inside the 21 px stage) ends with the same weights."""
    overrides = [
        *small_synthetic_overrides,
        "data.image_size=28",
        "train.epochs=4",
        "checkpoint.keep_last=5",
        "curriculum.stages=[{until: 0.3, image_size: 14}, {until: 0.6, image_size: 21, batch_size: 8}]",
    ]
    straight = make_plan(make_config(*overrides))
    train(straight, clock=step_clock)
    sizes = [shape[2] for shape in step_clock.shapes]
    # 14 px until 128 >= 115.2 images; 21 px (batch 8) until 232 >= 230.4; then 28 px to 384 images
    assert sizes == [14] * 8 + [21] * 13 + [28] * 10
    assert [shape[0] for shape in step_clock.shapes] == [16] * 8 + [8] * 13 + [16] * 10
    checkpoints = straight.out_dir / "checkpoints"
    resume_from = sorted(checkpoints.glob("step-*.pt"))[1]  # after epoch 2, inside the 21 px stage
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(resume_from, resumed_dir / "checkpoints")
    step_clock.shapes.clear()
    resumed = make_plan(make_config(*overrides, f"train.out_dir={resumed_dir}"))
    summary = train(resumed, resume="auto", clock=step_clock)
    assert summary["images_seen"] == 392  # the last step passes 384
    final = _weights(sorted(checkpoints.glob("step-*.pt"))[-1])
    resumed_final = _weights(sorted((resumed_dir / "checkpoints").glob("step-*.pt"))[-1])
    for key in final:
        assert torch.equal(final[key], resumed_final[key]), key


def test_data_wait_is_measured_and_counts_as_training_time(small_synthetic_overrides, step_clock, monkeypatch):
    """A loader that takes half a fake second per batch, steps of one: a third of training is data wait,
    and the budget (which includes it) buys two thirds as many steps."""
    from vitrain.data.loader import InMemoryLoader

    original = InMemoryLoader.__iter__

    def slow_batches(self):
        for batch in original(self):
            step_clock.now += 0.5
            yield batch

    monkeypatch.setattr(InMemoryLoader, "__iter__", slow_batches)
    plan = make_plan(make_config(*small_synthetic_overrides, *BUDGET))
    summary = train(plan, clock=step_clock)
    assert summary["steps"] == round(20 / 1.5) + 1  # the step started before 20 s finishes
    assert summary["data_wait_frac"] == pytest.approx(0.5 / 1.5, rel=0.05)
    assert all(record["data_wait_frac"] == pytest.approx(1 / 3) for record in _train_records(plan))
