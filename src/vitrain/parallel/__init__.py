"""Changes applied to a built model from outside (docs/architecture.md, "Speed tricks are applied
from outside"): :func:`parallelize` applies tensor parallelism, activation checkpointing, compile and FSDP2
or DDP, in this order."""

from vitrain.parallel.activation_checkpoint import apply_activation_checkpointing
from vitrain.parallel.parallelize import parallelize

__all__ = ["apply_activation_checkpointing", "parallelize"]
