"""A checkpoint's model as a timm model folder: ``model.safetensors`` in timm's layout and a Hugging Face
hub ``config.json``, so that ``timm.create_model("local-dir:OUT")`` builds and loads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vitrain.config import ConfigError
from vitrain.io import CheckpointError
from vitrain.models.timm_weights import timm_hub_config, to_timm
from vitrain.weights.inference import exported_model

TIMM_WEIGHTS_FILE, TIMM_CONFIG_FILE = "model.safetensors", "config.json"


def export_timm(checkpoint: Path, out: Path, weights: str = "live") -> dict[str, Any]:
    """Write a checkpoint's model (either format; ``weights``: ``live`` or ``ema``) as a timm model folder
    ``out`` (architecture, model arguments, input size, normalization, crop, class names in its config).
    ConfigError for a model timm has no equivalent of. Returns the timm architecture and the number of
    tensors."""
    from safetensors.torch import save_file

    model, plan = exported_model(checkpoint, weights)
    try:
        hub_config = timm_hub_config(plan.model.name, model, plan.mean, plan.std, plan.data.crop_pct, plan.class_names)
    except ValueError as error:
        raise ConfigError(f"--format timm: {error}; export vitrain's own format with --format safetensors") from None
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        timm_tensors = {key: value.contiguous() for key, value in to_timm(model).items()}
        save_file(timm_tensors, str(out / TIMM_WEIGHTS_FILE), metadata={"format": "pt"})
        (out / TIMM_CONFIG_FILE).write_text(json.dumps(hub_config, indent=2) + "\n")
    except OSError as error:
        raise CheckpointError(f"cannot write {out}: {error.strerror or error}; choose a writable folder") from None
    return {"architecture": hub_config["architecture"], "tensors": len(timm_tensors)}
