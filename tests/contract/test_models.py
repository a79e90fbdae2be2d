"""Every registered model: meta build, forward/backward, both heads, the protocol, timm parity."""

from __future__ import annotations

import pytest
import torch

from vitrain.models import build_model, list_models, model_spec, num_parameters, resample_pos_embed
from vitrain.models.layers import LocalityMlp
from vitrain.train.optim import build_param_groups

MODEL_NAMES = [spec.name for spec in list_models()]


def _small_input(name: str, batch: int = 2) -> tuple[torch.Tensor, int]:
    patch = model_spec(name).args.patch_size
    return torch.randn(batch, 3, 2 * patch, 2 * patch), 2 * patch


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_builds_on_meta_with_same_parameters(name):
    meta = build_model(name, device="meta")
    assert all(parameter.is_meta for parameter in meta.parameters())
    real = build_model(name, img_size=2 * model_spec(name).args.patch_size)
    grid_tokens = 4 + (1 if real.cls_token is not None else 0)
    assert real.pos_embed.shape[1] == grid_tokens
    assert num_parameters(meta) - meta.pos_embed.numel() == num_parameters(real) - real.pos_embed.numel()


@pytest.mark.parametrize("head", ["cls", "gap"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_backward_shapes(name, head):
    images, size = _small_input(name)
    torch.manual_seed(0)
    model = build_model(name, img_size=size, num_classes=7, head=head, drop_path_rate=0.1)
    logits = model(images)
    assert logits.shape == (2, 7)
    tokens = model.forward_features(images)
    assert tokens.shape == (2, 4 + (head == "cls"), model.args.embed_dim)
    assert model.forward_head(tokens, pre_logits=True).shape == (2, model.args.embed_dim)
    logits.sum().backward()
    for parameter_name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), parameter_name


def test_known_parameter_counts():
    # timm's vit_*_patch16_224 counts (and seed 001: B/16 86M).
    expected = {"vit_tiny_patch16": 5_717_416, "vit_small_patch16": 22_050_664, "vit_base_patch16": 86_567_656}
    for name, count in expected.items():
        assert num_parameters(build_model(name, device="meta")) == count


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


def test_attention_implementations_agree():
    images, size = _small_input("vit_tiny_patch16")
    torch.manual_seed(0)
    sdpa = build_model("vit_tiny_patch16", img_size=size, attn_impl="sdpa")
    matmul = build_model("vit_tiny_patch16", img_size=size, attn_impl="matmul")
    matmul.load_state_dict(sdpa.state_dict())
    assert torch.allclose(sdpa(images), matmul(images), atol=1e-5)


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


timm = pytest.importorskip("timm", reason="timm is a test dependency for parity checks ([dev] extra)")


@pytest.mark.parametrize(
    ("ours", "theirs", "head"),
    [("vit_tiny_patch16", "vit_tiny_patch16_224", "cls"), ("vit_small_patch16", "vit_small_patch16_224", "gap")],
)
def test_logits_equal_timm_with_copied_weights(ours, theirs, head):
    torch.manual_seed(0)
    extra = {"global_pool": "avg", "class_token": False} if head == "gap" else {}
    reference = timm.create_model(theirs, pretrained=False, num_classes=5, img_size=64, **extra).eval()
    model = build_model(ours, img_size=64, num_classes=5, head=head).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(model(images), reference(images), atol=1e-5)
