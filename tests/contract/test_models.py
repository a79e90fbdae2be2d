"""Every registered model: meta build, forward/backward, both heads, the protocol, timm parity."""

from __future__ import annotations

import pytest
import torch

from vitrain.models import ViTArgs, build_model, list_models, model_spec, num_parameters, resample_pos_embed
from vitrain.models.layers import LocalityMlp
from vitrain.models.timm_weights import TIMM_NAMES, from_timm, timm_name, to_timm
from vitrain.train.optim import build_param_groups

MODEL_NAMES = [spec.name for spec in list_models() if isinstance(spec.args, ViTArgs)]
# Shrinks every ViT-family variant to a few blocks of width 4 per head: the structure under test
# (embedding, blocks, FFN type, head) is unchanged, and g/14 or G/14 build in milliseconds.
TINY = {"depth": 2, "mlp_dim": None}


def _tiny(name: str, **overrides) -> dict:
    return {**TINY, "embed_dim": 4 * model_spec(name).args.num_heads, **overrides}


def _small_input(name: str, batch: int = 2) -> tuple[torch.Tensor, int]:
    patch = model_spec(name).args.patch_size
    return torch.randn(batch, 3, 2 * patch, 2 * patch), 2 * patch


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_builds_on_meta_with_same_parameters(name):
    meta = build_model(name, device="meta", **_tiny(name))
    assert all(parameter.is_meta for parameter in meta.parameters())
    real = build_model(name, img_size=2 * model_spec(name).args.patch_size, **_tiny(name))
    prefix = (real.cls_token is not None) + (real.dist_token is not None)
    positioned = prefix if real.args.pos_embed_class else 0  # DeiT III: no position for the prefix tokens
    assert real.pos_embed.shape[1] == 4 + positioned and real.num_prefix_tokens == prefix
    assert num_parameters(meta) - meta.pos_embed.numel() == num_parameters(real) - real.pos_embed.numel()


@pytest.mark.parametrize("head", ["cls", "gap"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_backward_shapes(name, head):
    images, size = _small_input(name)
    torch.manual_seed(0)
    distilled = model_spec(name).args.distill_token and head == "cls"  # the distillation head reads the CLS token
    options = {**_tiny(name), "distill_token": distilled}
    model = build_model(name, img_size=size, num_classes=7, head=head, drop_path_rate=0.1, **options)
    logits = model(images)
    assert logits.shape == (2, 7)
    tokens = model.forward_features(images)
    assert tokens.shape == (2, 4 + (head == "cls") + distilled, model.args.embed_dim)
    assert model.forward_head(tokens, pre_logits=True).shape == (2, model.args.embed_dim)
    logits.sum().backward()
    for parameter_name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), parameter_name


# NeMo's ViT documentation's table, "Model size (M)" column (NeMo's ViT sizes).
SEED_001_MILLIONS = {
    "vit_base_patch16": 86,
    "vit_large_patch16": 303,
    "vit_huge_patch16": 632,
    "vit_huge_patch14": 632,
    "vit_giant_patch14": 1011,
    "vit_gigantic_patch14": 1843,
}


@pytest.mark.parametrize(("name", "millions"), SEED_001_MILLIONS.items())
def test_parameter_counts_match_seed_table(name, millions):
    count = num_parameters(build_model(name, device="meta"))
    assert abs(count / 1e6 - millions) / millions < 0.01, f"{name}: {count / 1e6:.1f}M vs {millions}M"


def test_seed_table_dimensions():
    # hidden, FFN, heads, layers, patch: NeMo's table row by row.
    rows = {
        "vit_base_patch16": (768, 3072, 12, 12, 16),
        "vit_large_patch16": (1024, 4096, 16, 24, 16),
        "vit_huge_patch16": (1280, 5120, 16, 32, 16),
        "vit_huge_patch14": (1280, 5120, 16, 32, 14),
        "vit_giant_patch14": (1408, 6144, 16, 40, 14),
        "vit_gigantic_patch14": (1664, 8192, 16, 48, 14),
    }
    for name, (hidden, ffn, heads, layers, patch) in rows.items():
        model = build_model(name, device="meta")
        assert model.blocks[0].mlp.fc1.out_features == ffn, name
        assert (model.args.embed_dim, model.args.num_heads, len(model.blocks), model.args.patch_size) == (
            hidden,
            heads,
            layers,
            patch,
        ), name


def test_protocol_weight_decay_and_layer_ids():
    model = build_model("locality_vit_tiny6_patch7")
    decay, no_decay = build_param_groups(model, 0.05)
    decayed = {id(p) for p in decay["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[i] for i in decayed} == {
        n for n, p in model.named_parameters() if p.ndim > 1 and n not in ("pos_embed", "cls_token")
    }
    assert no_decay["weight_decay"] == 0.0
    assert model.layer_id("pos_embed") == 0
    assert model.layer_id("blocks.0.attn.qkv.weight") == 1
    assert model.layer_id("blocks.5.mlp.fc2.bias") == 6
    assert model.layer_id("head.weight") == 7
    assert len(model.block_modules()) == 6


def test_locality_ffn_mixes_neighbours_only_and_cls_bypasses_conv():
    torch.manual_seed(0)
    mlp = LocalityMlp(8, 16, num_prefix_tokens=1)
    x = torch.randn(1, 1 + 25, 8, requires_grad=True)
    out = mlp(x, (5, 5))
    # output patch (0, 0) depends on input patches within its 3x3 neighbourhood only
    (grad,) = torch.autograd.grad(out[0, 1].sum(), x)
    touched = {index - 1 for index in range(1, 26) if grad[0, index].abs().sum() > 0}
    assert touched == {0, 1, 5, 6}
    cls = mlp.fc2(mlp.act(mlp.fc1(x[:, :1])))
    assert torch.allclose(out[:, :1], cls)


@pytest.mark.parametrize("prefix", [0, 1])
def test_locality_ffn_token_layout_matches_an_nchw_copy(prefix):
    """The depthwise conv runs on a channels_last view of the tokens (no copy); the paper's
    Seq2Im/Im2Seq with an NCHW copy must give the same output and gradients (float64)."""
    torch.manual_seed(0)
    mlp = LocalityMlp(8, 16, num_prefix_tokens=prefix, dtype=torch.float64)
    x = torch.randn(3, prefix + 12, 8, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(3, prefix + 12, 8, dtype=torch.float64)

    def nchw(x: torch.Tensor) -> torch.Tensor:
        hidden = mlp.fc1(x)
        patches = hidden[:, prefix:].transpose(1, 2).reshape(3, 16, 3, 4)
        patches = mlp.conv(patches.contiguous()).flatten(2).transpose(1, 2)
        return mlp.fc2(mlp.act(torch.cat([hidden[:, :prefix], patches], dim=1)))

    grads = []
    for forward in (lambda x: mlp(x, (3, 4)), nchw):
        mlp.zero_grad()
        out = forward(x)
        (input_grad,) = torch.autograd.grad((out * weights).sum(), x, retain_graph=True)
        (out * weights).sum().backward()
        grads.append((out, input_grad, [p.grad.clone() for p in mlp.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)


def test_attention_implementations_agree():
    images, size = _small_input("vit_tiny_patch16")
    torch.manual_seed(0)
    sdpa = build_model("vit_tiny_patch16", img_size=size, attn_impl="sdpa")
    matmul = build_model("vit_tiny_patch16", img_size=size, attn_impl="matmul")
    matmul.load_state_dict(sdpa.state_dict())
    assert torch.allclose(sdpa(images), matmul(images), atol=1e-5)


def _reference_attention(qkv: torch.Tensor, head_dim: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v per head, through autograd: what MatmulAttention writes out."""
    batch, tokens, _ = qkv.shape
    q, k, v = qkv.reshape(batch, tokens, 3, -1, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    weights = (q @ k.transpose(-2, -1) * head_dim**-0.5).softmax(dim=-1)
    return (weights @ v).transpose(1, 2).reshape(batch, tokens, -1)


@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(17, 3, 8), (5, 1, 4), (10, 4, 6)])
def test_matmul_attention_function_equals_autograd_attention(tokens, heads, head_dim):
    from vitrain.models.layers import MatmulAttention

    torch.manual_seed(0)
    qkv = torch.randn(3, tokens, 3 * heads * head_dim, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, tokens, heads * head_dim, dtype=torch.float64)
    results = []
    for attend in (
        lambda x: MatmulAttention.apply(x, head_dim, head_dim**-0.5),
        lambda x: _reference_attention(x, head_dim),
    ):
        out = attend(qkv)
        results.append((out, torch.autograd.grad(out, qkv, upstream)[0]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-10, atol=1e-12)
    small = qkv.detach()[:1, :4, :].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: MatmulAttention.apply(x, head_dim, 0.5), (small,))
    strided = torch.cat([qkv.detach(), qkv.detach()], dim=-1)[..., : qkv.shape[-1]]  # not contiguous
    torch.testing.assert_close(MatmulAttention.apply(strided, head_dim, head_dim**-0.5), results[1][0])


def test_attention_module_uses_the_written_out_backward_only_where_it_applies(monkeypatch):
    """matmul attention without dropout or the fp32 softmax runs MatmulAttention; with either it takes
    the autograd path (in float32 the fp32 softmax changes no number: the reference); under bf16
    autocast MatmulAttention computes in bf16."""
    from vitrain.models import layers

    calls = []
    original = layers.MatmulAttention.apply
    monkeypatch.setattr(layers.MatmulAttention, "apply", lambda *args: calls.append(1) or original(*args))
    torch.manual_seed(0)
    fused = layers.Attention(32, 4, impl="matmul")
    reference = layers.Attention(32, 4, impl="matmul", softmax_fp32=True)
    reference.load_state_dict(fused.state_dict())
    x = torch.randn(2, 9, 32, requires_grad=True)
    upstream = torch.randn(2, 9, 32)
    results = []
    for module in (fused, reference):
        out = module(x)
        results.append((out, *torch.autograd.grad(out, [x, *module.parameters()], upstream)))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)
    assert len(calls) == 1
    layers.Attention(32, 4, impl="matmul", attn_drop=0.5).train()(x)
    assert len(calls) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused_bf16 = fused(x)
    assert fused_bf16.dtype == torch.bfloat16 and len(calls) == 2
    torch.testing.assert_close(fused_bf16.float(), results[1][0], rtol=0.02, atol=0.02)


@pytest.mark.parametrize("softmax_fp32", [False, True])
def test_matmul_attention_compiles_as_one_graph_where_autocast_availability_is_untraceable(monkeypatch, softmax_fp32):
    """Both matmul paths turn autocast off by device type. torch before 2.14 cannot trace
    ``torch.amp.is_autocast_available``: asked while ``torch.compile`` traces, it broke the graph in
    every block (16 graphs for 12 blocks, and eager past the recompile limit). Emulated on any torch by
    making the question untraceable: the forward and backward still trace as one graph."""
    untraceable = torch._dynamo.disable(torch.amp.is_autocast_available)
    monkeypatch.setattr(torch.amp, "is_autocast_available", untraceable)
    torch.manual_seed(0)
    model = build_model(
        "vit_tiny6_patch7", img_size=14, in_chans=1, depth=3, attn_impl="matmul", attn_softmax_fp32=softmax_fp32
    )
    images = torch.randn(2, 1, 14, 14)

    def loss(x):
        return model(x).square().sum()

    def loss_and_grads(function):
        value = function(images)
        return value, *torch.autograd.grad(value, list(model.parameters()))

    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(loss)(images)
        compiled = loss_and_grads(torch.compile(loss, backend="aot_eager"))
    finally:
        torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch.testing.assert_close(compiled, loss_and_grads(loss))


def test_fp32_softmax_switch_keeps_fp16_matmul_attention_finite_where_scores_overflow():
    from vitrain.models.layers import Attention

    torch.manual_seed(0)
    reference = Attention(64, 4, impl="matmul")
    with torch.no_grad():  # q = k = v = x: a token's score with itself is |x|^2 / 4, past fp16's 65504
        reference.qkv.weight.copy_(torch.eye(64).repeat(3, 1))
        reference.qkv.bias.zero_()
        x = 150.0 * torch.randn(2, 10, 64)
        exact = reference(x)
        outputs = {}
        for softmax_fp32 in (False, True):
            module = Attention(64, 4, impl="matmul", softmax_fp32=softmax_fp32)
            module.load_state_dict(reference.state_dict())
            outputs[softmax_fp32] = module.half()(x.half()).float()
    assert not outputs[False].isfinite().all()  # the overflow the switch exists for
    assert outputs[True].isfinite().all()
    assert torch.allclose(outputs[True], exact, rtol=0.01, atol=0.5)
    model = build_model("vit_tiny6_patch7", img_size=14, in_chans=1, attn_impl="matmul", attn_softmax_fp32=True)
    assert all(block.attn.softmax_fp32 for block in model.blocks)


def test_other_resolution_resamples_position_embeddings():
    model = build_model("vit_tiny_patch16", img_size=32)
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 1000)
    constant = torch.ones(1, 1 + 4, 6)
    constant[:, 0] = 5.0
    resampled = resample_pos_embed(constant, (3, 3), num_prefix_tokens=1)
    assert resampled.shape == (1, 10, 6)
    assert torch.allclose(resampled, torch.cat([torch.full((1, 1, 6), 5.0), torch.ones(1, 9, 6)], dim=1), atol=1e-5)
    with pytest.raises(ValueError, match="divisible"):
        model(torch.randn(1, 3, 40, 40))


@pytest.mark.parametrize(("patch", "img_size"), [(8, 32), (8, 16), (16, 224), (16, 48)])
def test_conv_stem_gives_the_patch_stems_grid_and_trains(patch, img_size):
    """Xiao et al.'s stem: log2(patch) stride-2 3x3 convs of widths D/2^k..D/2, then 1x1 to D; the
    token grid is the patchify stem's, at the model's size and at curriculum sizes."""
    args = {"depth": 1, "embed_dim": 48, "num_heads": 3, "patch_size": patch, "img_size": img_size}
    conv = build_model("vit_tiny_patch16", stem="conv", **args)
    patchify = build_model("vit_tiny_patch16", **args)
    widths = [layer.out_channels for layer in conv.patch_embed.convs if isinstance(layer, torch.nn.Conv2d)]
    assert widths == [48 >> level for level in range(patch.bit_length() - 1, 0, -1)]
    assert all(layer.stride == (2, 2) for layer in conv.patch_embed.convs if isinstance(layer, torch.nn.Conv2d))
    images = torch.randn(2, 3, img_size, img_size)
    tokens, grid = conv.patch_embed(images)
    assert (tokens.shape, grid) == (patchify.patch_embed(images)[0].shape, patchify.patch_embed(images)[1])
    conv(images).sum().backward()
    assert all(param.grad is not None and param.grad.abs().sum() > 0 for param in conv.patch_embed.parameters())
    if (img_size // 2) % patch == 0:  # a smaller curriculum stage: resampled position embeddings
        assert conv(torch.randn(2, 3, img_size // 2, img_size // 2)).shape == (2, 1000)


def test_conv_stem_refuses_patch_sizes_it_cannot_build():
    with pytest.raises(ValueError, match="power-of-two patch size .*got 7"):
        build_model("vit_tiny_patch16", stem="conv", patch_size=7, img_size=28)
    with pytest.raises(ValueError, match="only the patchify stem"):
        to_timm(build_model("vit_tiny_patch16", stem="conv", depth=1))


def test_position_embedding_resampling_is_identity_at_the_same_grid_and_smooth_across_grids():
    """The curriculum resamples every stage from the same table: same grid = same tensor, and a smooth
    table (a plane over the grid) stays that plane at other grid sizes, up to the border."""
    table = torch.randn(1, 1 + 16, 8)
    assert resample_pos_embed(table, (4, 4), num_prefix_tokens=1) is table
    rows, cols = torch.meshgrid(torch.linspace(-1, 1, 6), torch.linspace(-1, 1, 6), indexing="ij")
    plane = (0.3 * rows + 0.7 * cols).reshape(1, 36, 1).expand(1, 36, 4)
    there = resample_pos_embed(plane, (9, 9), num_prefix_tokens=0)
    back = resample_pos_embed(there, (6, 6), num_prefix_tokens=0)
    inner = back.reshape(6, 6, 4)[1:-1, 1:-1]
    assert torch.allclose(inner, plane.reshape(6, 6, 4)[1:-1, 1:-1], atol=0.05)
    assert there.min() >= plane.min() - 0.1 and there.max() <= plane.max() + 0.1


timm = pytest.importorskip("timm", reason="timm is a test dependency for parity checks ([dev] extra)")


def _timm_pair(ours: str, head: str, img_size: int, **timm_kwargs):
    """A timm model with random weights and ours holding them (through from_timm), both in eval."""
    torch.manual_seed(0)
    extra = {"global_pool": "avg", "class_token": False} if head == "gap" else {}
    reference = timm.create_model(timm_name(ours), pretrained=False, img_size=img_size, **extra, **timm_kwargs)
    return reference.eval(), from_timm(reference).eval()


def _assert_same_logits(reference, model, img_size: int) -> None:
    images = torch.randn(2, 3, img_size, img_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        difference = (model(images) - reference(images)).abs().max().item()
    assert difference <= 1e-4, difference


SMALL_TIMM_VARIANTS = [
    name
    for name in TIMM_NAMES
    if name.startswith(("vit_", "deit_"))
    and name.split("_")[1] in ("tiny", "small", "base")
    and "distilled" not in name
]
DISTILLED_TIMM_VARIANTS = [name for name in TIMM_NAMES if "distilled" in name]
LARGE_TIMM_VARIANTS = ["vit_large_patch16", "vit_huge_patch14"]


@pytest.mark.parametrize("head", ["cls", "gap"])
@pytest.mark.parametrize("ours", SMALL_TIMM_VARIANTS)
def test_logits_equal_timm_with_copied_weights(ours, head):
    reference, model = _timm_pair(ours, head, 64, num_classes=5)
    assert model.args.head == head and model.args.num_classes == 5 and model.args.img_size == 64
    _assert_same_logits(reference, model, 64)


@pytest.mark.parametrize("ours", DISTILLED_TIMM_VARIANTS)
def test_distilled_logits_equal_timm_in_eval_and_both_heads_in_training(ours):
    """DeiT's distilled models: eval logits (the mean of the heads) and, with dropout and stochastic depth
    off, both heads of a training forward against timm's ``set_distilled_training(True)``."""
    torch.manual_seed(0)
    reference = timm.create_model(timm_name(ours), pretrained=False, img_size=32, num_classes=5, depth=2).eval()
    model = from_timm(reference, depth=2).eval()
    assert model.args.distill_token and model.num_prefix_tokens == 2
    _assert_same_logits(reference, model, 32)
    model = from_timm(reference, depth=2, drop_path_rate=0.0).train()
    reference.train().set_distilled_training(True)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs, ours_pair = reference(images), model.forward_distill(images)
    assert len(theirs) == len(ours_pair) == 2
    for mine, timm_head in zip(ours_pair, theirs, strict=True):
        assert torch.allclose(mine, timm_head, atol=1e-5), (mine - timm_head).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("ours", LARGE_TIMM_VARIANTS)
def test_large_variants_equal_timm(ours):
    # num_classes given: timm's vit_huge_patch14_224 defaults to no head (num_classes=0)
    reference, model = _timm_pair(ours, "cls", 2 * model_spec(ours).args.patch_size, num_classes=1000)
    _assert_same_logits(reference, model, 2 * model_spec(ours).args.patch_size)


@pytest.mark.parametrize("ours", ["vit_giant_patch14", "vit_gigantic_patch14"])
def test_largest_variants_have_timm_parameter_names_and_shapes(ours):
    with torch.device("meta"):
        reference = timm.create_model(timm_name(ours), pretrained=False)
    theirs = {name: tuple(tensor.shape) for name, tensor in reference.state_dict().items()}
    assert {name: tuple(t.shape) for name, t in build_model(ours, device="meta").state_dict().items()} == theirs


def test_trained_model_loads_into_timm_strictly_and_back():
    torch.manual_seed(0)
    model = build_model("deit_tiny_patch16", img_size=32, num_classes=3, head="gap", in_chans=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 1, 32, 32)).logsumexp(dim=1).mean().backward()
        optimizer.step()
    model.eval()
    reference = timm.create_model(
        timm_name("deit_tiny_patch16"),
        pretrained=False,
        img_size=32,
        num_classes=3,
        in_chans=1,
        global_pool="avg",
        class_token=False,
    ).eval()
    reference.load_state_dict(to_timm(model), strict=True)
    images = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(images), reference(images))
    back = from_timm(reference.state_dict(), name="deit_tiny_patch16")
    assert (back.args.img_size, back.args.num_classes, back.args.in_chans, back.args.head) == (32, 3, 1, "gap")
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values(), strict=True))


def test_conversion_refuses_families_timm_lacks():
    with pytest.raises(ValueError, match="no timm equivalent"):
        timm_name("locality_vit_tiny_patch16")
    with pytest.raises(ValueError, match="needs name="):
        from_timm({})


@pytest.mark.parametrize(("ours", "img_size"), [("resnet50", 64), ("volo_d1", 64)])
def test_from_timm_reads_other_families(ours, img_size):
    torch.manual_seed(0)
    size = {} if ours == "resnet50" else {"img_size": img_size}
    reference = timm.create_model(timm_name(ours), pretrained=False, num_classes=7, **size).eval()
    model = from_timm(reference).eval()
    assert model.args.num_classes == 7 and model.args.img_size == (img_size if size else 224)
    _assert_same_logits(reference, model, img_size)


@pytest.mark.parametrize(("ours", "img_size", "new_size"), [("vit_tiny_patch16", 64, 96), ("volo_d1", 64, 96)])
def test_weights_from_another_resolution_load_with_resampled_position_embeddings(ours, img_size, new_size):
    torch.manual_seed(0)
    small = build_model(ours, img_size=img_size, num_classes=3).eval()
    large = from_timm(small.state_dict(), name=ours, img_size=new_size).eval()
    assert large.args.img_size == new_size and large.pos_embed.shape != small.pos_embed.shape
    images = torch.randn(1, 3, new_size, new_size)
    with torch.no_grad():  # the small model resamples on the fly; loading resampled once: the same function
        assert torch.allclose(large(images), small(images), atol=1e-5)
    with pytest.raises(RuntimeError, match="pos_embed"):
        build_model(ours, img_size=new_size, num_classes=3).load_state_dict(small.state_dict())
