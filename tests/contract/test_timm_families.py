"""timm conversion beyond the 224 px variants: other resolutions and patch sizes, DeiT III (LayerScale,
no CLS position embedding) and CLIP-style ViTs (pre-norm, LayerNorm eps 1e-5, QuickGELU)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vitrain.models import build_model
from vitrain.models.flops import model_flops
from vitrain.models.timm_weights import from_timm, timm_hub_config, timm_model_args, timm_name, to_timm

timm = pytest.importorskip("timm", reason="timm is a test dependency for parity checks ([dev] extra)")


def _timm_model(architecture: str, **kwargs) -> torch.nn.Module:
    """A timm model with random weights in eval mode; LayerScale factors and norm weights drawn away from
    their starting values (1e-6 and 1), so that a branch or norm left out would change the logits."""
    torch.manual_seed(0)
    model = timm.create_model(architecture, pretrained=False, **kwargs).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("gamma") or ("norm" in name and name.endswith("weight")):
                parameter.uniform_(0.5, 1.5)
    return model


def _max_difference(ours: torch.nn.Module, theirs: torch.nn.Module, img_size: int, in_chans: int = 3) -> float:
    images = torch.randn(2, in_chans, img_size, img_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (ours.eval()(images) - theirs.eval()(images)).abs().max().item()


# (timm architecture, its size arguments, our variant it converts to, patch size, input size)
OTHER_SIZES = [
    ("vit_small_patch16_384", {}, "vit_small_patch16", 16, 384),
    ("vit_base_patch32_224", {"img_size": 64, "depth": 2}, "vit_base_patch16", 32, 64),
    ("deit_base_patch16_384", {"img_size": 48, "depth": 2}, "deit_base_patch16", 16, 48),
    ("deit3_small_patch16_384", {"img_size": 64, "depth": 2}, "deit3_small_patch16", 16, 64),
    ("vit_base_patch16_clip_384", {"img_size": 48, "depth": 2}, "vit_base_patch16_clip", 16, 48),
    ("vit_large_patch14_clip_336", {"img_size": 28, "depth": 1}, "vit_large_patch14_clip", 14, 28),
]


@pytest.mark.parametrize(("architecture", "size", "variant", "patch", "img_size"), OTHER_SIZES)
def test_timm_models_at_other_resolutions_and_patches_convert_exactly(architecture, size, variant, patch, img_size):
    reference = _timm_model(architecture, num_classes=5, **size)
    model = from_timm(reference, **({"depth": size["depth"]} if "depth" in size else {}))
    assert model.args.patch_size == patch and model.args.img_size == img_size and model.args.num_classes == 5
    expected = {**size, "img_size": img_size, "patch_size": patch, "num_classes": 5}
    assert model.args == build_model(variant, device="meta", **expected).args
    assert _max_difference(model, reference, img_size) <= 1e-4


def test_volo_at_384_converts_to_its_224_variant():
    reference = _timm_model("volo_d1_384", num_classes=5, img_size=64)
    model = from_timm(reference)
    assert (model.args.img_size, model.args.num_classes) == (64, 5)
    assert _max_difference(model, reference, 64) <= 1e-4


def test_state_dict_with_another_patch_size_converts_by_name():
    reference = _timm_model("vit_small_patch16_224", patch_size=8, img_size=32, depth=2, num_classes=3)
    model = from_timm(reference.state_dict(), name="vit_small_patch16", depth=2)
    assert (model.args.patch_size, model.args.img_size, model.grid) == (8, 32, (4, 4))
    assert _max_difference(model, reference, 32) <= 1e-4


def test_deit3_equals_timm_both_ways():
    reference = _timm_model("deit3_small_patch16_224", img_size=64, num_classes=5)
    model = from_timm(reference)
    assert model.args.layer_scale is not None and not model.args.pos_embed_class
    assert model.pos_embed.shape[1] == 16  # the 4x4 patches only: no entry for the CLS token
    assert _max_difference(model, reference, 64) <= 1e-4
    with torch.no_grad():  # train a little apart, then back to timm: the copy must hold every change
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    kwargs = timm_model_args("deit3_small_patch16", model)
    back = timm.create_model(timm_name("deit3_small_patch16"), pretrained=False, **kwargs).eval()
    back.load_state_dict(to_timm(model), strict=True)
    assert _max_difference(model, back, 64) <= 1e-4


@pytest.mark.parametrize("variant", ["vit_base_patch16_clip", "vit_base_patch16_clip_quickgelu"])
def test_clip_towers_equal_timm_both_ways(variant):
    reference = _timm_model(timm_name(variant), img_size=32, depth=2, num_classes=4)
    model = from_timm(reference, depth=2)
    assert model.args.pre_norm and model.args.norm_eps == 1e-5 and model.patch_embed.proj.bias is None
    assert _max_difference(model, reference, 32) <= 1e-4
    back = timm.create_model(timm_name(variant), pretrained=False, img_size=32, depth=2, num_classes=4).eval()
    back.load_state_dict(to_timm(model), strict=True)
    assert _max_difference(model, back, 32) <= 1e-4


def test_quickgelu_weights_in_a_gelu_variant_are_refused():
    reference = _timm_model("vit_base_patch16_clip_quickgelu_224", img_size=32, depth=1, num_classes=2)
    with pytest.raises(ValueError, match="act='quick_gelu'"):
        from_timm(reference, name="vit_base_patch16_clip", depth=1)


def test_what_the_weights_do_not_show_is_checked_on_the_timm_model():
    reference = _timm_model("vit_small_patch16_224", img_size=32, depth=1, num_heads=4, num_classes=2)
    with pytest.raises(ValueError, match="num_heads=4"):
        from_timm(reference, depth=1)
    assert from_timm(reference, depth=1, num_heads=4).args.num_heads == 4


def test_structures_that_differ_are_refused_with_what_differs():
    deit3 = _timm_model("deit3_small_patch16_224", img_size=32, depth=1, num_classes=2).state_dict()
    with pytest.raises(ValueError, match="pos_embed_class=False"):
        from_timm(deit3, name="vit_small_patch16", depth=1)
    with pytest.raises(ValueError, match="ls1.gamma"):  # the layout given, LayerScale still missing
        from_timm(deit3, name="vit_small_patch16", depth=1, pos_embed_class=False)
    plain = _timm_model("vit_small_patch16_224", img_size=32, depth=2, num_classes=2).state_dict()
    with pytest.raises(ValueError, match="blocks.1"):
        from_timm(plain, name="vit_small_patch16", depth=1)
    with pytest.raises(ValueError, match="norm_pre"):
        from_timm(plain, name="vit_base_patch16_clip", depth=2, embed_dim=384, num_heads=6)


def test_timm_architectures_without_a_variant_are_refused_by_name():
    with torch.device("meta"):
        medium = timm.create_model("vit_medium_patch16_clip_224", pretrained=False, depth=1)
    with pytest.raises(ValueError, match="'vit_medium_patch16_clip_224' has no vitrain variant"):
        from_timm(medium)


@pytest.mark.parametrize("variant", ["deit3_small_patch16", "vit_base_patch32_clip_quickgelu"])
def test_export_config_builds_the_same_timm_model(variant):
    model = build_model(variant, device="meta", img_size=64, num_classes=3)
    config = timm_hub_config(variant, model, mean=(0.5,) * 3, std=(0.5,) * 3, crop_pct=1.0)
    assert config["architecture"] == timm_name(variant) and config["model_args"]["img_size"] == 64


def test_deit3_options_on_a_plain_variant_export_as_timm_arguments():
    model = build_model("vit_small_patch16", device="meta", layer_scale=1e-6, pos_embed_class=False)
    assert timm_model_args("vit_small_patch16", model) | {"init_values": 1e-6, "no_embed_class": True} == (
        timm_model_args("vit_small_patch16", model)
    )
    with torch.device("meta"):
        theirs = timm.create_model("vit_small_patch16_224", **timm_model_args("vit_small_patch16", model))
    assert {k: v.shape for k, v in theirs.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="norm_eps"):
        timm_model_args("vit_small_patch16", build_model("vit_small_patch16", device="meta", norm_eps=1e-5))


@pytest.mark.parametrize(
    ("variant", "img_size", "published_gmacs"),
    # DeiT III README_revenge.md model zoo, "GFLOPs" column (multiply-adds) at 224 px
    [("deit3_small_patch16", 224, 4.6), ("deit3_base_patch16", 224, 17.5), ("vit_base_patch32_clip", 224, 4.4)],
)
def test_flops_count_layer_scale_and_pre_norm_models(variant, img_size, published_gmacs):
    model = build_model(variant, device="meta", attn_impl="matmul")
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 3, img_size, img_size, device="meta"))
    measured = counter.get_total_flops()
    assert abs(model_flops(model, img_size) - measured) <= 0.05 * measured
    assert abs(model_flops(model, img_size) / 2e9 - published_gmacs) <= 0.15


@pytest.mark.parametrize("variant", ["deit3_small_patch16", "vit_base_patch16_clip_quickgelu"])
def test_kernel_converted_models_keep_layer_scale_and_quickgelu(variant):
    """The fused-kernel converter (``vitrain.kernels.convert``) swaps the block stack for one that runs the
    blocks piece by piece, and the FFN for the fused GELU one: both must keep LayerScale and QuickGELU. In
    float32 the fused ops fall back to PyTorch's, so the converted model equals the plain one exactly."""
    from vitrain import kernels

    torch.manual_seed(0)
    plain = build_model(variant, img_size=32, depth=2, num_classes=3).eval()
    with torch.no_grad():
        for name, parameter in plain.named_parameters():
            if name.endswith("gamma"):
                parameter.uniform_(0.5, 1.5)
    converted = build_model(variant, img_size=32, depth=2, num_classes=3).eval()
    converted.load_state_dict(plain.state_dict())
    assert kernels.convert(converted) > 0
    assert _max_difference(converted, plain, 32) == 0.0


def test_deit3_variants_are_timms_sizes_with_deit3s_training_choices():
    for size, drop_path in (("small", 0.05), ("base", 0.2), ("large", 0.45)):
        ours = build_model(f"deit3_{size}_patch16", device="meta")
        with torch.device("meta"):
            theirs = timm.create_model(f"deit3_{size}_patch16_224", pretrained=False)
        assert {k: v.shape for k, v in ours.state_dict().items()} == {
            k: v.shape for k, v in theirs.state_dict().items()
        }
        assert ours.args.num_heads == theirs.blocks[0].attn.num_heads
        # README_revenge.md's --drop-path, the same in every block (models_v2.py)
        assert [block.drop_path1.rate for block in ours.blocks] == [drop_path] * ours.args.depth
    linear = build_model("vit_small_patch16", device="meta", drop_path_rate=0.1)
    assert linear.blocks[0].drop_path1.rate == 0.0 and linear.blocks[-1].drop_path1.rate == pytest.approx(0.1)


def test_patch_size_is_read_from_either_stem():
    from vitrain.models.timm_weights import inferred_model_args

    conv = build_model("vit_tiny6_convstem_patch8", patch_size=4, img_size=16, depth=1).state_dict()
    assert {key: inferred_model_args(conv, "vit_tiny6_convstem_patch8")[key] for key in ("patch_size", "img_size")} == {
        "patch_size": 4,
        "img_size": 16,
    }
    patchify = build_model("vit_tiny_patch16", patch_size=4, img_size=24, depth=1).state_dict()
    assert inferred_model_args(patchify, "vit_tiny_patch16")["img_size"] == 24
