"""VOLO (Yuan et al. 2021): timm parity, published sizes, the model protocol, analytic FLOPs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from vitrain.models.volo import (
    VOLO,
    VOLO_TINY_PATCH4,
    VOLO_VARIANTS,
    ClassAttention,
    ClassBlock,
    Downsample,
    OutlookAttention,
    ScaledSoftmax,
    VOLOArgs,
    volo_flops,
)

# The published layout (outlookers, downsample, three transformer stages, two class-attention
# blocks, auxiliary head) at a few channels of width: builds and runs in milliseconds.
SMALL = VOLOArgs(
    layers=(2, 1, 2, 1),
    embed_dims=(16, 32, 32, 32),
    num_heads=(2, 4, 4, 4),
    stem_hidden_dim=8,
    img_size=64,
    num_classes=10,
)
# Yuan et al. 2021, Table 1, "Params" column (millions).
PAPER_MILLIONS = {"volo_d1": 26.6, "volo_d2": 58.7, "volo_d3": 86.3, "volo_d4": 193.0, "volo_d5": 296.0}
MAX_ABS_DIFF = 1e-4


def _num_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def _images(size: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def _timm():
    return pytest.importorskip("timm", reason="timm is a test dependency for parity checks ([dev] extra)")


def _timm_volo(args: VOLOArgs) -> nn.Module:
    """timm's VOLO class built from our args (for configurations timm has no name for)."""
    from timm.models.volo import VOLO as TimmVOLO

    return TimmVOLO(
        layers=list(args.layers),
        img_size=args.img_size,
        in_chans=args.in_chans,
        num_classes=args.num_classes,
        patch_size=args.patch_size,
        stem_hidden_dim=args.stem_hidden_dim,
        embed_dims=list(args.embed_dims),
        num_heads=list(args.num_heads),
        downsamples=args.downsamples,
        outlook_attention=args.outlook_attention,
        mlp_ratio=args.mlp_ratio,
        qkv_bias=args.qkv_bias,
        drop_path_rate=args.drop_path_rate,
        post_layers=args.post_layers,
        use_aux_head=args.use_aux_head,
    )


def _pair(name: str | None, img_size: int, num_classes: int = 1000, attn_impl: str = "sdpa") -> tuple[nn.Module, VOLO]:
    """A timm VOLO with random weights and ours holding them (strict load), both in eval mode."""
    _timm()
    torch.manual_seed(0)
    if name is None:
        args = dataclasses.replace(SMALL, img_size=img_size, num_classes=num_classes)
        reference = _timm_volo(args)
    else:
        args = dataclasses.replace(VOLO_VARIANTS[name], img_size=img_size, num_classes=num_classes)
        reference = _timm().create_model(f"{name}_224", pretrained=False, img_size=img_size, num_classes=num_classes)
    _perturb_norms(reference)
    model = VOLO(dataclasses.replace(args, attn_impl=attn_impl))
    model.load_state_dict(reference.state_dict(), strict=True)
    return reference.eval(), model.eval()


@torch.no_grad()
def _perturb_norms(model: nn.Module) -> None:
    """Move norm parameters and batch-norm statistics off their initial ones and zeros, so that
    using the wrong norm, or none, changes the output."""
    for module in model.modules():
        if isinstance(module, (nn.LayerNorm, nn.BatchNorm2d)):
            module.weight.uniform_(0.5, 1.5)
            module.bias.normal_(std=0.1)
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.normal_(std=0.1)
            module.running_var.uniform_(0.5, 1.5)


def _differences(reference: nn.Module, model: VOLO, images: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        theirs, ours = reference.forward_features(images), model.forward_features(images)
        cls_logits, aux_logits = model.forward_head_with_tokens(ours)
        return {
            "features": (ours - theirs).abs().max().item(),
            "logits": (model(images) - reference(images)).abs().max().item(),
            "cls_logits": (cls_logits - reference.head(theirs[:, 0])).abs().max().item(),
            "aux_logits": (aux_logits - reference.aux_head(theirs[:, 1:])).abs().max().item(),
        }


# --- timm parity ----------------------------------------------------------------------------


def test_d1_equals_timm_at_224():
    reference, model = _pair("volo_d1", 224)
    differences = _differences(reference, model, _images(224))
    assert max(differences.values()) <= MAX_ABS_DIFF, differences


@pytest.mark.parametrize("attn_impl", ["sdpa", "matmul"])
def test_small_config_equals_timm(attn_impl):
    reference, model = _pair(None, 64, attn_impl=attn_impl)
    assert {block.attn.impl for block in model.network[-1]} == {attn_impl}  # the transformer stage's
    differences = _differences(reference, model, _images(64, batch=3))
    assert max(differences.values()) <= MAX_ABS_DIFF, differences


def test_tiny_patch4_equals_timm_at_32_px_on_one_channel():
    """The small-image variant (stem stride 4) is timm's VOLO class with these arguments."""
    _timm()
    torch.manual_seed(0)
    args = dataclasses.replace(VOLO_TINY_PATCH4, in_chans=1, num_classes=10)
    reference = _timm_volo(args)
    _perturb_norms(reference)
    model = VOLO(args)
    model.load_state_dict(reference.state_dict(), strict=True)
    images = torch.randn(3, 1, 32, 32, generator=torch.Generator().manual_seed(1))
    differences = _differences(reference.eval(), model.eval(), images)
    assert max(differences.values()) <= MAX_ABS_DIFF, differences
    assert model.forward_features(images).shape == (3, 1 + 4 * 4, 192)  # CLS + the 4x4 transformer grid


def test_attention_implementations_give_the_same_gradients():
    torch.manual_seed(0)
    sdpa = VOLO(SMALL)
    matmul = VOLO(dataclasses.replace(SMALL, attn_impl="matmul"))
    matmul.load_state_dict(sdpa.state_dict())
    images = _images(64, batch=3)
    for model in (sdpa, matmul):
        model(images).square().mean().backward()
    for (name, ours), theirs in zip(sdpa.named_parameters(), matmul.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["volo_d2", "volo_d3", "volo_d4", "volo_d5"])
def test_larger_variants_equal_timm(name):
    reference, model = _pair(name, 64, num_classes=100)
    differences = _differences(reference, model, _images(64))
    assert max(differences.values()) <= MAX_ABS_DIFF, differences


def test_other_resolution_equals_timm_built_there_with_resampled_position_embedding():
    timm = _timm()
    torch.manual_seed(0)
    reference = _timm_volo(dataclasses.replace(SMALL, img_size=160)).eval()
    model = VOLO(dataclasses.replace(SMALL, img_size=224)).eval()
    state = {**reference.state_dict(), "pos_embed": model.pos_embed.detach().clone()}
    model.load_state_dict(state, strict=True)
    # timm's own NHWC resampler (bicubic, antialiased) is the independent reference.
    with torch.no_grad():
        reference.pos_embed.copy_(timm.layers.resample_abs_pos_embed_nhwc(model.pos_embed, [10, 10]))
    differences = _differences(reference, model, _images(160))
    assert max(differences.values()) <= MAX_ABS_DIFF, differences


def test_stochastic_depth_rates_equal_timm():
    _timm()
    args = dataclasses.replace(SMALL, drop_path_rate=0.3)
    reference, model = _timm_volo(args), VOLO(args)
    theirs = [getattr(module.drop_path1, "drop_prob", 0.0) for module in _timm_blocks(reference)]
    ours = [getattr(getattr(block, "drop_path1", None), "rate", 0.0) for block in model.block_modules()]
    assert ours == pytest.approx(theirs)
    assert max(ours) > 0


def _timm_blocks(reference: nn.Module) -> list[nn.Module]:
    return [block for layer in reference.network if isinstance(layer, nn.Sequential) for block in layer] + list(
        reference.post_network
    )


def test_round_trip_through_timm():
    _timm()
    torch.manual_seed(0)
    model = VOLO(dataclasses.replace(SMALL, in_chans=1, num_classes=3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad()
    model(torch.randn(4, 1, 64, 64)).logsumexp(dim=1).mean().backward()
    optimizer.step()  # a trained model: moved weights and batch-norm statistics
    model.eval()
    reference = _timm_volo(model.args).eval()
    reference.load_state_dict(model.state_dict(), strict=True)
    images = torch.randn(2, 1, 64, 64)
    with torch.no_grad():
        assert (model(images) - reference(images)).abs().max().item() <= MAX_ABS_DIFF
    back = VOLO(model.args)
    back.load_state_dict(reference.state_dict(), strict=True)
    original = model.state_dict()
    assert list(back.state_dict()) == list(original)
    assert all(torch.equal(tensor, original[key]) for key, tensor in back.state_dict().items())


@pytest.mark.parametrize("name", list(VOLO_VARIANTS))
def test_parameter_counts_match_paper_and_timm(name):
    count = _num_parameters(VOLO(VOLO_VARIANTS[name], device="meta"))
    millions = PAPER_MILLIONS[name]
    assert abs(count / 1e6 - millions) / millions < 0.01, f"{name}: {count / 1e6:.2f}M vs {millions}M"
    with torch.device("meta"):
        reference = _timm().create_model(f"{name}_224", pretrained=False)
    assert count == _num_parameters(reference)


# --- the model protocol ---------------------------------------------------------------------


def test_builds_on_meta_and_init_weights_sets_every_tensor():
    model = VOLO(SMALL, device="meta")
    assert all(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(float("nan") if tensor.is_floating_point() else 7)
    model.init_weights()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.isfinite(tensor.float()).all(), name
    assert torch.equal(model.patch_embed.conv[1].running_var, torch.ones(SMALL.stem_hidden_dim))
    assert model.patch_embed.conv[1].num_batches_tracked.item() == 0
    assert torch.equal(model.norm.weight, torch.ones(32)) and not model.head.bias.any()
    assert 0.01 < model.head.weight.std().item() < 0.03 and model.head.weight.abs().max().item() <= 2
    assert _num_parameters(model) == _num_parameters(VOLO(SMALL))


def test_forward_backward_shapes():
    torch.manual_seed(0)
    args = dataclasses.replace(SMALL, drop_rate=0.1, pos_drop_rate=0.1, attn_drop_rate=0.1, drop_path_rate=0.1)
    model = VOLO(args).train()
    images = _images(64)
    assert model(images).shape == (2, 10)
    tokens = model.forward_features(images)
    assert tokens.shape == (2, 1 + 4 * 4, 32)
    assert model.forward_head(tokens, pre_logits=True).shape == (2, 32)
    cls_logits, aux_logits = model.forward_head_with_tokens(tokens)
    assert cls_logits.shape == (2, 10) and aux_logits.shape == (2, 16, 10)
    (cls_logits.logsumexp(1).sum() + aux_logits.logsumexp(2).sum()).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name


def test_forward_is_class_logits_plus_half_the_max_token_logits():
    model = VOLO(SMALL).eval()
    with torch.no_grad():
        tokens = model.forward_features(_images(64))
        cls_logits, aux_logits = model.forward_head_with_tokens(tokens)
        assert torch.allclose(model.forward_head(tokens), cls_logits + 0.5 * aux_logits.max(dim=1).values)
    without_aux = VOLO(dataclasses.replace(SMALL, use_aux_head=False)).eval()
    assert without_aux.aux_head is None
    with torch.no_grad():
        tokens = without_aux.forward_features(_images(64))
        assert torch.equal(without_aux.forward_head(tokens), without_aux.head(tokens[:, 0]))
    with pytest.raises(ValueError, match="auxiliary head"):
        without_aux.forward_head_with_tokens(tokens)


def test_no_weight_decay_names_exist():
    model = VOLO(SMALL, device="meta")
    names = dict(model.named_parameters())
    assert model.no_weight_decay() <= set(names)
    assert {"pos_embed", "cls_token"} <= model.no_weight_decay()


def test_layer_ids_rise_block_by_block():
    model = VOLO(SMALL, device="meta")
    module_names = {id(module): name for name, module in model.named_modules()}
    block_ids = []
    for block in model.block_modules():
        prefix = module_names[id(block)]
        ids = {model.layer_id(f"{prefix}.{name}") for name, _ in block.named_parameters()}
        assert len(ids) == 1, prefix
        block_ids.append(ids.pop())
    assert len(block_ids) == sum(SMALL.layers) + len(SMALL.post_layers)
    assert block_ids == sorted(set(block_ids))
    assert block_ids[0] == 1 and isinstance(model.block_modules()[-1], ClassBlock)
    ids = {name: model.layer_id(name) for name, _ in model.named_parameters()}
    assert {ids[name] for name in ids if name.startswith(("patch_embed.", "pos_embed", "cls_token"))} == {0}
    last = max(ids.values())
    assert last > block_ids[-1]
    assert {ids[name] for name in ids if name.startswith(("norm.", "head.", "aux_head."))} == {last}
    downsample = next(index for index, layer in enumerate(model.network) if isinstance(layer, Downsample))
    assert block_ids[SMALL.layers[0] - 1] < ids[f"network.{downsample}.proj.weight"] < block_ids[SMALL.layers[0]]


@pytest.mark.parametrize("size", [160, 192, 256])
def test_other_resolutions_run(size):
    model = VOLO(dataclasses.replace(SMALL, img_size=224)).eval()
    patches = (size // 16) ** 2
    with torch.no_grad():
        tokens = model.forward_features(_images(size, batch=1))
        assert tokens.shape == (1, 1 + patches, 32)
        assert model.forward_head_with_tokens(tokens)[1].shape == (1, patches, 10)
        assert model(_images(size, batch=1)).shape == (1, 10)


def test_rejects_inputs_and_args_it_cannot_run():
    model = VOLO(SMALL)
    with pytest.raises(ValueError, match="total stride 16"):
        model(_images(72))
    with pytest.raises(ValueError, match="img_size"):
        dataclasses.replace(SMALL, img_size=200)
    with pytest.raises(ValueError, match="outlooker stages must come first"):
        dataclasses.replace(SMALL, outlook_attention=(False, True, False, False))
    with pytest.raises(ValueError, match="post_layers"):
        dataclasses.replace(SMALL, post_layers=())


def test_variants_match_timm_configurations():
    # Yuan et al. 2021, Table 1 (layers, widths, heads, MLP ratio; D5's stem is 128 wide).
    rows = {
        "volo_d1": ((4, 4, 8, 2), (192, 384, 384, 384), (6, 12, 12, 12), 3.0, 64),
        "volo_d2": ((6, 4, 10, 4), (256, 512, 512, 512), (8, 16, 16, 16), 3.0, 64),
        "volo_d3": ((8, 8, 16, 4), (256, 512, 512, 512), (8, 16, 16, 16), 3.0, 64),
        "volo_d4": ((8, 8, 16, 4), (384, 768, 768, 768), (12, 16, 16, 16), 3.0, 64),
        "volo_d5": ((12, 12, 20, 4), (384, 768, 768, 768), (12, 16, 16, 16), 4.0, 128),
    }
    for name, row in rows.items():
        args = VOLO_VARIANTS[name]
        assert (args.layers, args.embed_dims, args.num_heads, args.mlp_ratio, args.stem_hidden_dim) == row, name
        assert (args.patch_size, args.img_size, args.post_layers, args.use_aux_head) == (8, 224, ("ca", "ca"), True)


# --- FLOPs ----------------------------------------------------------------------------------


def _measured_flops(args: VOLOArgs, img_size: int) -> int:
    # On the meta device scaled_dot_product_attention decomposes into counted matmuls; the CPU
    # kernel is not in FlopCounterMode's table and would count as zero.
    model = VOLO(args, device="meta").eval()
    with FlopCounterMode(display=False) as counter:
        model(torch.empty(1, 3, img_size, img_size, device="meta"))
    return counter.get_total_flops()


@pytest.mark.parametrize(
    ("args", "img_size"),
    [
        (VOLO_VARIANTS["volo_d1"], 224),
        (VOLO_VARIANTS["volo_d5"], 224),
        (SMALL, 64),
        (SMALL, 96),  # resampled position embedding
        (VOLO_TINY_PATCH4, 32),
        (dataclasses.replace(SMALL, use_aux_head=False, mlp_ratio=4.0, outlook_kernel_size=5, post_layers=("ca",)), 64),
    ],
    ids=["d1-224", "d5-224", "small-64", "small-96", "tiny-patch4-32", "small-variant"],
)
def test_analytic_flops_match_counter(args, img_size):
    analytic, measured = volo_flops(args, img_size), _measured_flops(args, img_size)
    assert math.isclose(analytic, measured, rel_tol=0.05), (analytic, measured)


@pytest.mark.parametrize(
    "change",
    [
        {"layers": (3, 1, 2, 1)},
        {"layers": (2, 1, 3, 1)},
        {"post_layers": ("ca", "ca", "ca")},
        {"use_aux_head": False},
        {"num_classes": 1000},
        {"stem_hidden_dim": 16},
    ],
    ids=["outlooker", "transformer", "class-block", "aux-head", "classes", "stem"],
)
def test_analytic_flops_of_one_part_match_counter(change):
    # Whole-model totals are dominated by a few terms; the difference one part makes checks that part.
    changed = dataclasses.replace(SMALL, **change)
    analytic = volo_flops(changed, 64) - volo_flops(SMALL, 64)
    measured = _measured_flops(changed, 64) - _measured_flops(SMALL, 64)
    assert analytic != 0 and math.isclose(analytic, measured, rel_tol=0.05), (analytic, measured)


def _unfold_fold_outlook(module: OutlookAttention, x: torch.Tensor) -> torch.Tensor:
    """Outlook attention as timm and the official code write it: F.unfold / F.fold on channels-first maps."""
    batch, height, width, dim = x.shape
    kernel, stride, padding, heads = module.kernel_size, module.stride, module.kernel_size // 2, module.num_heads
    values = F.unfold(module.v(x).permute(0, 3, 1, 2), kernel, padding=padding, stride=stride)
    windows = values.shape[-1]
    values = values.reshape(batch, heads, dim // heads, kernel**2, windows).permute(0, 1, 4, 3, 2)
    pooled = F.avg_pool2d(x.permute(0, 3, 1, 2), stride, stride, ceil_mode=True).permute(0, 2, 3, 1)
    weights = module.attn(pooled).reshape(batch, windows, heads, kernel**2, kernel**2).permute(0, 2, 1, 3, 4)
    out = ((weights * module.scale).softmax(dim=-1) @ values).permute(0, 1, 4, 3, 2).reshape(batch, -1, windows)
    out = F.fold(out, (height, width), kernel, padding=padding, stride=stride)
    return module.proj(out.permute(0, 2, 3, 1))


@pytest.mark.parametrize(("size", "kernel", "stride"), [(14, 3, 2), (13, 3, 2), (10, 3, 1), (12, 5, 2)])
def test_outlook_attention_equals_unfold_fold_with_gradients(size, kernel, stride):
    torch.manual_seed(0)
    module = OutlookAttention(24, 3, kernel_size=kernel, stride=stride, qkv_bias=True).double()
    x = torch.randn(2, size, size, 24, dtype=torch.float64, requires_grad=True)
    results = []
    for forward in (module, lambda grid: _unfold_fold_outlook(module, grid)):
        module.zero_grad()
        x.grad = None
        out = forward(x)
        (out * torch.linspace(-1, 1, 24, dtype=torch.float64)).sum().backward()
        results.append((out, x.grad, [parameter.grad.clone() for parameter in module.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-10, atol=1e-12)


def test_scaled_softmax_equals_torch_softmax_and_gradcheck():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 3, 9, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: ScaledSoftmax.apply(x, 0.7), (logits,))
    for dtype in (torch.float32, torch.bfloat16):
        x = (logits.detach() * 4).to(dtype).requires_grad_()
        before = x.detach().clone()
        ours = ScaledSoftmax.apply(x, 0.7)
        assert torch.equal(x, before)  # computed on a copy, also when x is already float32
        (grad,) = torch.autograd.grad(ours, x, torch.linspace(-1, 1, 9, dtype=dtype).expand_as(ours))
        reference = (x.detach().double() * 0.7).requires_grad_()
        expected = reference.softmax(-1)
        (expected_grad,) = torch.autograd.grad(expected, reference, torch.linspace(-1, 1, 9).double().expand_as(ours))
        assert ours.dtype == dtype and grad.dtype == dtype
        tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # one bf16 rounding of values in [0, 1]
        torch.testing.assert_close(ours.double(), expected, rtol=0, atol=tolerance)
        torch.testing.assert_close(grad.double(), expected_grad * 0.7, rtol=0, atol=tolerance)


def test_class_attention_equals_sdpa_with_gradients():
    torch.manual_seed(0)
    module = ClassAttention(24, 3, qkv_bias=True).double()
    x = torch.randn(2, 7, 24, dtype=torch.float64, requires_grad=True)

    def sdpa(x: torch.Tensor) -> torch.Tensor:
        k, v = module.kv(x).reshape(2, 7, 2, 3, 8).permute(2, 0, 3, 1, 4).unbind(0)
        q = module.q(x[:, :1]).reshape(2, 1, 3, 8).transpose(1, 2)
        return module.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 1, 24))

    results = []
    for forward in (module, sdpa):
        out = forward(x)
        results.append((out, *torch.autograd.grad(out.sum(), [x, *module.parameters()])))
    torch.testing.assert_close(results[0], results[1], rtol=1e-10, atol=1e-12)
