"""Optimizers: Muon's orthogonalization, its update against torch.optim.Muon, the AdamW part of
``MuonAdamW`` against torch.optim.AdamW, and which parameters each one gets."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_config
from vitrain.models import build_model
from vitrain.train import make_plan
from vitrain.train.optim import Lamb, MuonAdamW, build_muon_param_groups, build_optimizer, orthogonalize


@pytest.mark.parametrize("shape", [(48, 80), (80, 48), (64, 64)])
def test_orthogonalize_keeps_the_singular_vectors_and_brings_the_values_near_one(shape):
    torch.manual_seed(0)
    rank = min(shape)
    u = torch.linalg.qr(torch.randn(shape[0], rank, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(shape[1], rank, dtype=torch.float64)).Q
    singular = torch.logspace(-1.5, 0, rank, dtype=torch.float64)  # a 30x spread, as gradients have
    result = orthogonalize(u @ torch.diag(singular) @ v.T, steps=5, dtype=torch.float64)
    assert result.shape == shape
    # Muon's coefficients trade exactness for speed: the result is U f(S) V^T with f(s) near 1 (about
    # 0.7-1.2), not on it; the singular vectors are the input's, so U^T R V is diagonal
    in_basis = u.T @ result @ v
    diagonal = torch.diagonal(in_basis)
    assert (in_basis - torch.diag(diagonal)).abs().max() < 1e-9
    assert diagonal.min() > 0.6 and diagonal.max() < 1.25


def _step_both_on_the_same_gradients(optimizers: tuple, params: tuple[list, list], steps: int) -> None:
    for seed in range(steps):
        for optimizer, group in zip(optimizers, params, strict=True):
            generator = torch.Generator().manual_seed(seed)
            for parameter in group:
                parameter.grad = torch.randn(parameter.shape, generator=generator)
            optimizer.step()


@pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"), reason=f"the reference, torch.optim.Muon, is not in torch {torch.__version__}"
)
def test_muon_step_equals_torch_muon_matched_to_adamw_rms():
    torch.manual_seed(0)
    ours = [torch.randn(32, 96), torch.randn(96, 32)]
    theirs = [p.clone() for p in ours]
    lr, weight_decay = 0.02, 0.1
    optimizer = MuonAdamW(
        [{"params": ours, "weight_decay": weight_decay, "use_muon": True}], lr, orthogonalize_dtype=torch.bfloat16
    )
    reference = torch.optim.Muon(theirs, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
    _step_both_on_the_same_gradients((optimizer, reference), (ours, theirs), steps=3)
    for mine, torch_muon in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, torch_muon, rtol=0, atol=1e-6)


@pytest.mark.parametrize("flags", [{"fused": True}, {"foreach": True}, {}])
def test_the_adamw_groups_step_exactly_as_torch_adamw(flags):
    torch.manual_seed(0)
    ours = [torch.randn(16, 8), torch.randn(8), torch.randn(3, 1, 3, 3)]
    theirs = [p.clone() for p in ours]

    def groups(params: list[torch.Tensor]) -> list[dict]:
        return [{"params": params[::2], "weight_decay": 0.05}, {"params": params[1:2], "weight_decay": 0.0}]

    optimizer = MuonAdamW(groups(ours), 3e-3, betas=(0.9, 0.95), eps=1e-6, **flags)
    reference = torch.optim.AdamW(groups(theirs), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, **flags)
    _step_both_on_the_same_gradients((optimizer, reference), (ours, theirs), steps=4)
    for mine, adamw in zip(ours, theirs, strict=True):
        assert torch.equal(mine, adamw)


@pytest.mark.parametrize(
    ("model_name", "muon_names"),
    [
        ("vit_tiny6_patch7", {"attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight", "mlp.fc2.weight"}),
        (
            "localvit_tiny6_patch7",
            {"attn.qkv.weight", "attn.proj.weight", "mlp.expand.weight", "mlp.reduce.weight"}
            | {"mlp.se.fc1.weight", "mlp.se.fc2.weight"},
        ),
    ],
)
def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(model_name, muon_names):
    model = build_model(model_name, img_size=14, in_chans=1, num_classes=4, embed_dim=48)
    groups = build_muon_param_groups(model, weight_decay=0.05)
    names = {id(p): name for name, p in model.named_parameters()}
    by_kind = [
        (group.get("use_muon", False), group["weight_decay"], {names[id(p)] for p in group["params"]})
        for group in groups
    ]
    (muon, muon_decay, chosen), (_, decay, decayed), (_, no_decay, undecayed) = by_kind
    assert (muon, muon_decay, decay, no_decay) == (True, 0.05, 0.05, 0.0)
    assert {name.split(".", 2)[2] for name in chosen} == muon_names
    assert all(name.startswith("blocks.") for name in chosen) and len(chosen) == 6 * len(muon_names)
    assert {"patch_embed.proj.weight", "head.weight"} <= decayed  # first and last layer stay on AdamW
    if model_name.startswith("localvit"):
        assert "blocks.0.mlp.depthwise.weight" in decayed  # a depthwise kernel is not a matrix
    assert {"pos_embed", "norm.weight", "head.bias", "blocks.0.attn.qkv.bias"} <= undecayed
    assert len(chosen) + len(decayed) + len(undecayed) == len(names)  # each parameter exactly once


def test_build_optimizer_gives_muon_its_settings_and_the_run_lr(small_synthetic_overrides):
    plan = make_plan(
        make_config(*small_synthetic_overrides, "optim.name=muon", "optim.muon_momentum=0.9", "optim.ns_steps=3")
    )
    model = build_model("vit_tiny6_patch7", img_size=14, in_chans=1, num_classes=4, embed_dim=48)
    optimizer = build_optimizer(model, plan.optim, plan.precision)
    assert isinstance(optimizer, MuonAdamW)
    assert (optimizer.ns_steps, optimizer.orthogonalize_dtype) == (3, torch.float32)  # fp32 run
    assert {group["lr"] for group in optimizer.param_groups} == {plan.optim.lr}
    assert optimizer.param_groups[0]["momentum"] == 0.9


def _timm_lamb(params: list, lr: float, weight_decay: float, eps: float):
    timm_optim = pytest.importorskip("timm.optim", reason="timm is a test dependency for parity checks ([dev] extra)")
    groups = [{"params": params[::2], "weight_decay": weight_decay}, {"params": params[1::2], "weight_decay": 0.0}]
    # max_grad_norm=None: gradient clipping belongs to our training step, not the optimizer
    return timm_optim.Lamb(groups, lr=lr, betas=(0.9, 0.95), eps=eps, max_grad_norm=None)


@pytest.mark.parametrize("foreach", [True, False])
def test_lamb_steps_as_timms_lamb(foreach):
    torch.manual_seed(0)
    ours = [torch.randn(16, 8), torch.randn(8), torch.randn(3, 1, 3, 3), torch.randn(5), torch.zeros(4, 4)]
    theirs = [p.clone() for p in ours]
    lr, weight_decay, eps = 2e-2, 0.1, 1e-6
    groups = [{"params": ours[::2], "weight_decay": weight_decay}, {"params": ours[1::2], "weight_decay": 0.0}]
    optimizer = Lamb(groups, lr, betas=(0.9, 0.95), eps=eps, foreach=foreach)
    reference = _timm_lamb(theirs, lr, weight_decay, eps)
    _step_both_on_the_same_gradients((optimizer, reference), (ours, theirs), steps=4)
    for mine, timm_lamb in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, timm_lamb, rtol=1e-5, atol=1e-7)


def test_lamb_trust_ratio_sets_each_tensors_step_to_lr_times_its_norm():
    # One step from zero moments: the Adam direction is sign(g) (|m_hat| = sqrt(v_hat)), so the update
    # u = sign(g) + wd * w; the trust ratio rescales it to ||w||, whatever the gradient's size.
    torch.manual_seed(0)
    weights = [torch.randn(32, 16), 10 * torch.randn(8, 8)]
    before = [w.clone() for w in weights]
    optimizer = Lamb([{"params": weights, "weight_decay": 0.01}], lr=0.1, eps=1e-12)
    for w, scale in zip(weights, (1e-4, 1e3), strict=True):
        w.grad = scale * torch.randn(w.shape)
    optimizer.step()
    for w, old in zip(weights, before, strict=True):
        step = old - w
        torch.testing.assert_close(step.norm(), 0.1 * old.norm(), rtol=1e-5, atol=0)
        expected = torch.sign(w.grad) + 0.01 * old
        torch.testing.assert_close(step, 0.1 * old.norm() / expected.norm() * expected, rtol=1e-4, atol=1e-6)


def test_build_optimizer_gives_lamb_its_groups_lr_and_eps(small_synthetic_overrides):
    plan = make_plan(make_config(*small_synthetic_overrides, "optim.name=lamb", "optim.eps=1e-6"))
    model = build_model("vit_tiny6_patch7", img_size=14, in_chans=1, num_classes=4, embed_dim=48)
    optimizer = build_optimizer(model, plan.optim, plan.precision)
    assert isinstance(optimizer, Lamb) and optimizer.foreach
    assert [group["weight_decay"] for group in optimizer.param_groups] == [plan.config.optim.weight_decay, 0.0]
    assert {group["lr"] for group in optimizer.param_groups} == {plan.optim.lr}
    assert optimizer.defaults["eps"] == 1e-6


def test_sgd_over_sharded_parameters_takes_the_multi_tensor_path(small_synthetic_overrides, monkeypatch):
    """torch's fused SGD has no DTensor rule: over FSDP/TP parameters auto falls back to foreach, and an
    explicit fused is refused naming the keys (the real sharded run: tests/dist/test_distill.py)."""
    import vitrain.train.optim as optim_module
    from vitrain.config import ConfigError

    model = build_model("vit_tiny6_patch7", img_size=14, in_chans=1, num_classes=4, embed_dim=48)
    plan = make_plan(make_config(*small_synthetic_overrides, "optim.name=sgd"))
    assert build_optimizer(model, plan.optim, plan.precision).defaults["fused"]  # unsharded: fused
    monkeypatch.setattr(optim_module, "holds_dtensors", lambda module: True)
    optimizer = build_optimizer(model, plan.optim, plan.precision)
    assert not optimizer.defaults["fused"] and optimizer.defaults["foreach"]
    fused = make_plan(make_config(*small_synthetic_overrides, "optim.name=sgd", "optim.implementation=fused"))
    with pytest.raises(ConfigError, match="optim.implementation=fused with optim.name=sgd"):
        build_optimizer(model, fused.optim, fused.precision)
