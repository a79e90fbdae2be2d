"""The fused kernels as registered ops: ``torch.library.opcheck`` on every op (schema, fake tensors,
autograd registration, AOT dispatch with dynamic shapes), ``torch.compile`` tracing through a converted
model, and the converter's swaps."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo import register_backend

from vitrain import kernels
from vitrain.models import build_model


@pytest.fixture(scope="module")
def built():
    if kernels.load() is None:
        pytest.skip(f"the fused CPU kernels could not be built on this machine ({kernels.build._failure})")
    return kernels.load()


def _bf16(*shape: int, grad: bool = False, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(torch.bfloat16).requires_grad_(grad)


def _image(batch: int, channels: int, side: int, grad: bool = False) -> torch.Tensor:
    x = torch.randn(batch, channels, side, side).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    return x.requires_grad_(grad)


def _samples() -> dict[str, tuple[tuple, dict]]:
    """(args, kwargs) per op, forward ops with inputs that require grad (their autograd is checked)."""
    torch.manual_seed(0)
    x, w, b = _bf16(2, 5, 32, grad=True), _bf16(32, grad=True), _bf16(32, grad=True)
    stats = torch.randn(2, 5, 1)
    fc1_w, fc1_b = _bf16(128, 32, grad=True, scale=0.2), _bf16(128, grad=True)
    conv_w, conv_b = _bf16(128, 1, 3, 3, grad=True), _bf16(128, grad=True)
    tokens = _bf16(2, 1 + 9, 32, grad=True)
    front = {"prefix": 1, "height": 3, "width": 3}
    with torch.no_grad():
        _, u, conv_out = torch.ops.vitrain.locality_front(tokens, fc1_w, fc1_b, conv_w, conv_b, **front)
    return {
        "layer_norm": ((x, w, b), {"eps": 1e-6}),
        "add_layer_norm": ((x, _bf16(2, 5, 32, grad=True), w, b), {"eps": 1e-6}),
        "layer_norm_backward": ((_bf16(2, 5, 32), x.detach(), stats, stats.abs(), w.detach(), None), {}),
        "gelu": ((x,), {}),
        "gelu_backward": ((_bf16(4, 32), _bf16(4, 32)), {"column_sums": True}),
        "linear": ((x, fc1_w, fc1_b), {}),
        "linear_gelu": ((x, fc1_w, None), {}),
        "linear_backward": (
            (_bf16(2, 5, 128), x.detach(), fc1_w.detach(), _bf16(2, 5, 128)),
            {"has_bias": True, "input_grad": True},
        ),
        "depthwise_conv3x3": ((_image(2, 128, 4, grad=True), conv_w, conv_b), {}),
        "depthwise_conv3x3_backward": (
            (_image(2, 128, 4), _image(2, 128, 4), conv_w.detach()),
            {"has_bias": True, "input_grad": True},
        ),
        "locality_front": ((tokens, fc1_w, fc1_b, conv_w, conv_b), front),
        "locality_front_backward": (
            (_bf16(2, 10, 128), tokens.detach(), fc1_w.detach(), u, conv_out, conv_w.detach()),
            {"prefix": 1, "has_fc1_bias": True, "has_conv_bias": True, "input_grad": True},
        ),
    }


OPS = sorted(_samples())


@pytest.mark.parametrize("name", OPS)
def test_every_op_passes_opcheck(built, name):
    args, kwargs = _samples()[name]
    torch.library.opcheck(getattr(torch.ops.vitrain, name).default, args, kwargs)


def test_the_attention_ops_pass_opcheck_on_amx(built):
    if not kernels.paths().amx_tiles:
        pytest.skip("no AMX-BF16 here (or VITRAIN_AMX=off): the attention op runs only on AMX tiles")
    qkv = _bf16(2, 9, 3 * 2 * 32, grad=True)
    torch.library.opcheck(torch.ops.vitrain.attention.default, (qkv,), {"heads": 2, "scale": 0.2})
    _, stats = torch.ops.vitrain.attention(qkv.detach(), heads=2, scale=0.2)
    args = (_bf16(2, 9, 64), qkv.detach(), stats)
    torch.library.opcheck(torch.ops.vitrain.attention_backward.default, args, {"heads": 2, "scale": 0.2})


def test_every_registered_op_is_checked():
    """A new op in the ``vitrain`` namespace needs a sample above."""
    registered = {
        name
        for name in dir(torch.ops.vitrain)
        if isinstance(getattr(torch.ops.vitrain, name), torch._ops.OpOverloadPacket)
    }
    assert registered == {*OPS, "attention", "attention_backward"}


def _converted_vit() -> nn.Module:
    torch.manual_seed(0)
    model = build_model(
        "locality_vit_tiny6_patch7", img_size=14, in_chans=1, num_classes=4, embed_dim=96, attn_impl="matmul"
    )
    model = model.to(torch.bfloat16)
    kernels.convert(model)
    return model


def test_compile_traces_through_the_ops_and_matches_eager(built):
    """A converted bf16 model under ``torch.compile`` (AOT autograd): the compiled graph calls the
    registered ops, forward and backward, and gives eager's features and gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _converted_vit()
    images = torch.randn(4, 1, 14, 14).to(torch.bfloat16)

    def features_and_grads(function):
        out = function(images)
        return out, torch.autograd.grad(out.float().square().sum(), list(model.blocks.parameters()))

    eager, eager_grads = features_and_grads(model.forward_features)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled, compiled_grads = features_and_grads(torch.compile(model.forward_features, backend=counter))
    torch._dynamo.reset()
    assert counter.frame_count >= 1
    called = {str(node.target) for graph in counter.graphs for node in graph.graph.nodes}
    assert {"vitrain.layer_norm.default", "vitrain.locality_front.default", "vitrain.linear.default"} <= called
    assert "vitrain.add_layer_norm.default" in called  # the chained block stack, compiled whole
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for ours, reference in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_convert_swaps_only_what_runs_the_kernels_and_keeps_the_state():
    model = build_model("localvit_tiny6_patch7", img_size=14, in_chans=1, num_classes=4, embed_dim=96)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    parameters = list(model.parameters())
    swapped = kernels.convert(model)
    assert swapped > 0 and kernels.convert(model) == 0  # idempotent
    assert list(model.parameters()) == parameters  # the same objects: optimizers built before still work
    assert model.state_dict().keys() == state.keys()
    assert type(model.head) is nn.Linear  # the classifier keeps F.linear
    mlp = model.blocks[0].mlp
    assert type(mlp.se.fc1) is nn.Linear and type(mlp.depthwise).__name__ == "FusedDepthwiseConv2d"
    assert type(model.blocks[0].attn.qkv).__name__ == "FusedLinear"
    assert type(model.blocks).__name__ == "ChainedBlocks"


KERNEL_GRAPH_OPS: set[str] = set()


@register_backend
def kernel_recording_backend(graph_module, example_inputs):
    """Runs dynamo's graph as captured (no AOT, no inductor), noting the vitrain ops it calls."""
    KERNEL_GRAPH_OPS.update(str(node.target) for node in graph_module.graph.nodes if "vitrain" in str(node.target))
    return graph_module.forward


def test_compiled_o2_training_with_the_kernels_equals_eager(built, small_synthetic_overrides, tmp_path):
    """``performance.compile`` on a bf16 O2 run: the compiled blocks call the registered ops (before, compiled
    regions stepped aside to PyTorch's ops) and train to bitwise the eager run's weights."""
    from tests.conftest import make_config
    from vitrain.checkpoint import load_checkpoint
    from vitrain.train import make_plan, train

    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    KERNEL_GRAPH_OPS.clear()
    overrides = [*small_synthetic_overrides, "precision=bf16", "precision_mode=o2", "model.attn_impl=matmul"]
    overrides += ["train.steps=4", "model.name=locality_vit_tiny6_patch7", "performance.cpu_kernels=fused"]
    eager = make_plan(make_config(*overrides, f"train.out_dir={tmp_path / 'eager'}"))
    backend = "performance.compile_backend=kernel_recording_backend"
    compiled = make_plan(
        make_config(*overrides, "performance.compile=true", backend, f"train.out_dir={tmp_path / 'c'}")
    )
    try:
        train(eager)
        train(compiled)
    finally:
        torch._dynamo.reset()
    assert {
        "vitrain.layer_norm.default",
        "vitrain.locality_front.default",
        "vitrain.linear.default",
    } <= KERNEL_GRAPH_OPS
    final = "checkpoints/step-000000004.pt"
    ours = load_checkpoint(compiled.out_dir / final)["model"]
    reference = load_checkpoint(eager.out_dir / final)["model"]
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[key], reference[key]) for key in reference)
