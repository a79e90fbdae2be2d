"""Changes applied to a built model from outside (STYLE.md §1.3): activation checkpointing now;
tensor parallelism, compile and FSDP2/DDP come in this order with the scale-out work."""

from vitrain.parallel.activation_checkpoint import apply_activation_checkpointing

__all__ = ["apply_activation_checkpointing"]
