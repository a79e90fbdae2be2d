"""Where trained weights come from, for a teacher (distillation, token labels) and for fine-tuning:

- a vitrain run folder (its best checkpoint, else its newest) or checkpoint (``step-N.pt`` file or
  sharded ``step-N/`` folder), with its saved config;
- a ``.safetensors`` file written by ``vitrain export`` (the config is in its metadata), or any other
  safetensors state dict of a vitrain model;
- timm's weights of a timm model: a local file (``.safetensors``, ``.pth``, ``.bin``), or for
  fine-tuning (``timm:NAME``) the file the Hugging Face cache already holds. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from vitrain.config.weights import TIMM_PREFIX, SourceKind, init_source_kind


class WeightsSourceError(ValueError):
    """Weights that cannot be read; the message names the file or model and what to do."""


def read_vitrain_weights(path: Path, kind: SourceKind) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, saved config) of a run folder (its best checkpoint, else its newest), checkpoint or
    safetensors file (config ``{}`` when it carries no vitrain metadata), with the project's readers."""
    from vitrain.checkpoint import CheckpointError
    from vitrain.checkpoint.manager import resolve_checkpoint_argument
    from vitrain.checkpoint.sharded import read_checkpoint_model

    if not path.exists():
        raise WeightsSourceError(
            f"checkpoint {path} does not exist; give a run folder, a step-*.pt file or sharded step-* folder, a "
            ".safetensors file or a timm model"
        )
    if kind == "safetensors":
        tensors, metadata = _read_safetensors(path)
        try:
            config = json.loads(metadata.get("config", "{}"))
        except ValueError as error:
            raise WeightsSourceError(
                f"safetensors file {path}: its metadata's config is not JSON ({error}); export it again"
            ) from None
        if not isinstance(config, dict):
            raise WeightsSourceError(
                f"safetensors file {path}: its metadata's config is a {type(config).__name__}, not vitrain's; "
                "export it again"
            )
        return tensors, config
    try:
        state_dict, info = read_checkpoint_model(resolve_checkpoint_argument(path))
    except CheckpointError as error:
        raise WeightsSourceError(str(error)) from None
    return state_dict, info.get("config", {})


def read_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a .safetensors file, or a torch file (weights only) holding one, possibly under
    ``model`` or ``state_dict`` (DeiT's and many training scripts' layout)."""
    from vitrain.io import CheckpointError, read_torch_file

    path = Path(path)
    if not path.exists():
        raise WeightsSourceError(f"weights file {path} does not exist; give a local .safetensors, .pth or .bin file")
    if path.suffix == ".safetensors":
        return _read_safetensors(path, "weights file")[0]
    try:
        payload = read_torch_file(path, "weights file", WEIGHTS_FIX, "a .safetensors, .pth or .bin file of the weights")
    except CheckpointError as error:
        raise WeightsSourceError(str(error)) from None
    for key in ("model", "state_dict"):
        if isinstance(payload, dict) and isinstance(payload.get(key), dict):
            payload = payload[key]
    if not isinstance(payload, dict) or not any(isinstance(value, torch.Tensor) for value in payload.values()):
        raise WeightsSourceError(
            f"weights file {path} holds no state dict of tensors (a {type(payload).__name__}); give the model's "
            "weights file (.safetensors, .pth or .bin)"
        )
    return payload


WEIGHTS_FIX = "download or copy it again"


def _read_safetensors(path: Path, what: str = "safetensors file") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a .safetensors file; what keeps it from being read is a WeightsSourceError."""
    from vitrain.io import SAFETENSORS_FIX, CheckpointError, read_safetensors

    try:
        return read_safetensors(path, what, SAFETENSORS_FIX if what == "safetensors file" else WEIGHTS_FIX)
    except CheckpointError as error:
        raise WeightsSourceError(str(error)) from None


def cached_timm_weights(name: str) -> Path:
    """The weights file of timm model ``name`` (``arch`` or ``arch.tag``) that the local Hugging Face cache
    holds (``HF_HUB_CACHE``, else the hub's default); WeightsSourceError saying how to fetch it if none."""
    import timm
    from huggingface_hub import constants, try_to_load_from_cache

    config = timm.models.get_pretrained_cfg(name)
    repo = getattr(config, "hf_hub_id", None) if config is not None else None
    if not repo:
        raise WeightsSourceError(
            f"timm has no published weights for {name}; pass the weights file with train.init_weights=PATH"
        )
    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    for filename in ("model.safetensors", "pytorch_model.bin", getattr(config, "hf_hub_filename", None)):
        found = try_to_load_from_cache(repo, filename, cache_dir=cache) if filename else None
        if isinstance(found, str):
            return Path(found)
    raise WeightsSourceError(
        f"timm:{name}: the Hugging Face cache ({cache}) has no weights of {repo} and nothing is downloaded; "
        f"fetch them once (python -c \"import timm; timm.create_model('{name}', pretrained=True)\") or pass "
        "a local file with train.init_weights=PATH"
    )


ARCHITECTURE_KEYS = ("patch_size", "head", "stem", "mlp_ratio", "num_heads", "distill_token", "aux_head")
"""Model config keys that timm weights fix when they start a fine-tuning run: read from the tensors, else
the variant's (None); the recipe keeps the rest (attention kernel, dropout, stochastic depth)."""


def read_init_weights(
    source: str | Path, weights: Path | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, config) that ``train.init_from=source`` starts from: the saved config of vitrain
    weights, or for ``timm:NAME`` (timm's weights from ``weights``, else the Hugging Face cache) the vitrain
    model holding them (``{"model": {"name": ..., architecture keys}}``)."""
    kind = init_source_kind(source)
    if kind != "timm":
        if weights is not None:
            raise WeightsSourceError(
                f"train.init_weights={weights} goes with train.init_from=timm:NAME, not with {source}; remove it"
            )
        return read_vitrain_weights(Path(source), kind)
    from vitrain.models import model_spec
    from vitrain.models.timm_weights import inferred_model_args, variant_for_timm

    name = str(source)[len(TIMM_PREFIX) :]
    try:
        variant = variant_for_timm(name.split(".")[0])
    except ValueError as error:
        raise WeightsSourceError(f"train.init_from={source}: {error}") from None
    state_dict = read_weights_file(Path(weights) if weights is not None else cached_timm_weights(name))
    inferred = inferred_model_args(state_dict, variant)
    args = model_spec(variant).args
    inferred.setdefault("aux_head", inferred.get("use_aux_head"))  # VOLO's name for it
    default = {key: getattr(args, key, None) for key in ARCHITECTURE_KEYS}
    default["aux_head"] = getattr(args, "aux_head", getattr(args, "use_aux_head", None))
    model = {key: inferred.get(key) if inferred.get(key) != default[key] else None for key in ARCHITECTURE_KEYS}
    import timm

    pretrained = timm.models.get_pretrained_cfg(name)
    size = getattr(pretrained, "input_size", None)
    data = {"image_size": size[-1]} if size else {}
    return state_dict, {"model": {"name": variant, **model}, "data": data}
