"""`vitrain export --format onnx`: one file with a free batch size whose onnxruntime logits equal PyTorch's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import SMALL_SYNTHETIC_RUN, make_config
from vitrain.cli import main
from vitrain.config import model_overrides
from vitrain.data import describe_source
from vitrain.export import onnx as onnx_export
from vitrain.models import build_model, model_spec

onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime checks the export ([onnx] and [dev] extras)")
pytest.importorskip("onnxscript", reason="torch's dynamo ONNX exporter needs onnxscript ([onnx] and [dev] extras)")

SIZE = 32
FAMILIES = {
    # the smallest variant of each family, cut to a few blocks; ViT with token labeling's auxiliary head
    # and the explicit-matmul attention a run may have chosen (the export swaps in SDPA)
    "vit": ("vit_tiny_patch16", {"depth": 2, "aux_head": True, "attn_impl": "matmul"}),
    "localvit": ("localvit_tiny_patch16", {"depth": 2}),
    "volo": ("volo_d1", {"layers": (1, 1, 1, 1)}),  # outlookers, transformer, class attention, aux head
    "resnet": ("resnet50", {}),
    "deit_distilled": ("deit_tiny_distilled_patch16", {"depth": 2}),  # the mean of both heads
    "convstem_locality_gap": ("vit_tiny6_convstem_patch8", {"depth": 2, "ffn": "locality", "head": "gap"}),
}


def _randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every float tensor of the model (weights and BatchNorm statistics) moved off its initialization,
    so that zero-initialized residual scales and unit statistics do not hide a wrong graph."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator))
    return model.eval()


def _session(path: Path):
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _onnx_logits(session, images: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(session.run(["logits"], {"images": images.numpy()})[0])


def _token_labeling_logits(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """What predict and eval use with an auxiliary head: class logits + 0.5 x the max over patches of the aux ones."""
    cls_logits, aux_logits = model.forward_head_with_tokens(model.forward_features(images))
    return cls_logits + 0.5 * aux_logits.amax(dim=1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_onnxruntime_matches_pytorch_at_batch_1_and_3_from_one_file(tmp_path, family):
    name, options = FAMILIES[family]
    model = build_model(name, img_size=SIZE, num_classes=4, **options)
    model.init_weights()
    model = _randomized(model)
    metadata = onnx_export.transform_metadata(name, (3, SIZE, SIZE), (0.5,) * 3, (0.25,) * 3, 0.875, None)
    result = onnx_export.export_onnx_model(model, tmp_path / "model.onnx", (3, SIZE, SIZE), metadata)
    assert result["opset"] >= 18 and result["max_abs_diff"] <= 1e-4
    assert result["inputs"] == [{"name": "images", "shape": ["batch", 3, SIZE, SIZE], "type": "tensor(float)"}]
    assert result["outputs"] == [{"name": "logits", "shape": ["batch", 4], "type": "tensor(float)"}]
    assert all(module.impl == "sdpa" for module in model.modules() if hasattr(module, "core"))
    session = _session(tmp_path / "model.onnx")
    generator = torch.Generator().manual_seed(7)
    for batch in (1, 3):
        images = torch.randn(batch, 3, SIZE, SIZE, generator=generator)
        with torch.no_grad():
            expected = _token_labeling_logits(model, images) if family in ("vit", "volo") else model(images)
        ours = _onnx_logits(session, images)
        assert ours.shape == (batch, 4)
        assert (ours - expected).abs().max().item() <= 1e-4


SYNTHETIC = [*SMALL_SYNTHETIC_RUN, "data.synthetic_num_classes=4"]


def _handmade_checkpoint(path: Path) -> Path:
    """A checkpoint file as training saves it (config, live weights, a weight EMA that differs from them)."""
    config = make_config(*SYNTHETIC, "model.attn_impl=matmul")
    options = model_overrides(config.model, model_spec(config.model.name).args)
    torch.manual_seed(0)
    model = build_model(config.model.name, img_size=config.data.image_size, num_classes=4, **options)
    live, ema = (
        {key: value.clone() for key, value in _randomized(model, seed).state_dict().items()} for seed in (1, 2)
    )
    torch.save({"model": live, "ema": ema, "config": config.model_dump(mode="json"), "plan": {}}, path)
    return path


def _export(capsys, checkpoint: Path, out: Path, *arguments: str) -> tuple[int, str, str]:
    code = main(["export", "--checkpoint", str(checkpoint), "--format", "onnx", "--out", str(out), *arguments])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _handmade_checkpoint(tmp_path_factory.mktemp("onnx") / "step-000000001.pt")


def test_torch_2_8_and_2_9_export_with_the_fake_tensor_cache_off_and_the_file_still_matches(tmp_path, monkeypatch):
    """On torch 2.8 and 2.9 VOLO's export fails with the fake-tensor dispatch cache on (the test above,
    run there); the export turns it off on those releases only. The file exported that way, here on
    whatever torch runs the suite, still gives PyTorch's logits."""
    versions = ("2.8.0+cu128", "2.9.1", "2.10.0", "2.14.1+cu130", "2.10.0a0+git1234")
    assert [onnx_export.fake_tensor_cache_exports(version) for version in versions] == [False, False, True, True, True]
    seen = []
    export = torch.onnx.export

    def spy(*args, **kwargs):
        seen.append(torch._dynamo.config.fake_tensor_cache_enabled)
        return export(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", spy)
    monkeypatch.setattr(onnx_export, "fake_tensor_cache_exports", lambda version: False)
    name, options = FAMILIES["volo"]
    model = _randomized(build_model(name, img_size=SIZE, num_classes=4, **options))
    metadata = onnx_export.transform_metadata(name, (3, SIZE, SIZE), (0.5,) * 3, (0.25,) * 3, 0.875, None)
    result = onnx_export.export_onnx_model(model, tmp_path / "model.onnx", (3, SIZE, SIZE), metadata)
    assert seen == [False] and torch._dynamo.config.fake_tensor_cache_enabled
    assert result["max_abs_diff"] <= 1e-4


def test_the_cli_exports_live_and_ema_weights_with_the_transform_in_the_metadata(checkpoint, tmp_path, capsys):
    payload = torch.load(checkpoint, weights_only=True)
    config = make_config(*SYNTHETIC)
    options = model_overrides(config.model, model_spec(config.model.name).args)
    model = build_model(config.model.name, img_size=config.data.image_size, num_classes=4, **options).eval()
    source, side = describe_source(config.data), config.data.image_size
    images = torch.randn(3, source.channels, side, side, generator=torch.Generator().manual_seed(3))
    logits = {}
    for weights, key in (("live", "model"), ("ema", "ema")):
        code, out, _ = _export(capsys, checkpoint, tmp_path / f"{weights}.onnx", "--weights", weights)
        result = json.loads(out.strip().splitlines()[-1])
        assert code == 0 and result["format"] == "onnx" and result["weights"] == weights
        assert result["max_abs_diff"] <= 1e-4 and result["opset"] >= 18
        assert result["inputs"][0]["shape"] == ["batch", *images.shape[1:]]
        session = _session(tmp_path / f"{weights}.onnx")
        model.load_state_dict(payload[key])
        logits[weights] = _onnx_logits(session, images)
        with torch.no_grad():
            assert (logits[weights] - model(images)).abs().max().item() <= 1e-4
    assert (logits["live"] - logits["ema"]).abs().max().item() > 1e-3  # the EMA's own weights, not the live ones
    metadata = session.get_modelmeta().custom_metadata_map
    assert json.loads(metadata["mean"]) == list(source.mean) and json.loads(metadata["std"]) == list(source.std)
    assert json.loads(metadata["input_size"]) == list(images.shape[1:]) and metadata["weights"] == "ema"
    assert float(metadata["crop_pct"]) == config.data.crop_pct and metadata["model"] == config.model.name
    assert json.loads(metadata["class_names"]) == [f"class_{index}" for index in range(4)]


@pytest.mark.parametrize("package", ["onnx", "onnxscript", "onnxruntime"])
def test_a_missing_package_names_the_extra_and_exits_2(checkpoint, tmp_path, capsys, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    code, _, err = _export(capsys, checkpoint, tmp_path / "model.onnx")
    assert code == 2 and package in err and "pip install 'vitrain[onnx]'" in err
    assert not (tmp_path / "model.onnx").exists()


def test_an_export_whose_logits_differ_is_removed_and_exits_2(checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(onnx_export, "MAX_ABS_DIFF", -1.0)  # any difference, even none, is too large
    code, _, err = _export(capsys, checkpoint, tmp_path / "model.onnx")
    assert code == 2 and "differ from PyTorch's" in err
    assert not (tmp_path / "model.onnx").exists()
