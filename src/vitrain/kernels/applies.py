"""Where a fused op runs instead of PyTorch's: the check every op family makes on each call."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from vitrain.kernels import build


def applies(x: torch.Tensor, *params: torch.Tensor | None, under_autocast: bool = False) -> bool:
    """The fused path: the kernels loaded, a non-empty bf16 CPU tensor, outside autocast (unless the op's
    result is what autocast would give too: ``under_autocast``), and plain bf16 or float32 parameters
    (DTensors of tensor parallelism take PyTorch's ops). Also true while ``torch.compile`` traces: the ops
    are registered, so compiled graphs call them. No mode is checked here: only the modules that
    :func:`~vitrain.kernels.convert` swapped in call the ops, and a run converts its model only where
    :func:`~vitrain.kernels.wanted` says so for its plan."""
    if build.extension() is None:
        return False
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or isinstance(x, DTensor) or x.numel() == 0:
        return False
    if torch.is_autocast_enabled("cpu") and not under_autocast:
        return False
    for param in params:
        if param is None or param.dtype not in (torch.bfloat16, torch.float32) or isinstance(param, DTensor):
            return False
    return True
