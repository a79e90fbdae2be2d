"""The low-precision compute dtypes by the config's name (``precision=bf16|fp16``).

A leaf module: the training step (autocast, O2 and full weights) and ``parallelize`` (FSDP's
mixed-precision policy) both read it, and neither imports the other for it."""

from __future__ import annotations

import torch

LOW_PRECISION_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
