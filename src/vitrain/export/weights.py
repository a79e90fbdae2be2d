"""vitrain's own export: a checkpoint's full model weights as one safetensors file, with the saved config
and which weights (live or EMA) in its metadata: what ``finetune --from``, teachers and ``timm`` loaders
read without the run folder."""

from __future__ import annotations

import json
from pathlib import Path

from vitrain.checkpoint.sharded import read_checkpoint_model
from vitrain.io import CheckpointError

EXPORT_FORMAT = "vitrain-model-v1"


def export_model(checkpoint: Path, out: Path, weights: str = "live") -> int:
    """Write a checkpoint's full model weights (either format; ``weights``: ``live`` or ``ema``) as one
    safetensors file, the saved config and which weights in its metadata; returns the number of tensors."""
    from safetensors.torch import save_file

    tensors, info = read_checkpoint_model(checkpoint, weights)
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        metadata = {"format": EXPORT_FORMAT, "config": json.dumps(info.get("config", {})), "weights": weights}
        save_file({key: value.contiguous() for key, value in tensors.items()}, str(out), metadata=metadata)
    except OSError as error:
        raise CheckpointError(f"cannot write {out}: {error.strerror or error}; choose a writable path") from None
    return len(tensors)
