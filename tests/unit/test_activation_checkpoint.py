"""Activation checkpointing: the same gradients and state-dict names, less stored activation."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_config, pinned_bf16_o2
from vitrain.checkpoint import load_checkpoint
from vitrain.config import ConfigError
from vitrain.models import build_model
from vitrain.parallel import apply_activation_checkpointing
from vitrain.train import make_plan, train


def _gradients(name: str, blocks, img_size: int, **overrides) -> tuple[dict, list[str]]:
    torch.manual_seed(0)
    model = build_model(name, img_size=img_size, num_classes=5, **overrides)
    if blocks:
        assert apply_activation_checkpointing(model, blocks) == (
            len(model.block_modules()) if blocks == "all" else blocks
        )
    torch.manual_seed(1)  # the same dropout / drop-path draws in both runs
    model(torch.randn(2, model.args.in_chans, img_size, img_size)).square().sum().backward()
    return {name: p.grad for name, p in model.named_parameters()}, list(model.state_dict())


@pytest.mark.parametrize(
    ("name", "img_size", "overrides"),
    [
        ("vit_tiny6_patch7", 28, {"drop_rate": 0.1, "drop_path_rate": 0.2}),
        ("locality_vit_tiny6_patch7", 28, {"head": "gap", "drop_path_rate": 0.2}),
        ("volo_d1", 32, {"drop_path_rate": 0.2}),
    ],
)
@pytest.mark.parametrize("blocks", ["all", 2])
def test_checkpointed_blocks_give_identical_gradients_and_names(name, img_size, overrides, blocks):
    reference, reference_names = _gradients(name, 0, img_size, **overrides)
    checkpointed, names = _gradients(name, blocks, img_size, **overrides)
    assert names == reference_names
    for parameter_name, grad in reference.items():
        assert torch.equal(grad, checkpointed[parameter_name]), parameter_name


def test_more_blocks_than_the_model_has_is_a_config_error():
    model = build_model("vit_tiny6_patch7", device="meta")
    with pytest.raises(ConfigError, match="performance.activation_checkpointing=7 but the model has 6 blocks"):
        apply_activation_checkpointing(model, 7)


@pytest.mark.parametrize("name", ["resnet50", "localvit_tiny_patch16"])
def test_blocks_with_batchnorm_are_refused(name):
    # recomputing a BatchNorm block in backward would update its running statistics twice
    with pytest.raises(ConfigError, match="BatchNorm"):
        apply_activation_checkpointing(build_model(name, device="meta"), 1)


@pytest.mark.parametrize("precision", ["fp32", "bf16-o2"])
def test_training_with_checkpointing_ends_at_the_same_weights(small_synthetic_overrides, tmp_path, precision):
    extra = pinned_bf16_o2() if precision == "bf16-o2" else []
    common = [*small_synthetic_overrides, *extra, "model.drop_path_rate=0.1", "train.steps=6"]
    plain = make_plan(make_config(*common, f"train.out_dir={tmp_path / 'plain'}"))
    checkpointed = make_plan(
        make_config(*common, "performance.activation_checkpointing=all", f"train.out_dir={tmp_path / 'ckpt'}")
    )
    train(plain), train(checkpointed)
    first = load_checkpoint(plain.out_dir / "checkpoints" / "step-000000006.pt")["model"]
    second = load_checkpoint(checkpointed.out_dir / "checkpoints" / "step-000000006.pt")["model"]
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


def _saved_activation_bytes(model: torch.nn.Module, images: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during the forward pass, parameters excluded."""
    parameters = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    seen: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            pack.total += storage.nbytes()
        return tensor

    pack.total = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(images)
    return pack.total


@pytest.mark.parametrize("name", ["vit_base_patch16", "volo_d1"])
def test_checkpointing_every_block_keeps_at_most_half_the_activations(name):
    # the memory target, counted exactly instead of through a process's peak memory
    images = torch.randn(2, 3, 64, 64)
    sizes = {}
    for blocks in (0, "all"):
        torch.manual_seed(0)
        model = build_model(name, img_size=64)
        if blocks:
            apply_activation_checkpointing(model, blocks)
        sizes[blocks] = _saved_activation_bytes(model, images)
    assert sizes["all"] <= 0.5 * sizes[0], sizes
