"""The precision policy of a run: what it computes in and how, as ``resolve()`` decided it.

A leaf module: the training step (autocast, O2 and full weights), evaluation, the optimizer (Muon's
Newton-Schulz dtype) and ``parallelize`` (FSDP's mixed-precision policy) all read the policy, and none
imports another for it. The decision itself is :func:`vitrain.config.resolve.precision_policy`."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

LOW_PRECISIONS = ("bf16", "fp16")

Weights = Literal["fp32", "low_precision_copy", "low_precision", "fsdp_mixed_precision"]


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """How a run computes. ``weights`` says which weights the training forward and backward use:

    - ``fp32``: the model's fp32 weights (fp32 runs, and autocast for bf16/fp16);
    - ``low_precision_copy``: O2, a copy of the model in the compute dtype; the fp32 model stays the
      master that the optimizer updates (``vitrain.train.step.LowPrecisionWeights``);
    - ``low_precision``: full, the model itself in the compute dtype, no master copy;
    - ``fsdp_mixed_precision``: O2 under FSDP2, whose mixed-precision policy gathers low-precision
      parameters from the fp32 shards and reduces gradients in fp32.
    """

    dtype: Literal["fp32", "bf16", "fp16"]
    """The compute precision (``precision``)."""
    mode: Literal["autocast", "o2", "full"]
    """``precision_mode`` (autocast for fp32, where the mode changes nothing)."""
    device: str
    weights: Weights
    autocast: bool
    """The training forward runs under autocast (precision_mode=autocast in bf16/fp16)."""
    loss_scaling: bool
    """Dynamic loss scaling (fp16: its exponent range is too narrow for small gradients)."""
    fp8_scaling: str | None = None
    """precision=fp8: the blocks' linear layers compute in FP8 with this scaling (tensorwise, rowwise), the
    rest as bf16 (``dtype`` is then bf16); None: no FP8."""

    @property
    def name(self) -> str:
        """The precision as the user names it: fp8 for bf16 with FP8 linear layers, else :attr:`dtype`."""
        return "fp8" if self.fp8_scaling else self.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        import torch  # torch only once a run computes: the config layer stays light

        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.dtype, torch.float32)

    @property
    def casts_inputs(self) -> bool:
        """The training step casts its input images to the compute dtype (O2's copy and full)."""
        return self.weights in ("low_precision_copy", "low_precision")

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype of the weights the training forward computes with."""
        import torch

        return torch.float32 if self.weights == "fp32" else self.compute_dtype

    def autocast_context(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype for bf16/fp16, a no-op for fp32: evaluation runs under it in every
        mode, the training forward only where :attr:`autocast` is set."""
        if self.dtype not in LOW_PRECISIONS:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(torch.device(self.device).type, dtype=self.compute_dtype)

    def evaluation_context(self) -> contextlib.AbstractContextManager:
        """What evaluation runs under besides autocast: inference mode, or no_grad for FP8 (torchao's FP8
        tensors cannot be made under inference mode and autocast together)."""
        import torch

        return torch.no_grad() if self.fp8_scaling else torch.inference_mode()

    def training_context(self) -> contextlib.AbstractContextManager:
        """What the training forward runs under: autocast where the policy says, else nothing."""
        return self.autocast_context() if self.autocast else contextlib.nullcontext()
