"""`vitrain export --format timm`: a timm model folder that timm builds and loads with equal logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import SMALL_SYNTHETIC_RUN, make_config
from vitrain.checkpoint import find_latest_checkpoint
from vitrain.checkpoint.sharded import read_checkpoint_model
from vitrain.cli import main
from vitrain.config import Config, model_overrides
from vitrain.models import build_model, model_spec

timm = pytest.importorskip("timm", reason="timm is a test dependency for parity checks ([dev] extra)")

SYNTHETIC = [*SMALL_SYNTHETIC_RUN, "data.image_size=32", "data.synthetic_num_classes=4"]


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory) -> Path:
    """Two steps of vit_tiny_patch16 at 32 px (global-average-pool head, FFN ratio 2) with a weight EMA."""
    out_dir = tmp_path_factory.mktemp("export") / "run"
    overrides = [*SYNTHETIC, "model.name=vit_tiny_patch16", "model.head=gap", "model.mlp_ratio=2", "optim.lr=1.0"]
    extra = ["train.batch_size=8", "train.steps=2", "train.ema.decay=0.5", f"train.out_dir={out_dir}"]
    assert main(["train", *[item for value in overrides + extra for item in ("--set", value)]]) == 0
    return find_latest_checkpoint(out_dir)


def _handmade_checkpoint(path: Path, *overrides: str) -> Path:
    """A checkpoint file of an untrained model as training would save it (model weights and config)."""
    config = make_config(*SYNTHETIC, *overrides)
    options = model_overrides(config.model, model_spec(config.model.name).args)
    torch.manual_seed(0)
    model = build_model(config.model.name, img_size=config.data.image_size, num_classes=4, **options)
    torch.save({"model": model.state_dict(), "config": config.model_dump(mode="json"), "plan": {}}, path)
    return path


def _vitrain_model(checkpoint: Path, weights: str) -> torch.nn.Module:
    state, info = read_checkpoint_model(checkpoint, weights)
    config = Config.model_validate(info["config"])
    options = model_overrides(config.model, model_spec(config.model.name).args)
    model = build_model(config.model.name, img_size=32, num_classes=4, **options)
    model.load_state_dict(state)
    return model.eval()


def _export(capsys, checkpoint: Path, out: Path, *arguments: str) -> dict:
    assert main(["export", "--checkpoint", str(checkpoint), "--format", "timm", "--out", str(out), *arguments]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _assert_same_logits(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        difference = (ours(images) - theirs.eval()(images)).abs().max().item()
    assert difference <= 1e-5, difference


@pytest.mark.parametrize("weights", ["live", "ema"])
def test_timm_loads_the_export_with_equal_logits(vit_run, tmp_path, capsys, weights):
    result = _export(capsys, vit_run, tmp_path / "timm", "--weights", weights)
    assert result["architecture"] == "vit_tiny_patch16_224" and result["format"] == "timm"
    config = json.loads((tmp_path / "timm" / "config.json").read_text())
    assert config["architecture"] == "vit_tiny_patch16_224" and config["num_classes"] == 4
    assert config["model_args"] == {
        "num_classes": 4,
        "in_chans": 3,
        "img_size": 32,
        "global_pool": "avg",
        "class_token": False,
        "mlp_ratio": 2.0,
    }
    pretrained_cfg = config["pretrained_cfg"]
    assert pretrained_cfg["input_size"] == [3, 32, 32] and pretrained_cfg["classifier"] == "head"
    assert (pretrained_cfg["mean"], pretrained_cfg["std"]) == ([0.5] * 3, [0.25] * 3)
    saved = read_checkpoint_model(vit_run)[1]["config"]
    assert pretrained_cfg["interpolation"] == "bilinear" and pretrained_cfg["crop_pct"] == saved["data"]["crop_pct"]
    assert config["label_names"] == ["class_0", "class_1", "class_2", "class_3"]
    overlay = {"file": str(tmp_path / "timm" / "model.safetensors"), "num_classes": 4}
    theirs = timm.create_model(
        config["architecture"], pretrained=True, pretrained_cfg_overlay=overlay, **config["model_args"]
    )
    ours = _vitrain_model(vit_run, weights)
    _assert_same_logits(ours, theirs)
    _assert_same_logits(ours, timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True))


def test_live_and_ema_exports_differ(vit_run, tmp_path, capsys):
    _export(capsys, vit_run, tmp_path / "live")
    _export(capsys, vit_run, tmp_path / "ema", "--weights", "ema")
    live, ema = (timm.create_model(f"local-dir:{tmp_path / name}", pretrained=True) for name in ("live", "ema"))
    assert not torch.equal(live.head.weight, ema.head.weight)


def test_a_distilled_deit_exports_both_heads(tmp_path, capsys):
    checkpoint = _handmade_checkpoint(
        tmp_path / "step-000000001.pt", "model.name=deit_tiny_distilled_patch16", "model.head=cls"
    )
    _export(capsys, checkpoint, tmp_path / "timm")
    config = json.loads((tmp_path / "timm" / "config.json").read_text())
    assert config["architecture"] == "deit_tiny_distilled_patch16_224"
    assert "class_token" not in config["model_args"] and config["pretrained_cfg"]["classifier"] == ["head", "head_dist"]
    theirs = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True)
    _assert_same_logits(_vitrain_model(checkpoint, "live"), theirs)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["model.name=vit_tiny6_patch7", "data.image_size=28"], "has no timm equivalent"),
        (["model.name=vit_tiny_patch16", "model.aux_head=true"], "no token-labeling head"),
    ],
)
def test_models_without_a_timm_equivalent_are_refused_naming_why(tmp_path, capsys, overrides, reason):
    checkpoint = _handmade_checkpoint(tmp_path / "step-000000001.pt", "model.head=cls", *overrides)
    code = main(["export", "--checkpoint", str(checkpoint), "--format", "timm", "--out", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert code == 2 and reason in error and "--format safetensors" in error
    assert not (tmp_path / "out" / "model.safetensors").exists()
