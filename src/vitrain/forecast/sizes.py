"""What the model says about itself, per sharding unit: parameters, forward FLOPs, activation sizes. Read
from the model built on the meta device (no memory, no time) with torch's FLOP counter and forward
hooks, so the figures are the model's own, for every family the registry holds."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from vitrain.models import build_model, model_spec, num_parameters
from vitrain.parallel.parallelize import TENSOR_PARALLEL_LAYERS


@dataclasses.dataclass(frozen=True)
class Unit:
    """One FSDP unit (a block, or the root: what no block holds)."""

    name: str
    params: int
    flops: int
    """Forward FLOPs per image."""
    tp_flops: int
    """Of them, those in the layers tensor parallelism splits (and the attention between them)."""


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    model: str
    image_size: int
    num_classes: int
    params: int
    flops: int
    units: tuple[Unit, ...]
    """The root first, then the blocks in forward order."""
    matrix_params: int
    """Parameters of the blocks' matrices (Muon's share)."""
    block_output_numel: int
    """Elements of one block's output per image: what tensor parallelism all-reduces per row-parallel layer."""
    tp_activation_share: float
    """Share of the per-image activation elements produced inside the split layers (divided by TP)."""

    @property
    def largest_unit_params(self) -> int:
        return max(unit.params for unit in self.units[1:]) if len(self.units) > 1 else self.units[0].params

    def as_dict(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        record["units"] = len(self.units)
        record["largest_unit_params"] = self.largest_unit_params
        return record


def _trace(model: nn.Module, blocks: list[nn.Module], x: torch.Tensor) -> tuple[dict, dict[str, int]]:
    """One forward of ``x``: the FLOP counter's per-module counts, and the output elements of every leaf
    module and every block, by module name."""
    outputs: dict[str, int] = {}

    def record(name: str):
        def hook(module: nn.Module, inputs, output) -> None:
            if isinstance(output, torch.Tensor):
                outputs[name] = output.numel()

        return hook

    handles = [
        module.register_forward_hook(record(name))
        for name, module in model.named_modules()
        if not list(module.children()) or module in blocks
    ]
    try:
        with FlopCounterMode(display=False) as counter:
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return counter.get_flop_counts(), outputs


def model_sizes(model_name: str, image_size: int, num_classes: int) -> ModelSizes:
    """Count ``model_name`` at ``image_size`` px with ``num_classes`` outputs (one image through it on meta)."""
    overrides: dict[str, Any] = {"num_classes": num_classes}
    args = model_spec(model_name).args
    if hasattr(args, "img_size"):
        overrides["img_size"] = image_size
    model = build_model(model_name, device="meta", **overrides)
    blocks = model.block_modules()
    names = {module: name for name, module in model.named_modules()}
    block_names = [names[block] for block in blocks]
    x = torch.empty(1, getattr(args, "in_chans", 3), image_size, image_size, device="meta")
    counts, outputs = _trace(model, blocks, x)
    prefix = type(model).__name__

    def flops_of(name: str) -> int:
        return int(sum(counts.get(f"{prefix}.{name}" if name else prefix, {}).values()))

    total = flops_of("")
    units = []
    for name, block in zip(block_names, blocks, strict=True):
        split = sum(flops_of(f"{name}.{layer}") for layer in TENSOR_PARALLEL_LAYERS)
        attention = flops_of(f"{name}.attn") - flops_of(f"{name}.attn.qkv") - flops_of(f"{name}.attn.proj")
        params = sum(parameter.numel() for parameter in block.parameters())
        units.append(Unit(name, params, flops_of(name), split + max(attention, 0) if split else 0))
    params = num_parameters(model)
    root = Unit("root", params - sum(unit.params for unit in units), total - sum(unit.flops for unit in units), 0)
    matrices = sum(p.numel() for block in blocks for p in block.parameters() if p.ndim >= 2)
    leaves = {name: numel for name, numel in outputs.items() if name not in block_names}
    inside = sum(
        numel for name, numel in leaves.items() if any(name.endswith(layer) for layer in ("attn.qkv", "mlp.fc1", "act"))
    )
    in_blocks = sum(numel for name, numel in leaves.items() if any(name.startswith(f"{b}.") for b in block_names))
    return ModelSizes(
        model=model_name,
        image_size=image_size,
        num_classes=num_classes,
        params=params,
        flops=total,
        units=(root, *units),
        matrix_params=matrices,
        block_output_numel=outputs.get(block_names[-1], 0) if block_names else 0,
        tp_activation_share=inside / in_blocks if in_blocks else 0.0,
    )
