"""FP8 linear layers for training (``precision=fp8``): the blocks' linear layers swapped for torchao's
``Float8Linear``, applied from outside the model like the fused CPU kernels (:mod:`vitrain.kernels.converter`).

Which layers: the linear children of attention and FFN modules (ViT's qkv, proj, fc1, fc2; VOLO's and the
locality FFN's alike), never the patch embedding or the classifier head, and only those whose sides are
multiples of 16 (FP8 matrix products need it). ``Float8Linear`` keeps the parameters and state-dict keys of
``nn.Linear``, so checkpoints load into a plain model, and it composes with ``torch.compile``, O2's bf16
copy, FSDP2 and activation checkpointing. On a CPU torchao emulates the FP8 products (``emulate``): the
numerics of FP8, not its speed.

MFU stays honest with :func:`fp8_flop_share`: the share of the model's FLOPs that run in FP8, which
:func:`vitrain.metrics.peak.peak_flops` weighs the FP8 and bf16 peaks by.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from vitrain.kernels.converter import owned_linears

SCALINGS = ("tensorwise", "rowwise")
ALIGNMENT = 16
"""FP8 matrix products (``torch._scaled_mm``) need both sides of the weight to be multiples of 16."""


def selected_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the linear layers ``precision=fp8`` runs in FP8, in the model's order: the fused
    kernels' (:func:`~vitrain.kernels.converter.owned_linears`) whose sides are multiples of 16."""
    return [
        (name, module)
        for name, module in owned_linears(model)
        if module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0
    ]


def float8_config(scaling: str, emulate: bool):
    """torchao's training config of a scaling recipe (``tensorwise``, ``rowwise``)."""
    from torchao.float8 import Float8LinearConfig

    if scaling not in SCALINGS:
        raise ValueError(f"fp8 scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(scaling), emulate=emulate)


def convert(model: nn.Module, scaling: str, emulate: bool) -> list[str]:
    """Swap the :func:`selected_linears` of ``model`` for ``Float8Linear``, in place (same parameters);
    returns the names swapped. ``emulate``: FP8 in software (CPUs, GPUs before compute capability 8.9)."""
    from torchao.float8 import convert_to_float8_training

    names = {name for name, _ in selected_linears(model)}
    convert_to_float8_training(
        model, config=float8_config(scaling, emulate), module_filter_fn=lambda _module, name: name in names
    )
    return sorted(names)


def is_float8(module: nn.Module) -> bool:
    """Whether ``module`` is one of torchao's FP8 training linears."""
    return type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao.")


def fp8_flop_share(model: nn.Module, image_size: int, in_chans: int, forward_flops: int) -> float:
    """The share of a forward pass's ``forward_flops`` (per image) that ``precision=fp8`` runs in FP8: the
    :func:`selected_linears`' products, counted from their input shapes in one forward pass of one image on
    the meta device (``model`` should be on the meta device too: nothing is computed). The backward pass
    has the same share (each linear's two backward products are twice its forward one, as for the rest)."""
    flops = 0

    def count(module: nn.Module, inputs: tuple[torch.Tensor, ...], _output: torch.Tensor) -> None:
        nonlocal flops
        rows = inputs[0].numel() // module.in_features
        flops += 2 * rows * module.in_features * module.out_features

    hooks = [module.register_forward_hook(count) for _, module in selected_linears(model)]
    try:
        with torch.no_grad():
            model(torch.empty(1, in_chans, image_size, image_size, device="meta"))
    finally:
        for hook in hooks:
            hook.remove()
    return min(1.0, flops / forward_flops) if forward_flops else 0.0
