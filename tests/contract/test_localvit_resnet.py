"""LocalViT (Li et al. 2021) and ResNet (He et al. 2016): structure, published sizes, the model
protocol, analytic FLOPs against a measured count, and ResNet parity with timm and torchvision."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch
import torchvision
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from vitrain.models import num_parameters
from vitrain.models.flops import vit_flops
from vitrain.models.localvit import LOCALVIT_SIZES, LocalViTMlp, localvit_mlp_flops
from vitrain.models.resnet import RESNET_LAYOUTS, ResNet, ResNetArgs, resnet_flops
from vitrain.models.vit import ViTArgs, build_localvit
from vitrain.train.optim import build_param_groups


def mlp_forward(mlp: nn.Module, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    return mlp(x, grid)


MAX_ABS_DIFF = 1e-4
FLOPS_TOLERANCE = 0.05
# LocalViT's layout (CLS token, every FFN a LocalViTMlp) at a width that runs in milliseconds.
TINY_LOCALVIT = ViTArgs(embed_dim=32, depth=2, num_heads=2, patch_size=8, img_size=32, num_classes=7, ffn="localvit")


@pytest.fixture
def localvit():
    return build_localvit


def _count_flops(module: nn.Module, *inputs) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        module(*inputs)
    return counter.get_total_flops()


def _relative_error(analytic: int, measured: int) -> float:
    return abs(analytic - measured) / measured


@torch.no_grad()
def _fill_with_garbage(model: nn.Module) -> None:
    """What ``to_empty`` may leave behind, made certain: NaN floats, nonzero integers."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        tensor.fill_(float("nan") if tensor.is_floating_point() else 7)


def _all_finite(model: nn.Module) -> bool:
    return all(torch.isfinite(tensor).all() for tensor in itertools.chain(model.parameters(), model.buffers()))


# --- LocalViT: the FFN ------------------------------------------------------------------------


@pytest.mark.parametrize("training", [True, False])
def test_localvit_mlp_cls_bypasses_the_ffn(training):
    torch.manual_seed(0)
    mlp = LocalViTMlp(8, 32, num_prefix_tokens=1).train(training)
    grid = (4, 5)
    x = torch.randn(2, 1 + 20, 8)
    out = mlp(x, grid)
    assert out.shape == x.shape
    # The CLS token's FFN output is zero whatever the patches are, ...
    other_patches = x.clone()
    other_patches[:, 1:] = torch.randn(2, 20, 8)
    assert not mlp(x, grid)[:, 0].any() and not mlp(other_patches, grid)[:, 0].any()
    # ... and the patch outputs ignore the CLS token, also through BatchNorm's batch statistics.
    other_cls = x.clone()
    other_cls[:, 0] = 100.0
    assert torch.equal(mlp(other_cls, grid)[:, 1:], out[:, 1:])


def test_localvit_mlp_depthwise_conv_mixes_3x3_neighbours_and_se_mixes_globally():
    torch.manual_seed(0)
    grid = (4, 5)
    mlp = LocalViTMlp(8, 32, num_prefix_tokens=1).eval()
    x = torch.randn(1, 1 + 20, 8)
    moved = x.clone()
    moved[0, 1 + 1 * grid[1] + 2] += 1.0  # the patch at row 1, column 2

    def changed_patches() -> set[tuple[int, int]]:
        difference = (mlp(moved, grid) - mlp(x, grid))[0, 1:].abs().amax(dim=-1)
        return {divmod(index, grid[1]) for index in range(20) if difference[index] > 1e-6}

    # SE gates every channel from the mean over the grid, so every patch sees the change ...
    assert changed_patches() == set(itertools.product(range(4), range(5)))
    # ... and without it, only the 3x3 neighbourhood of the moved patch does.
    mlp.se = nn.Identity()
    assert changed_patches() == set(itertools.product(range(0, 3), range(1, 4)))


def _nchw_localvit_mlp(mlp: LocalViTMlp, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """The official LocalViT FFN as written (github.com/ofsoundof/LocalViT): an NCHW copy of the
    patches through the Conv2d/BatchNorm2d modules themselves, then back to tokens."""
    prefix, patches = x[:, : mlp.num_prefix_tokens], x[:, mlp.num_prefix_tokens :]
    image = patches.transpose(1, 2).reshape(patches.shape[0], patches.shape[2], *grid)
    image = mlp.act(mlp.expand_norm(mlp.expand(image)))
    image = mlp.act(mlp.depthwise_norm(mlp.depthwise(image)))
    patches = mlp.reduce_norm(mlp.reduce(mlp.se(image))).flatten(2).transpose(1, 2)
    return torch.cat([torch.zeros_like(prefix), patches], dim=1)


@pytest.mark.parametrize("prefix", [0, 1])
def test_localvit_mlp_token_layout_matches_the_nchw_formulation(prefix):
    """Our FFN keeps tokens in (B, N, C) and runs the 1x1 convs as matmuls on channels_last views;
    in training mode it must give the official NCHW FFN's output, input and parameter gradients,
    and BatchNorm running statistics (float64, so any real difference shows)."""
    torch.manual_seed(0)
    ours = LocalViTMlp(8, 32, num_prefix_tokens=prefix, dtype=torch.float64).train()
    reference = copy.deepcopy(ours)
    grid = (3, 5)
    x = torch.randn(4, prefix + 15, 8, dtype=torch.float64)
    weights = torch.randn(4, prefix + 15, 8, dtype=torch.float64)
    results = []
    for mlp, forward in ((ours, mlp_forward), (reference, _nchw_localvit_mlp)):
        inputs = x.clone().requires_grad_()
        out = forward(mlp, inputs, grid)
        (out * weights).sum().backward()
        results.append((out, inputs.grad, {name: p.grad for name, p in mlp.named_parameters()}, mlp.state_dict()))
    (out, grad, param_grads, state), (ref_out, ref_grad, ref_param_grads, ref_state) = results
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(param_grads, ref_param_grads, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state, ref_state, rtol=1e-10, atol=1e-12)  # BN running mean/var updated alike
    assert state["expand_norm.num_batches_tracked"] == 1


def test_localvit_mlp_rejects_a_grid_its_tokens_do_not_fill():
    with pytest.raises(ValueError, match="do not fill"):
        LocalViTMlp(8, 32, num_prefix_tokens=1)(torch.randn(1, 1 + 12, 8), (4, 4))


# The last case has so few patches that squeeze-and-excitation is a quarter of the FLOPs.
@pytest.mark.parametrize(
    ("dim", "hidden", "grid", "prefix"), [(8, 32, (4, 5), 1), (24, 96, (7, 7), 0), (8, 64, (1, 2), 1)]
)
def test_localvit_mlp_flops_match_counter(dim, hidden, grid, prefix):
    torch.manual_seed(0)
    batch = 2
    mlp = LocalViTMlp(dim, hidden, num_prefix_tokens=prefix).eval()
    tokens = prefix + grid[0] * grid[1]
    measured = _count_flops(mlp, torch.randn(batch, tokens, dim), grid) // batch
    analytic = localvit_mlp_flops(dim, hidden, tokens, grid)
    assert _relative_error(analytic, measured) <= FLOPS_TOLERANCE, (analytic, measured)


# --- LocalViT: the model ----------------------------------------------------------------------


@pytest.mark.parametrize("head", ["cls", "gap"])
def test_localvit_forward_backward_shapes(localvit, head):
    torch.manual_seed(0)
    model = localvit(dataclasses.replace(TINY_LOCALVIT, head=head, drop_path_rate=0.1))
    assert all(isinstance(block.mlp, LocalViTMlp) for block in model.blocks)
    images = torch.randn(2, 3, 32, 32)
    logits = model(images)
    assert logits.shape == (2, 7)
    tokens = model.forward_features(images)
    assert tokens.shape == (2, 16 + (head == "cls"), 32)
    assert model.forward_head(tokens, pre_logits=True).shape == (2, 32)
    logits.sum().backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name


def test_localvit_runs_at_another_resolution(localvit):
    model = localvit(TINY_LOCALVIT).eval()
    assert model(torch.randn(1, 3, 48, 40)).shape == (1, 7)


# Li et al. 2021: LocalViT-T 5.9M, LocalViT-S 22.4M parameters.
PAPER_MILLIONS = {"tiny": 5.9, "small": 22.4}


@pytest.mark.parametrize(("size", "millions"), PAPER_MILLIONS.items())
def test_localvit_parameter_counts_match_paper(localvit, size, millions):
    count = num_parameters(localvit(ViTArgs(**LOCALVIT_SIZES[size]), device="meta"))
    assert abs(count / 1e6 - millions) / millions < 0.02, f"LocalViT-{size}: {count / 1e6:.2f}M vs {millions}M"


def test_localvit_builds_on_meta_then_materializes(localvit):
    meta = localvit(TINY_LOCALVIT, device="meta")
    assert all(tensor.is_meta for tensor in itertools.chain(meta.parameters(), meta.buffers()))
    real = localvit(TINY_LOCALVIT)
    assert {k: v.shape for k, v in meta.state_dict().items()} == {k: v.shape for k, v in real.state_dict().items()}
    # Materialized storage is garbage until init_weights, BatchNorm statistics included.
    meta.to_empty(device="cpu")
    _fill_with_garbage(meta)
    meta.init_weights()
    assert _all_finite(meta)
    for name, module in meta.named_modules():
        if isinstance(module, nn.BatchNorm2d):
            assert torch.equal(module.weight, torch.ones_like(module.weight)), name
            assert not module.bias.any() and not module.running_mean.any() and not module.num_batches_tracked, name
            assert torch.equal(module.running_var, torch.ones_like(module.running_var)), name
    assert torch.isfinite(meta.eval()(torch.randn(2, 3, 32, 32))).all()


def test_localvit_initialization(localvit):
    torch.manual_seed(0)
    model = localvit(dataclasses.replace(TINY_LOCALVIT, embed_dim=64, depth=4))
    mlps = [block.mlp for block in model.blocks]
    se_weights = torch.cat([w.flatten() for mlp in mlps for w in (mlp.se.fc1.weight, mlp.se.fc2.weight)])
    assert abs(se_weights.std().item() - 0.02) < 0.002  # truncated normal, std 0.02
    assert not any(mlp.se.fc1.bias.any() or mlp.se.fc2.bias.any() for mlp in mlps)
    # 1x1 convs keep PyTorch's default init: uniform with std 1/sqrt(3 * fan_in).
    expand = torch.cat([mlp.expand.weight.flatten() for mlp in mlps])
    assert abs(expand.std().item() * (3 * 64) ** 0.5 - 1.0) < 0.05


def test_localvit_model_flops_match_counter(localvit):
    for args, img_size in [(TINY_LOCALVIT, 32), (ViTArgs(**LOCALVIT_SIZES["small"]), 224)]:
        model = localvit(args, device="meta").eval()
        measured = _count_flops(model, torch.empty(1, 3, img_size, img_size, device="meta"))
        grid_side = img_size // args.patch_size
        tokens = grid_side**2 + 1
        hidden = int(args.embed_dim * args.mlp_ratio)
        mlp_ffn = 2 * 2 * tokens * args.embed_dim * hidden  # what vit_flops counts for ffn="mlp"
        ffn = localvit_mlp_flops(args.embed_dim, hidden, tokens, (grid_side, grid_side))
        analytic = vit_flops(dataclasses.replace(args, ffn="mlp"), img_size) + args.depth * (ffn - mlp_ffn)
        assert _relative_error(analytic, measured) <= FLOPS_TOLERANCE, (args.embed_dim, analytic, measured)


def test_build_localvit_refuses_another_ffn():
    with pytest.raises(ValueError, match="ffn='localvit'"):
        build_localvit(dataclasses.replace(TINY_LOCALVIT, ffn="locality"))


# --- ResNet -----------------------------------------------------------------------------------

# torchvision's model cards, "num_params".
TORCHVISION_PARAMETERS = {18: 11_689_512, 34: 21_797_672, 50: 25_557_032, 101: 44_549_160, 152: 60_192_808}


def _timm():
    return pytest.importorskip("timm", reason="timm is a test dependency for parity checks ([dev] extra)")


def _torchvision_resnet(depth: int, **kwargs) -> nn.Module:
    return getattr(torchvision.models, f"resnet{depth}")(weights=None, **kwargs)


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("depth", sorted(RESNET_LAYOUTS))
def test_resnet_parameters_and_names_equal_torchvision_and_timm(depth):
    model = ResNet(ResNetArgs(depth=depth), device="meta")
    assert all(tensor.is_meta for tensor in itertools.chain(model.parameters(), model.buffers()))
    with torch.device("meta"):
        torchvision_model = _torchvision_resnet(depth)
        timm_model = _timm().create_model(f"resnet{depth}", pretrained=False)
    assert num_parameters(model) == num_parameters(torchvision_model) == TORCHVISION_PARAMETERS[depth]
    assert list(_shapes(model).items()) == list(_shapes(torchvision_model).items())
    assert _shapes(model) == _shapes(timm_model)


def _perturb_norms_and_head(model: nn.Module) -> None:
    """Move BatchNorm parameters and statistics off ones and zeros (zero-init residual scales
    included, which would otherwise silence every residual branch), and scale the classifier up
    so that logits are of order one."""
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        model.fc.weight.mul_(30.0)
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                size = module.num_features
                module.weight.copy_(torch.rand(size, generator=generator) * 0.5 + 0.25)
                module.bias.copy_(torch.randn(size, generator=generator) * 0.1)
                module.running_mean.copy_(torch.randn(size, generator=generator) * 0.1)
                module.running_var.copy_(torch.rand(size, generator=generator) + 0.5)


def _max_logit_difference(model: nn.Module, reference: nn.Module, in_chans: int = 3) -> float:
    images = torch.randn(2, in_chans, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model.eval()(images), reference.eval()(images)
    assert theirs.std() > 0.5  # the comparison is not between near-constant logits
    return (ours - theirs).abs().max().item()


def test_resnet50_logits_equal_timm_and_torchvision_with_copied_weights():
    torch.manual_seed(0)
    reference = _timm().create_model("resnet50", pretrained=False, num_classes=5)
    _perturb_norms_and_head(reference)
    model = ResNet(ResNetArgs(num_classes=5))
    model.load_state_dict(reference.state_dict(), strict=True)
    assert _max_logit_difference(model, reference) <= MAX_ABS_DIFF
    torchvision_model = _torchvision_resnet(50, num_classes=5)
    torchvision_model.load_state_dict(model.state_dict(), strict=True)
    assert _max_logit_difference(model, torchvision_model) <= MAX_ABS_DIFF


def test_resnet_other_input_channels_load_into_timm_strictly():
    torch.manual_seed(0)
    model = ResNet(ResNetArgs(depth=18, in_chans=1, num_classes=3))
    assert model.conv1.weight.shape == (64, 1, 7, 7)
    _perturb_norms_and_head(model)
    reference = _timm().create_model("resnet18", pretrained=False, in_chans=1, num_classes=3)
    reference.load_state_dict(model.state_dict(), strict=True)
    assert _max_logit_difference(model, reference, in_chans=1) <= MAX_ABS_DIFF


def test_resnet_forward_backward_and_head():
    torch.manual_seed(0)
    model = ResNet(ResNetArgs(num_classes=7, drop_rate=0.5))
    images = torch.randn(2, 3, 64, 64)
    features = model.forward_features(images)
    assert features.shape == (2, 2048, 2, 2)
    assert model.forward_head(features, pre_logits=True).shape == (2, 2048)
    logits = model(images)
    assert logits.shape == (2, 7)
    logits.sum().backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
    model.eval()
    with torch.no_grad():  # dropout is off in eval: the head is deterministic
        assert torch.equal(model.forward_head(features), model.forward_head(features))
    model.train()
    with torch.no_grad():
        assert not torch.equal(model.forward_head(features), model.forward_head(features))


@pytest.mark.parametrize("zero_init_residual", [True, False])
def test_resnet_meta_build_then_init_weights(zero_init_residual):
    torch.manual_seed(0)
    model = ResNet(ResNetArgs(zero_init_residual=zero_init_residual), device="meta")
    model.to_empty(device="cpu")
    _fill_with_garbage(model)
    model.init_weights()
    assert _all_finite(model)
    last_norms = {id(block.bn3) for block in model.block_modules()}
    for name, module in model.named_modules():
        if isinstance(module, nn.BatchNorm2d):
            expected = 0.0 if zero_init_residual and id(module) in last_norms else 1.0
            assert torch.equal(module.weight, torch.full_like(module.weight, expected)), name
            assert not module.bias.any() and not module.running_mean.any() and not module.num_batches_tracked, name
            assert torch.equal(module.running_var, torch.ones_like(module.running_var)), name
    # He normal with fan out (He et al. 2015): std sqrt(2 / out_channels) for this 512 -> 2048 1x1.
    conv = model.layer4[0].conv3.weight
    assert abs(conv.std().item() * (2048 / 2) ** 0.5 - 1.0) < 0.02
    assert model.fc.bias.abs().max() <= 2048**-0.5  # nn.Linear default
    assert torch.isfinite(model.eval()(torch.randn(1, 3, 64, 64))).all()


def test_resnet_protocol():
    model = ResNet(ResNetArgs(), device="meta")
    blocks = model.block_modules()
    assert len(blocks) == sum(RESNET_LAYOUTS[50][1]) == 16
    assert all(isinstance(block, torchvision.models.resnet.Bottleneck) for block in blocks)
    assert model.layer_id("conv1.weight") == model.layer_id("bn1.bias") == 0
    assert model.layer_id("layer1.0.conv1.weight") == 1
    assert model.layer_id("layer2.0.downsample.1.weight") == 4
    assert model.layer_id("layer4.2.bn3.bias") == 16
    assert model.layer_id("fc.weight") == 17
    ids = [model.layer_id(name) for name, _ in model.named_parameters()]
    assert ids == sorted(ids) and set(ids) == set(range(18))
    names = dict(model.named_parameters())
    skip = model.no_weight_decay()
    assert skip <= set(names)
    norm_parameters = {
        f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, nn.BatchNorm2d) for p in ("weight", "bias")
    }
    assert skip == norm_parameters | {"fc.bias"}
    decay, no_decay = build_param_groups(model, 0.05)
    decayed = {id(parameter) for parameter in decay["params"]}
    assert {name for name, parameter in names.items() if id(parameter) in decayed} == set(names) - skip
    assert no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize(("depth", "img_size"), [(50, 224), (50, 64), (50, 97), (18, 224)])
def test_resnet_flops_match_counter(depth, img_size):
    args = ResNetArgs(depth=depth, num_classes=10)
    measured = _count_flops(ResNet(args, device="meta"), torch.empty(1, 3, img_size, img_size, device="meta"))
    analytic = resnet_flops(args, img_size)
    assert _relative_error(analytic, measured) <= FLOPS_TOLERANCE, (analytic, measured)
