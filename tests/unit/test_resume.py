"""Exact resume from any step: a run that saves a checkpoint after every step, then resumed from
several of them (mid-epoch, at an epoch end, around curriculum stage changes, inside a wall-clock
budget with an injected clock, with fp16 loss scaling), ends bitwise equal to the uninterrupted run:
weights, optimizer state, loss scaler and loop counters."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import assert_same_training_state, make_config
from vitrain.checkpoint import find_best_checkpoint, find_latest_checkpoint, load_checkpoint
from vitrain.metrics import read_jsonl
from vitrain.train import make_plan, train

pytestmark = pytest.mark.usefixtures("one_thread")


SCENARIOS = {
    # 3 epochs of 6 steps, dropout and stochastic depth (RNG state), resumed mid-epoch and at epoch ends
    "epochs": (["model.drop_rate=0.1", "model.drop_path_rate=0.1"], [11, 12, 13]),
    # DeiT III's data recipe: per-image RandAugment, 3-Augment and color jitter (seeded from Python's and
    # NumPy's generators too), each image three times per epoch; resumed mid-epoch
    "augment": (
        [
            "data.randaugment=rand-m9-mstd0.5-inc1",
            "data.three_augment=true",
            "data.color_jitter=0.3",
            "data.repeated_aug=3",
            "train.epochs=2",
        ],
        [9],
    ),
    # fp16 loss scaling: the scaler's scale and growth tracker are part of the state
    "fp16": (["precision=fp16", "train.epochs=2"], [9]),
    # Muon's momentum buffers beside the AdamW moments of the other parameters, resumed mid-epoch
    "muon": (["optim.name=muon", "train.epochs=2"], [9]),
    # LAMB's per-tensor step counts and moments (multi-tensor update), resumed mid-epoch
    "lamb": (["optim.name=lamb", "train.epochs=2"], [9]),
    # layer-wise LR decay: a group per layer and weight-decay kind, each with its LR scale
    "layer-decay": (["optim.layer_decay=0.75", "train.epochs=2"], [9]),
    # explicit stages ending mid-epoch at steps 8 (14 -> 21 px) and 21 (21 -> 28 px, batch 8 -> 16)
    "curriculum": (
        [
            "data.image_size=28",
            "train.epochs=4",
            "curriculum.stages=[{until: 0.3, image_size: 14}, {until: 0.6, image_size: 21, batch_size: 8}]",
        ],
        [8, 21],
    ),
    # the linear rule at epoch ends with constant-token batches 64, 28, 16 (stages end at steps 1 and 4)
    "linear-curriculum": (
        [
            "data.image_size=28",
            "train.epochs=3",
            "curriculum.start_size=14",
            "curriculum.grow_by=7",
            "curriculum.grow_every_epochs=1",
            "curriculum.batch_rule=constant_tokens",
        ],
        [1, 4],
    ),
    # a 20 s training budget, one fake second per step: LR and stop follow the restored training seconds
    "budget": (["train.budget=20s", "schedule.warmup_epochs=0", "schedule.min_lr_ratio=0.1"], [6, 13]),
}


def _resume_from(checkpoint, overrides, folder, clock):
    (folder / "checkpoints").mkdir(parents=True)
    shutil.copy(checkpoint, folder / "checkpoints")
    if clock is not None:
        clock.now = 1000.0  # another session: the clock reads anything; the run follows its training seconds
    plan = make_plan(make_config(*overrides, f"train.out_dir={folder}"))
    train(plan, resume="auto", **({"clock": clock} if clock else {}))
    return find_latest_checkpoint(folder)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_resume_from_any_step_ends_bitwise_equal(small_synthetic_overrides, tmp_path, request, scenario):
    extra, resume_steps = SCENARIOS[scenario]
    clock = request.getfixturevalue("step_clock") if scenario == "budget" else None
    overrides = [*small_synthetic_overrides, *extra, "train.log_every_steps=3"]
    straight = make_plan(make_config(*overrides, "checkpoint.every_steps=1", "checkpoint.keep_last=1000"))
    train(straight, **({"clock": clock} if clock else {}))
    checkpoints = straight.out_dir / "checkpoints"
    final = find_latest_checkpoint(straight.out_dir)
    for step in resume_steps:
        # the resumed run saves at epoch ends only: the checkpoint cadence must not matter either
        resumed_final = _resume_from(checkpoints / f"step-{step:09d}.pt", overrides, tmp_path / f"from-{step}", clock)
        assert resumed_final.name == final.name, step
        assert_same_training_state(resumed_final, final)


def test_checkpoints_by_step_cadence_and_the_best_one_is_kept(small_synthetic_overrides):
    """Every 4 steps and every epoch (6 steps) over 18 steps; keep_last 2 plus the best evaluated one."""
    plan = make_plan(make_config(*small_synthetic_overrides, "checkpoint.every_steps=4", "checkpoint.keep_last=2"))
    train(plan)
    records = read_jsonl(plan.out_dir / "metrics.jsonl")
    evals = {record["step"]: record["top1"] for record in records if record["event"] == "eval"}
    assert list(evals) == [6, 12, 18]
    best_step = max(evals, key=lambda step: (evals[step], -step))  # the first of equal accuracies
    kept = sorted(path.name for path in (plan.out_dir / "checkpoints").glob("step-*.pt"))
    assert kept == sorted({f"step-{step:09d}.pt" for step in (16, 18, best_step)})
    best = find_best_checkpoint(plan.out_dir)
    assert best.name == f"step-{best_step:09d}.pt"
    assert load_checkpoint(best)["state"]["last_eval"]["top1"] == evals[best_step]
    train_steps = [record["step"] for record in records if record["event"] == "train"]
    assert {4, 8, 16} <= set(train_steps)  # a checkpoint closes the metrics window (one sync)


def test_checkpoints_by_wall_clock_minutes(small_synthetic_overrides, step_clock):
    """every_minutes=0.05 (3 s) with one fake second per step and no epoch checkpoints: steps 3, 6, ..."""
    overrides = ["checkpoint.every_minutes=0.05", "checkpoint.every_epochs=0", "checkpoint.keep_last=100"]
    plan = make_plan(make_config(*small_synthetic_overrides, *overrides))
    train(plan, clock=step_clock)
    saved = sorted(int(path.name[5:14]) for path in (plan.out_dir / "checkpoints").glob("step-*.pt"))
    assert saved == [3, 6, 9, 12, 15, 18]
