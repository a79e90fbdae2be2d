"""Analytic FLOPs against torch's measured count (FlopCounterMode), which MFU relies on."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vitrain.models import build_model
from vitrain.models.flops import model_flops


def _measured_flops(model: torch.nn.Module, img_size: int) -> int:
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(1, model.args.in_chans, img_size, img_size, device="meta"))
    return counter.get_total_flops()


# matmul attention: FlopCounterMode does not count the CPU SDPA kernel.
@pytest.mark.parametrize(
    ("name", "img_size", "overrides"),
    [
        ("vit_tiny_patch16", 224, {}),
        ("vit_small_patch16", 224, {"head": "gap"}),
        ("vit_base_patch16", 96, {}),
        ("locality_vit_tiny_patch16", 224, {}),
        ("locality_vit_tiny6_patch7", 28, {"head": "gap", "in_chans": 1, "num_classes": 10}),
        ("vit_giant_patch14", 28, {"depth": 2}),
        ("vit_tiny_patch16", 224, {"stem": "conv"}),
        ("deit_tiny_distilled_patch16", 32, {}),  # 6 tokens of which 2 prefix: the extra token shows
        ("localvit_tiny6_patch7", 32, {"stem": "conv", "patch_size": 8, "in_chans": 1, "head": "gap"}),
    ],
)
def test_vit_flops_match_measured_count(name, img_size, overrides):
    model = build_model(name, device="meta", img_size=img_size, attn_impl="matmul", **overrides)
    measured = _measured_flops(model, img_size)
    assert abs(model_flops(model, img_size) - measured) <= 0.05 * measured


def test_vit_b16_flops_at_224_is_the_published_17_6_gmacs():
    flops = model_flops(build_model("vit_base_patch16", device="meta"), 224)
    assert abs(flops / 2e9 - 17.6) < 0.1


def test_flops_scale_with_resolution_and_reject_unknown_models():
    model = build_model("vit_tiny_patch16", device="meta")
    assert model_flops(model, 448) > 4 * model_flops(model, 224)  # 4x tokens, attention superlinear
    with pytest.raises(TypeError, match="no analytic FLOPs"):
        model_flops(torch.nn.Linear(2, 2), 224)
