"""Layer-wise LR decay (``optim.layer_decay``): parameter groups, the LR each group gets, the config."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_config
from vitrain.config import ConfigError
from vitrain.train import make_plan
from vitrain.train.build import build_model_for
from vitrain.train.optim import build_muon_param_groups, build_optimizer, build_param_groups
from vitrain.train.schedule import apply_lr, scheduled_lr_of

pytestmark = pytest.mark.usefixtures("one_thread")

DECAY = 0.5


def _names(model) -> dict[int, str]:
    return {id(parameter): name for name, parameter in model.named_parameters()}


def _decayed_names(model, groups) -> set[str]:
    names = _names(model)
    return {names[id(parameter)] for group in groups if group["weight_decay"] > 0 for parameter in group["params"]}


def _plan(small_synthetic_overrides, *extra):
    return make_plan(make_config(*small_synthetic_overrides, *extra))


def test_layer_decay_off_keeps_the_two_weight_decay_groups(small_synthetic_overrides):
    model = build_model_for(_plan(small_synthetic_overrides))
    decay, no_decay = build_param_groups(model, 0.05, layer_decay=1.0)
    assert decay.keys() == no_decay.keys() == {"params", "weight_decay"}  # no lr_scale: the LR as before
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    names = _names(model)
    expected = [name for name, p in model.named_parameters() if p.ndim > 1 and name not in ("pos_embed", "cls_token")]
    assert [names[id(parameter)] for parameter in decay["params"]] == expected  # matrices and kernels, in order
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)


@pytest.mark.parametrize("muon", [False, True], ids=["adamw-groups", "muon-groups"])
def test_layer_groups_keep_the_weight_decay_split_and_scale_by_depth(small_synthetic_overrides, muon):
    model = build_model_for(_plan(small_synthetic_overrides))
    build = build_muon_param_groups if muon else build_param_groups
    plain, decayed = build(model, 0.05, 1.0), build(model, 0.05, DECAY)
    assert _decayed_names(model, decayed) == _decayed_names(model, plain)
    assert sum(len(group["params"]) for group in decayed) == len(list(model.parameters()))
    names = _names(model)
    for group in decayed:
        layer_ids = {model.layer_id(names[id(parameter)]) for parameter in group["params"]}
        assert len(layer_ids) == 1 and group["params"]
        assert group["lr_scale"] == DECAY ** (model.num_layers + 1 - layer_ids.pop())
    if muon:  # every block's matrices are Muon's, each block at its own scale
        scales = [group["lr_scale"] for group in decayed if group.get("use_muon")]
        assert scales == [DECAY ** (model.num_layers + 1 - block) for block in range(1, model.num_layers + 1)]


@pytest.mark.parametrize("name", ["adamw", "sgd", "lamb", "muon"])
def test_every_optimizer_gets_the_scheduled_lr_times_each_groups_scale(small_synthetic_overrides, name):
    plan = _plan(small_synthetic_overrides, f"optim.name={name}", f"optim.layer_decay={DECAY}")
    model = build_model_for(plan)
    optimizer = build_optimizer(model, plan.optim, plan.precision)
    apply_lr(optimizer, 0.01)
    names = _names(model)
    lrs = {names[id(parameter)]: group["lr"] for group in optimizer.param_groups for parameter in group["params"]}
    assert lrs == pytest.approx(
        {name: 0.01 * DECAY ** (model.num_layers + 1 - model.layer_id(name)) for name in lrs}, rel=1e-12
    )
    assert lrs["head.weight"] == 0.01 and lrs["pos_embed"] == 0.01 * DECAY**7
    assert scheduled_lr_of(optimizer) == pytest.approx(0.01, rel=1e-12)  # what the metrics report


def test_a_step_moves_each_layer_by_the_scheduled_lr_times_its_scale(small_synthetic_overrides):
    """Plain SGD (no momentum, no weight decay): each weight moves by -lr * scale * gradient."""
    plan = _plan(
        small_synthetic_overrides,
        "optim.name=sgd",
        "optim.momentum=0",
        "optim.weight_decay=0",
        f"optim.layer_decay={DECAY}",
    )
    torch.manual_seed(0)
    model = build_model_for(plan)
    optimizer = build_optimizer(model, plan.optim, plan.precision)
    apply_lr(optimizer, 0.1)
    model(torch.randn(4, 3, 14, 14)).logsumexp(dim=1).mean().backward()
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    optimizer.step()
    for name, parameter in model.named_parameters():
        scale = DECAY ** (model.num_layers + 1 - model.layer_id(name))
        torch.testing.assert_close(parameter.detach(), before[name] - 0.1 * scale * parameter.grad, msg=name)
    assert model.layer_id("blocks.0.attn.qkv.weight") == 1 and not torch.equal(
        model.blocks[0].attn.qkv.weight, before["blocks.0.attn.qkv.weight"]
    )


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5"])
def test_layer_decay_outside_zero_to_one_is_rejected(value):
    with pytest.raises(ConfigError, match=rf"optim\.layer_decay: .*\(got {value}"):
        make_config(f"optim.layer_decay={value}")


def test_the_plan_carries_layer_decay(small_synthetic_overrides):
    assert _plan(small_synthetic_overrides).optim.layer_decay == 1.0
    assert _plan(small_synthetic_overrides, "optim.layer_decay=0.65").optim.layer_decay == 0.65
