"""Activation checkpointing of a model's repeated blocks: their activations are recomputed in the
backward pass instead of stored, trading one extra forward of those blocks for memory.

Uses torch's composable ``checkpoint`` (forward hooks, non-reentrant, RNG state preserved for
dropout and stochastic depth), so parameter names and state dicts are unchanged.
"""

from __future__ import annotations

from typing import Literal

from torch import nn
from torch.distributed._composable import checkpoint

from vitrain.config import ConfigError


def apply_activation_checkpointing(model: nn.Module, num_blocks: int | Literal["all"]) -> int:
    """Checkpoint the first ``num_blocks`` of ``model.block_modules()`` (``"all"``: every one);
    return how many were wrapped."""
    blocks = model.block_modules()
    count = len(blocks) if num_blocks == "all" else num_blocks
    if count > len(blocks):
        raise ConfigError(
            f"performance.activation_checkpointing={num_blocks} but the model has {len(blocks)} blocks; "
            f"use a number up to {len(blocks)} or all"
        )
    if any(
        isinstance(module, nn.modules.batchnorm._BatchNorm) for block in blocks[:count] for module in block.modules()
    ):
        # the recomputation in backward would update the running statistics a second time
        raise ConfigError(
            f"performance.activation_checkpointing: {type(model).__name__} has BatchNorm in its blocks, whose running "
            "statistics the backward recomputation would update twice; set performance.activation_checkpointing=0"
        )
    for block in blocks[:count]:
        checkpoint(block)
    return count
