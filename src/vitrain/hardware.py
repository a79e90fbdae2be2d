"""The facts about this machine that ``resolve()`` is given (:class:`~vitrain.config.Hardware`): whether
CUDA is there and computes bf16, and on a CPU whether bf16 is native and AMX tiles may be used
(:mod:`vitrain.cpu_features`). Read here so that the config layer stays pure."""

from __future__ import annotations

from vitrain import cpu_features
from vitrain.config import ConfigError, Hardware


def detect_hardware(device: str = "auto") -> Hardware:
    """This machine's :class:`Hardware` for a run on ``device`` (``auto``, ``cpu``, ``cuda[:N]``); a bad
    ``VITRAIN_AMX`` is a ConfigError, before any work."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda and device != "cpu":
        index = torch.device(device).index if device.startswith("cuda") else None
        capability = tuple(torch.cuda.get_device_capability(index))
        return Hardware(cuda_available=cuda, bf16_supported=torch.cuda.is_bf16_supported(), cuda_capability=capability)
    try:
        cpu_features.amx_allowed_by_environment()
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return Hardware(
        cuda_available=cuda,
        bf16_supported=cpu_features.cpu_bf16_native(),
        bf16_emulated=True,
        amx_tiles=cpu_features.amx_tiles_in_environment(),  # not what an earlier run of this process set
    )
