"""An exponential moving average (EMA) of a model's weights, evaluated beside the live weights.

Weight averaging as DeiT trains with it (Touvron et al. 2021, decay 0.99996, through timm's ``ModelEma``):
after every ``train.ema.every_steps``-th optimizer step, ``ema = decay * ema + (1 - decay) * weights``,
starting from the initial weights. With ``train.ema.warmup`` the decay follows timm's ``ModelEmaV3`` warm-up
(:func:`ema_decay_at`).

- **fp32 always.** The EMA averages the weights the optimizer updates: the fp32 model (autocast), the fp32
  master (O2), FSDP's fp32 shards (O2 under FSDP); with precision_mode=full it keeps its own fp32 copy of
  the bf16/fp16 weights (an update of ``(1 - decay)`` of the difference is below their resolution).
- **Buffers** (BatchNorm running statistics) are copied at each update, not averaged.
- **Skipped steps** (a non-finite loss or gradient norm, :mod:`vitrain.train.step`) leave the EMA as it
  was: the update's weight is multiplied on the device by ``1 - skipped``, so no step waits for the host.
  (This is why the update is ``ema += weight * (live - ema)`` in three multi-tensor ops: ``_foreach_lerp_``
  takes its weight as a host number, or per tensor, and would need the flag on the host.)
- **Sharded parameters** (FSDP2, tensor parallelism): the EMA tensors are DTensors laid out as the
  parameters, so each process averages its own shards; checkpoints hold them as they hold the parameters.
- **Evaluation** copies the EMA weights into the model for the duration (:meth:`ModelEma.applied`) and
  the live ones back after: the same module, so compiled graphs, FSDP's sharding and its hooks serve both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from vitrain.config import EmaPlan
from vitrain.parallel.distributed import local_shard

WARMUP_POWER = 2 / 3
"""timm ModelEmaV3's default ``warmup_power`` (with ``warmup_gamma`` 1): decay 0.999 at 31.6k steps."""


def ema_decay_at(step: int, decay: float, warmup: bool) -> float:
    """The decay of the update after optimizer step ``step`` (counted from 1). Without warm-up, ``decay``.
    With it, timm's ``ModelEmaV3.get_decay`` (timm/utils/model_ema.py; use_warmup=True, warmup_gamma=1,
    warmup_power=2/3, update_after_step=0, min_decay=0): with ``t = step - 1``, 0 at ``t = 0`` (the EMA
    takes the weights), then ``min(decay, 1 - (1 + t) ** -(2/3))``."""
    if not warmup:
        return decay
    t = step - 1
    if t <= 0:
        return 0.0
    return min(decay, 1.0 - (1.0 + t) ** -WARMUP_POWER)


def _reshard(model: nn.Module) -> None:
    """FSDP2 may leave the root's parameters gathered after a forward without backward (evaluation):
    shard them again, so the registered parameters are the shards the EMA mirrors."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class ModelEma:
    """The EMA of ``model``'s parameters (fp32, laid out as the parameters) and a copy of its persistent
    buffers, keyed by the model's state-dict names (so EMA weights load as model weights)."""

    def __init__(self, model: nn.Module, plan: EmaPlan):
        self.model, self.plan = model, plan
        persistent = set(model.state_dict().keys())
        self.param_names = [name for name, _ in model.named_parameters()]
        self.buffer_names = [name for name, _ in model.named_buffers() if name in persistent]
        params, buffers = self._live()
        with torch.no_grad():
            self.params = [param.detach().to(torch.float32, copy=True) for param in params]
            self.buffers = [buffer.detach().clone() for buffer in buffers]

    def _live(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The model's parameters and persistent buffers now (looked up each time: loading may replace them)."""
        params, buffers = dict(self.model.named_parameters()), dict(self.model.named_buffers())
        return [params[name] for name in self.param_names], [buffers[name] for name in self.buffer_names]

    @torch.no_grad()
    def update(self, step: int, skipped: torch.Tensor | None = None) -> None:
        """Average the weights after optimizer step ``step`` into the EMA and copy the buffers; ``skipped``:
        the step's device flag (1.0: its update was skipped, and so is this one)."""
        weight: torch.Tensor | float = 1.0 - ema_decay_at(step, self.plan.decay, self.plan.warmup)
        if skipped is not None:
            weight = (1.0 - skipped.float()) * weight
        params, buffers = self._live()
        averages = [local_shard(average) for average in self.params]
        if isinstance(weight, torch.Tensor) and averages and weight.device != averages[0].device:
            weight = weight.to(averages[0].device)  # FSDP's CPU offload: the shards live on the host
        increments = torch._foreach_sub([local_shard(param) for param in params], averages)  # fp32 (promoted)
        torch._foreach_mul_(increments, weight)
        torch._foreach_add_(averages, increments)
        if buffers:
            torch._foreach_copy_(
                [local_shard(copy) for copy in self.buffers], [local_shard(buffer) for buffer in buffers]
            )

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average again from the model's weights (after loading other weights into it)."""
        params, buffers = self._live()
        torch._foreach_copy_(
            [local_shard(t) for t in self.params + self.buffers], [local_shard(t) for t in params + buffers]
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The EMA weights by model state-dict name (DTensors where the parameters are), not copies."""
        names = self.param_names + self.buffer_names
        return dict(zip(names, self.params + self.buffers, strict=True))

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy saved EMA weights (laid out as :meth:`state_dict`'s: the same shards) into the EMA."""
        own = self.state_dict()
        if state.keys() != own.keys():
            missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
            raise KeyError(f"EMA weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        for name, tensor in own.items():
            local_shard(tensor).copy_(local_shard(state[name]))

    @contextlib.contextmanager
    def applied(self) -> Iterator[nn.Module]:
        """The model holding the EMA weights (rounded to its dtype under precision_mode=full); its own
        weights and buffers are put back, bitwise, on exit."""
        _reshard(self.model)
        with torch.no_grad():
            params, buffers = self._live()
            live = [local_shard(tensor) for tensor in params + buffers]
            saved = [tensor.clone() for tensor in live]
            torch._foreach_copy_(live, [local_shard(tensor) for tensor in self.params + self.buffers])
        try:
            yield self.model
        finally:
            _reshard(self.model)
            with torch.no_grad():
                params, buffers = self._live()
                torch._foreach_copy_([local_shard(tensor) for tensor in params + buffers], saved)
