"""What a weights argument names, from its text and the file system alone: ``train.init_from``,
``train.distill.teacher`` and the ``--from`` of fine-tuning. Reading the weights is :mod:`vitrain.weights`'s work;
``resolve()`` checks the names here before any of it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

WEIGHTS_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
"""Weights files a timm model's weights are read from."""

TIMM_PREFIX = "timm:"
"""``train.init_from=timm:NAME``: fine-tune from timm's weights of model NAME."""

SourceKind = Literal["run", "checkpoint", "safetensors", "timm"]


def init_source_kind(source: str | Path) -> SourceKind:
    """What ``train.init_from`` names: ``timm:NAME``, a ``.safetensors`` file, or a checkpoint (a
    ``step-N.pt`` file, a sharded ``step-N/`` folder, or a run folder: its best)."""
    text = str(source)
    if text.startswith(TIMM_PREFIX):
        return "timm"
    return "safetensors" if Path(text).suffix == ".safetensors" else "checkpoint"


def teacher_source_kind(source: str | Path) -> SourceKind:
    """What ``source`` names, from its form alone: a run folder (a folder without a sharded checkpoint's
    metadata), a checkpoint, a ``.safetensors`` file, or (no path separator, no known suffix) a timm name."""
    path = Path(source)
    if path.is_dir():
        return "checkpoint" if (path / ".metadata").is_file() else "run"
    if path.suffix == ".safetensors":
        return "safetensors"
    if path.is_file() or "/" in str(source) or path.suffix in WEIGHTS_SUFFIXES:
        return "checkpoint"
    return "timm"
