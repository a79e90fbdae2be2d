"""Fine-tuning from a checkpoint at another resolution and class count."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import make_config
from vitrain.checkpoint import load_checkpoint
from vitrain.cli import main
from vitrain.config import Config, ConfigError
from vitrain.metrics import read_jsonl
from vitrain.models import load_pretrained, resample_pos_embed
from vitrain.train import make_plan, train
from vitrain.train.build import apply_init_from, build_run
from vitrain.train.schedule import scheduled_lr
from vitrain.train.state import TrainState


@pytest.fixture
def pretrained(small_synthetic_overrides, tmp_path):
    """A short 14 px, 10-class run and its last checkpoint."""
    plan = make_plan(make_config(*small_synthetic_overrides, "train.steps=3"))
    train(plan)
    return plan, sorted((plan.out_dir / "checkpoints").glob("step-*.pt"))[-1]


def test_init_from_resamples_position_embeddings_and_renews_the_classifier(
    pretrained, small_synthetic_overrides, tmp_path
):
    _, checkpoint = pretrained
    saved = load_checkpoint(checkpoint)["model"]
    plan = make_plan(
        make_config(
            *small_synthetic_overrides,
            "data.image_size=21",
            "data.synthetic_num_classes=5",
            f"train.init_from={checkpoint}",
            f"train.out_dir={tmp_path / 'ft'}",
        )
    )
    run = build_run(plan)
    fresh_head = run.model.head.weight.detach().clone()
    assert apply_init_from(run, checkpoint) == ["head.weight", "head.bias"]
    weights = run.model.state_dict()
    for key, value in saved.items():
        if key.startswith("head."):
            continue
        expected = resample_pos_embed(value, (3, 3), 1) if key == "pos_embed" else value  # CLS kept apart
        assert torch.equal(weights[key], expected), key
    assert weights["pos_embed"].shape == (1, 1 + 9, saved["pos_embed"].shape[-1])
    assert torch.equal(weights["head.weight"], fresh_head) and fresh_head.shape[0] == 5


def test_finetune_command_trains_from_the_checkpoint(pretrained, tmp_path, capsys):
    _, checkpoint = pretrained
    out_dir = tmp_path / "finetuned"
    argv = ["finetune", "--from", str(checkpoint), "--set", "data.image_size=21", "--set", "train.steps=4"]
    assert main([*argv, "--set", f"train.out_dir={out_dir}"]) == 0
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["recipe"] == "custom_ft"  # the checkpoint's config, renamed
    finetuned = load_checkpoint(out_dir / "checkpoints" / "step-000000004.pt")
    assert finetuned["config"]["data"]["image_size"] == 21
    assert finetuned["config"]["train"]["init_from"] == str(checkpoint)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["final_top1"] is not None


def test_finetune_with_layer_decay_gives_each_layer_the_scheduled_lr_times_its_scale(pretrained, tmp_path):
    """BEiT-style fine-tuning: the head at the scheduled LR, each layer below at 0.65 times the one above."""
    _, checkpoint = pretrained
    out_dir = tmp_path / "decayed"
    settings = ["optim.layer_decay=0.65", "train.steps=3", "train.log_every_steps=1", f"train.out_dir={out_dir}"]
    assert (
        main(["finetune", "--from", str(checkpoint), *[arg for setting in settings for arg in ("--set", setting)]]) == 0
    )
    finetuned = load_checkpoint(out_dir / "checkpoints" / "step-000000003.pt")
    plan = make_plan(Config.model_validate(finetuned["config"]))
    last_lr = scheduled_lr(plan.schedule, TrainState(step=2), 0.0)  # set before the third step (warmup)
    assert 0 < last_lr < plan.schedule.lr
    groups = finetuned["optimizer"]["param_groups"]
    assert sorted({group["lr_scale"] for group in groups}) == pytest.approx([0.65**k for k in range(7, -1, -1)])
    for group in groups:
        assert group["lr"] == pytest.approx(last_lr * group["lr_scale"], rel=1e-12)
    lrs = [record["lr"] for record in read_jsonl(out_dir / "metrics.jsonl") if record["event"] == "train"]
    assert len(lrs) == 3 and lrs[-1] == pytest.approx(last_lr, rel=1e-12)  # the metrics show the head's LR


def test_init_from_another_architecture_is_a_clear_error(pretrained, small_synthetic_overrides, tmp_path):
    _, checkpoint = pretrained
    plan = make_plan(
        make_config(
            *small_synthetic_overrides,
            "model.name=locality_vit_tiny6_patch7",
            f"train.init_from={checkpoint}",
            f"train.out_dir={tmp_path / 'other'}",
        )
    )
    with pytest.raises(ConfigError, match="train.init_from=.*missing: blocks.0.mlp"):
        train(plan)
    with pytest.raises(ConfigError, match="train.init_from=.*no such checkpoint"):
        make_plan(make_config(*small_synthetic_overrides, "train.init_from=/nonexistent/step-1.pt"))


def test_load_pretrained_refuses_a_mismatched_body():
    from vitrain.models import build_model

    small = build_model("vit_tiny6_patch7", img_size=14, in_chans=1, num_classes=3, embed_dim=48)
    wide = build_model("vit_tiny6_patch7", img_size=14, in_chans=1, num_classes=3, embed_dim=96)
    with pytest.raises(ValueError, match=r"shapes differ: cls_token \(1, 1, 96\) vs \(1, 1, 48\), .* and \d+ more$"):
        load_pretrained(small, wide.state_dict())
