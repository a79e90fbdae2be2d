"""Fine-tuning from a checkpoint at another resolution and class count."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import SMALL_SYNTHETIC_RUN, make_config
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
    with pytest.raises(ConfigError, match="train.init_weights is for train.init_from=timm:NAME"):
        make_plan(make_config(*small_synthetic_overrides, f"train.init_from={checkpoint}", "train.init_weights=x.pth"))


def test_load_pretrained_refuses_a_mismatched_body():
    from vitrain.models import build_model

    small = build_model("vit_tiny6_patch7", img_size=14, in_chans=1, num_classes=3, embed_dim=48)
    wide = build_model("vit_tiny6_patch7", img_size=14, in_chans=1, num_classes=3, embed_dim=96)
    with pytest.raises(ValueError, match=r"shapes differ: cls_token \(1, 1, 96\) vs \(1, 1, 48\), .* and \d+ more$"):
        load_pretrained(small, wide.state_dict())


def test_finetune_from_an_exported_safetensors_file_and_a_run_folder(pretrained, tmp_path):
    """`vitrain export`'s file and a run folder (its best checkpoint) start fine-tuning like the checkpoint."""
    plan, checkpoint = pretrained
    exported = tmp_path / "model.safetensors"
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(exported)]) == 0
    saved = load_checkpoint(checkpoint)["model"]
    for source in (exported, plan.out_dir):
        out_dir = tmp_path / f"ft-{source.name}"
        argv = ["finetune", "--from", str(source), "--set", "train.steps=1", "--set", "optim.lr=1e-12"]
        assert main([*argv, "--set", "optim.weight_decay=0", "--set", f"train.out_dir={out_dir}"]) == 0
        finetuned = load_checkpoint(out_dir / "checkpoints" / "step-000000001.pt")
        assert finetuned["config"]["recipe"] == "custom_ft"
        for key in ("cls_token", "blocks.0.attn.qkv.weight", "head.weight"):  # one step at lr 1e-12 moves nothing
            torch.testing.assert_close(finetuned["model"][key], saved[key], rtol=0, atol=1e-6)


@pytest.fixture
def timm_weights(tmp_path):
    """timm's vit_tiny_patch16_224 (random weights, 1000 classes) saved as a local safetensors file."""
    timm = pytest.importorskip("timm", reason="timm is a dev dependency: pip install -e '.[dev]'")
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    path = tmp_path / "vit_tiny.safetensors"
    save_file(model.state_dict(), str(path))
    return model.state_dict(), path


def test_finetune_from_timm_weights_sets_the_model_and_loads_them(timm_weights, tmp_path):
    state_dict, path = timm_weights
    out_dir = tmp_path / "from-timm"
    settings = [
        *[s for s in SMALL_SYNTHETIC_RUN if not s.startswith(("model.", "data.image_size"))],
        "data.image_size=32",  # 2x2 patches: the 14x14 position grid resampled
        "train.steps=1",
        "optim.lr=1e-12",
        "optim.weight_decay=0",
        f"train.init_weights={path}",
        f"train.out_dir={out_dir}",
    ]
    argv = ["finetune", "--from", "timm:vit_tiny_patch16_224", "--recipe", "fmnist"]
    assert main([*argv, *[arg for setting in settings for arg in ("--set", setting)]]) == 0
    finetuned = load_checkpoint(out_dir / "checkpoints" / "step-000000001.pt")
    assert finetuned["config"]["model"]["name"] == "vit_tiny_patch16"  # the recipe's model replaced
    assert finetuned["config"]["model"]["stem"] is None and finetuned["config"]["model"]["mlp_ratio"] is None
    weights = finetuned["model"]
    for key in ("cls_token", "patch_embed.proj.weight", "blocks.11.mlp.fc2.weight", "norm.weight"):
        torch.testing.assert_close(weights[key], state_dict[key], rtol=0, atol=1e-6)
    expected_pos = resample_pos_embed(state_dict["pos_embed"], (2, 2), 1)
    torch.testing.assert_close(weights["pos_embed"], expected_pos, rtol=0, atol=1e-6)
    assert weights["head.weight"].shape[0] == 10  # the data's classes: a new classifier


def test_timm_weights_come_from_the_hugging_face_cache(timm_weights, tmp_path, monkeypatch):
    """Without train.init_weights the file the local hub cache holds is used; none there is a clear error."""
    from vitrain.weights.sources import WeightsSourceError, cached_timm_weights, read_init_weights

    state_dict, path = timm_weights
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(WeightsSourceError, match="nothing is downloaded.*train.init_weights"):
        cached_timm_weights("vit_tiny_patch16_224")
    repo = tmp_path / "hub" / "models--timm--vit_tiny_patch16_224.augreg_in21k_ft_in1k"  # timm's default tag
    (repo / "snapshots" / "0123abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    (repo / "snapshots" / "0123abc" / "model.safetensors").write_bytes(path.read_bytes())
    assert cached_timm_weights("vit_tiny_patch16_224") == repo / "snapshots" / "0123abc" / "model.safetensors"
    weights, config = read_init_weights("timm:vit_tiny_patch16_224")
    assert config["model"]["name"] == "vit_tiny_patch16" and config["data"] == {"image_size": 224}
    assert torch.equal(weights["blocks.3.attn.proj.weight"], state_dict["blocks.3.attn.proj.weight"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--from", "timm:vit_tiny_patch16_224"], "timm weights carry no training config; give --recipe"),
        (["--from", "timm:resnet18", "--recipe", "fmnist"], "timm architecture 'resnet18' has no vitrain variant"),
        (
            ["--from", "timm:vit_tiny_patch16_224", "--recipe", "fmnist", "--set", "train.init_weights=/nope.pth"],
            "weights file /nope.pth does not exist",
        ),
    ],
)
def test_finetune_from_timm_refuses_clearly(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    assert main(["finetune", *argv]) == 2
    assert message in capsys.readouterr().err
