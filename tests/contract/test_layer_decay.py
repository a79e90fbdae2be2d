"""Layer ids of every registered model, and layer-decay groups equal to timm's ``param_groups_layer_decay``."""

from __future__ import annotations

import pytest

from vitrain.models import build_model, list_models
from vitrain.models.timm_weights import timm_name
from vitrain.train.optim import build_param_groups

timm = pytest.importorskip("timm", reason="timm is a test dependency for parity checks ([dev] extra)")
from timm.optim import param_groups_layer_decay  # noqa: E402

LAYER_DECAY = 0.75


@pytest.mark.parametrize("name", [spec.name for spec in list_models()])
def test_every_parameter_has_a_layer_id_and_every_layer_has_parameters(name):
    model = build_model(name, device="meta")
    ids = {parameter_name: model.layer_id(parameter_name) for parameter_name, _ in model.named_parameters()}
    assert all(isinstance(layer_id, int) for layer_id in ids.values())
    assert set(ids.values()) == set(range(model.num_layers + 2)), name  # embeddings 0 ... head num_layers + 1
    assert len(model.block_modules()) <= model.num_layers


def _scales_and_decays(model, groups) -> dict[str, tuple[float, float]]:
    """Parameter name -> (LR scale, weight decay) of the group holding it."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return {
        names[id(parameter)]: (group.get("lr_scale", 1.0), group["weight_decay"])
        for group in groups
        for parameter in group["params"]
    }


# (our variant, its overrides, timm's for the same architecture); parameter names are timm's in all of them
PAIRS = {
    "vit-cls": ("vit_tiny_patch16", {"depth": 3, "img_size": 32}, {"depth": 3, "img_size": 32}),
    "vit-gap": (
        "vit_tiny_patch16",
        {"depth": 3, "img_size": 32, "head": "gap"},
        {"depth": 3, "img_size": 32, "global_pool": "avg", "class_token": False},
    ),
    "deit3": ("deit3_small_patch16", {"depth": 3, "img_size": 32}, {"depth": 3, "img_size": 32}),  # LayerScale
    "clip": ("vit_base_patch16_clip", {"depth": 3, "img_size": 32}, {"depth": 3, "img_size": 32}),  # norm_pre
    "volo": ("volo_d1", {"img_size": 64}, {"img_size": 64}),
    "resnet": ("resnet50", {}, {}),
}


@pytest.mark.parametrize("pair", list(PAIRS))
def test_groups_equal_timm_param_groups_layer_decay(pair):
    ours, overrides, timm_overrides = PAIRS[pair]
    model = build_model(ours, device="meta", **overrides)
    reference = timm.create_model(timm_name(ours), pretrained=False, **timm_overrides).to("meta")
    assert dict(model.named_parameters()).keys() == dict(reference.named_parameters()).keys()
    no_weight_decay = getattr(reference, "no_weight_decay", set)()
    expected = _scales_and_decays(
        reference, param_groups_layer_decay(reference, 0.05, no_weight_decay, layer_decay=LAYER_DECAY)
    )
    got = _scales_and_decays(model, build_param_groups(model, 0.05, LAYER_DECAY))
    assert got.keys() == expected.keys()
    # timm merges the final norm of ViT and VOLO (``norm``; ``fc_norm`` of a pooled head is not merged)
    # into the last block's layer; BEiT's numbering, ours, keeps it with the head at scale 1
    final_norm = {name for name in got if name.startswith("norm.")}
    assert final_norm == ({"norm.weight", "norm.bias"} if pair in ("vit-cls", "deit3", "clip", "volo") else set())
    for name in final_norm:
        assert got[name] == (1.0, 0.0) and expected[name] == (LAYER_DECAY, 0.0), name
    # the same integer powers of the same factor: equal floats
    assert {name: got[name] for name in got.keys() - final_norm} == {
        name: expected[name] for name in got.keys() - final_norm
    }
    assert len({scale for scale, _ in got.values()}) == model.num_layers + 2
