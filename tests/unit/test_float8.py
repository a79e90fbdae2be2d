"""precision=fp8 in torchao's CPU emulation: which layers run in FP8, their numerics against bf16, a short
run tracking bf16's loss, checkpoints a plain model loads, the refusals, and MFU counted honestly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import SMALL_SYNTHETIC_RUN, make_config
from vitrain.config import ConfigError, DatasetInfo, Hardware, resolve
from vitrain.kernels import float8
from vitrain.metrics import read_jsonl
from vitrain.metrics.peak import PeakFlops, cuda_peak, fp8_weighted_peak
from vitrain.models import build_model, model_facts
from vitrain.models.flops import model_flops

pytest.importorskip("torchao", reason="precision=fp8 needs torchao (the dev extra installs it)")


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    reference, approximation = reference.detach().double(), approximation.detach().double()
    return 10 * math.log10(reference.pow(2).sum() / (reference - approximation).pow(2).sum())


def test_the_blocks_linears_convert_and_the_embedding_and_head_do_not():
    model = build_model("vit_tiny_patch16", img_size=32, num_classes=10)
    names = float8.convert(model, "tensorwise", emulate=True)
    expected = {f"blocks.{i}.{layer}" for i in range(12) for layer in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    assert set(names) == expected
    converted = {name for name, module in model.named_modules() if float8.is_float8(module)}
    assert converted == expected
    assert type(model.head) is nn.Linear and type(model.patch_embed.proj) is nn.Conv2d


def test_layers_whose_sides_are_not_multiples_of_16_stay_bf16():
    model = build_model("vit_tiny6_patch7", img_size=14, in_chans=1, num_classes=4, embed_dim=36)
    assert float8.selected_linears(model) == []  # width 36: FP8 products need multiples of 16
    volo = build_model("volo_d1", img_size=64, num_classes=10)
    selected = dict(float8.selected_linears(volo))
    assert selected and all(m.in_features % 16 == 0 and m.out_features % 16 == 0 for m in selected.values())
    assert not any("attn.attn" in name for name in selected)  # outlook's 6*3^4 = 486 outputs


@pytest.mark.parametrize("scaling", float8.SCALINGS)
def test_each_fp8_layer_tracks_bf16_forward_and_backward(scaling):
    """Per layer of a ViT-S-width model: FP8 output and input gradient within e4m3/e5m2's noise of bf16."""
    torch.manual_seed(0)
    reference = build_model("vit_small_patch16", img_size=32, num_classes=10).to(torch.bfloat16)
    converted = build_model("vit_small_patch16", img_size=32, num_classes=10).to(torch.bfloat16)
    converted.load_state_dict(reference.state_dict())
    float8.convert(converted, scaling, emulate=True)
    layers = dict(converted.named_modules())
    for name, plain in float8.selected_linears(reference)[:8]:
        x = torch.randn(64, plain.in_features, dtype=torch.bfloat16, requires_grad=True)
        x8 = x.detach().clone().requires_grad_()
        out, out8 = plain(x), layers[name](x8)
        grad = torch.randn_like(out)
        out.backward(grad)
        out8.backward(grad)
        assert sqnr_db(out, out8) > 24, (name, sqnr_db(out, out8))
        assert sqnr_db(x.grad, x8.grad) > 20, (name, sqnr_db(x.grad, x8.grad))
        assert sqnr_db(plain.weight.grad, layers[name].weight.grad) > 20, name


def _short_run(tmp_path, precision: str) -> tuple[list[float], Path]:
    """The tiny synthetic run of the loop tests (3 epochs, 18 steps) in bf16 O2 or fp8 O2: its losses and folder."""
    from vitrain.train import make_plan, train

    overrides = [*SMALL_SYNTHETIC_RUN, "train.epochs=3", "train.log_every_steps=1", "performance.cpu_kernels=native"]
    overrides += [f"precision={precision}", "precision_mode=o2", f"train.out_dir={tmp_path / precision}"]
    plan = make_plan(make_config(*overrides))
    summary = train(plan)
    assert summary["precision"] == precision
    assert ("mean_mfu_bf16_equivalent" in summary) == (precision == "fp8")
    losses = [record["loss"] for record in read_jsonl(plan.out_dir / "metrics.jsonl") if record["event"] == "train"]
    return losses, plan.out_dir


def test_a_short_fp8_run_tracks_the_bf16_loss_and_a_plain_model_loads_its_checkpoint(tmp_path):
    from vitrain.checkpoint import find_latest_checkpoint, load_checkpoint

    bf16, _ = _short_run(tmp_path, "bf16")
    fp8, out = _short_run(tmp_path, "fp8")
    assert fp8[-1] < 0.7 * fp8[0] and bf16[-1] < 0.7 * bf16[0]  # both learn
    # per 3 steps: a single step's loss is one small batch, which rounding moves by 14 % (AVX2-only EPYC)
    windows = [(sum(bf16[i : i + 3]), sum(fp8[i : i + 3])) for i in range(0, len(bf16), 3)]
    assert len(bf16) == len(fp8) and all(abs(a - b) < 0.1 * a for a, b in windows), (bf16, fp8)
    weights = load_checkpoint(find_latest_checkpoint(out))["model"]
    plain = build_model("vit_tiny6_patch7", img_size=14, num_classes=10)
    plain.load_state_dict(weights)  # Float8Linear keeps nn.Linear's keys and shapes
    assert all(tensor.dtype == torch.float32 for tensor in weights.values())


CPU = Hardware(cuda_available=False, bf16_supported=True, bf16_emulated=True)
DATA = DatasetInfo(num_train=60000, num_eval=10000, num_classes=10, channels=3, mean=(0.5,) * 3, std=(0.5,) * 3)


def _resolve(hardware: Hardware, *overrides: str):
    return resolve(make_config("data.name=synthetic", *overrides), DATA, hardware, model_facts)


def test_fp8_is_refused_on_gpus_without_fp8_tensor_cores():
    a100 = Hardware(cuda_available=True, bf16_supported=True, cuda_capability=(8, 0))
    with pytest.raises(ConfigError, match=r"compute capability 8\.9\+.*this GPU has 8\.0; use precision=bf16"):
        _resolve(a100, "precision=fp8", "train.device=cuda")
    h100 = Hardware(cuda_available=True, bf16_supported=True, cuda_capability=(9, 0))
    plan = _resolve(h100, "precision=fp8", "train.device=cuda", "performance.fp8_scaling=rowwise")
    assert plan.precision.name == "fp8" and plan.precision.dtype == "bf16" and plan.precision.fp8_scaling == "rowwise"


def test_fp8_without_torchao_names_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install 'vitrain\[fp8\]'"):
        _resolve(CPU, "precision=fp8")


def test_the_fp8_share_counts_the_blocks_linears():
    """ViT-B/16 at 224 px: 12 blocks of 24·N·d² linear FLOPs (qkv, proj, fc1, fc2) over the model's FLOPs."""
    model = build_model("vit_base_patch16", device="meta")
    total = model_flops(model, 224)
    tokens, width = 197, 768
    assert float8.fp8_flop_share(model, 224, 3, total) == pytest.approx(12 * 24 * tokens * width**2 / total)


def test_mfu_divides_by_the_flop_weighted_peak():
    bf16, fp8 = cuda_peak("NVIDIA H200", "bf16"), cuda_peak("NVIDIA H200", "fp8")
    assert (bf16.tflops, fp8.tflops) == (989.4, 1978.9)
    mixed = fp8_weighted_peak(bf16, fp8, 0.9)
    assert 0.1 / bf16.tflops + 0.9 / fp8.tflops == pytest.approx(1 / mixed.tflops)  # time at each peak, summed
    assert fp8_weighted_peak(bf16, fp8, 0.0).tflops == pytest.approx(bf16.tflops)
    assert "90.0 % of the FLOPs" in mixed.source
    a100 = cuda_peak("NVIDIA A100-SXM4-80GB", "fp8")
    assert a100.tflops is None and "no fp8" in a100.source
    assert fp8_weighted_peak(cuda_peak("NVIDIA A100-SXM4-80GB", "bf16"), a100, 0.9) == a100
    assert fp8_weighted_peak(PeakFlops(None, "unknown"), fp8, 0.5).source == "unknown"


def test_bench_reports_fp8_mfu_and_its_bf16_equivalent(tmp_path, capsys):
    import json

    from vitrain.cli import main

    out = tmp_path / "fp8.json"
    argv = ["bench", "--model", "vit_tiny_patch16", "--image-size", "32", "--batch", "4", "--precision", "fp8"]
    argv += ["--precision-mode", "o2", "--steps", "1", "--warmup", "1", "--repeats", "1", "--json", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["precision"] == "fp8"
    assert record["mfu_bf16_equivalent"] is not None and record["mfu"] is not None  # CPU: one measured peak
