"""A trained model ready to use, from its checkpoint alone: no training data, no training plan, no
``resolve()``. ``vitrain predict`` and ``vitrain export`` build their model here.

A checkpoint records what inference needs (:func:`inference_record`, written by every training run): the
model plan (name, options, image size, channels, classes), the normalization, the evaluation crop and
the class names. Checkpoints written before the record existed are read from their saved config and
their weights: the weights give the classes and channels, the data source's nominal description the
normalization (:func:`vitrain.data.sources.nominal_source_info`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitrain.checkpoint import CheckpointError, resolve_checkpoint_argument
from vitrain.checkpoint.sharded import read_checkpoint_model
from vitrain.config import (
    Config,
    ConfigError,
    DataConfig,
    DistillConfig,
    ModelPlan,
    Plan,
    TokenLabelConfig,
    build_config,
    resolve_device,
    stored_config,
)
from vitrain.config.precision import PrecisionPolicy
from vitrain.config.resolve import model_overrides, precision_policy
from vitrain.data import Normalize
from vitrain.data.sources import FASHION_MNIST_CLASSES, image_folder_root, image_folder_samples, nominal_source_info
from vitrain.models import build_model, model_spec
from vitrain.models.layers import SDPA_BACKENDS
from vitrain.models.timm_weights import inferred_model_args

log = logging.getLogger("vitrain")

INTERPOLATION = "bilinear"
"""How the evaluation transform resizes (``torchvision.transforms.v2.Resize``'s default)."""


def inference_record(plan: Plan, class_names: Sequence[str] | None) -> dict[str, Any]:
    """What a checkpoint keeps for inference (plain data: it is saved with ``weights_only`` loading)."""
    return {
        "model": dataclasses.asdict(plan.model),
        "mean": list(plan.data.mean),
        "std": list(plan.data.std),
        "image_size": plan.model.image_size,
        "crop_pct": plan.data.source.crop_pct,
        "interpolation": INTERPOLATION,
        "class_names": None if class_names is None else list(class_names),
    }


@dataclasses.dataclass(frozen=True)
class InferencePlan:
    """How a trained model classifies: its build, its device and precision, its input pipeline."""

    model: ModelPlan
    device: str
    precision: PrecisionPolicy
    data: DataConfig
    """The saved data section: image size, crop, decoding limits and workers of the evaluation pipeline."""
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: list[str] | None
    """The name of each class index; None when neither the checkpoint nor its data source gives them."""


def checkpoint_config(
    saved: dict[str, Any],
    yaml_files: Sequence[Path] = (),
    overrides: Sequence[str] = (),
    recorded: dict[str, Any] | None = None,
) -> Config:
    """A checkpoint's saved config, YAML files and ``--set`` overrides applied, for using its model in one
    process: whatever sharded the training run, and without the distillation teacher, the token-label maps
    and the initial checkpoint it trained from (they may be gone); an SDPA kernel the training run pinned
    (``model.attn_impl=sdpa_cudnn``, ...) becomes torch's choice (``sdpa``) unless ``overrides`` pin one.
    ``recorded``: the checkpoint's plan record, whose precision and mode (what the run's ``auto`` measured)
    replace ``auto`` unless ``overrides`` set them."""
    base = stored_config(saved)
    recorded = recorded or {}
    if base.precision == "auto" and recorded.get("precision"):
        base.precision = recorded["precision"]
    if base.precision_mode == "auto":
        base.precision_mode = recorded.get("precision_mode") or "autocast"
    if base.model.attn_impl in SDPA_BACKENDS:  # pinned for the training device; this one may lack the kernel
        base.model.attn_impl = "sdpa"
    config = build_config(base, list(yaml_files), list(overrides))
    config.parallel.strategy = "ddp"
    config.train.distill, config.token_labels, config.train.init_from = DistillConfig(), TokenLabelConfig(), None
    return config


def _source_class_names(data: DataConfig) -> list[str] | None:
    if data.name == "fashion-mnist":
        return list(FASHION_MNIST_CLASSES)
    if data.name == "synthetic":
        return [f"class_{index}" for index in range(data.synthetic_num_classes)]
    try:
        return image_folder_samples(image_folder_root(data), "train", data.val_fraction)[1]
    except (ConfigError, OSError) as error:
        log.warning("class names unknown (the checkpoint has none and its image folder cannot be read: %s)", error)
        return None


def known_class_names(data: DataConfig, info: dict[str, Any], num_classes: int) -> list[str] | None:
    """The name of each class index: recorded in the checkpoint, else read from the training data's
    source; None (with a warning) when neither gives ``num_classes`` names."""
    inference = info.get("inference")
    recorded = (inference if isinstance(inference, dict) else {}).get("class_names")
    recorded = recorded or info.get("plan", {}).get("class_names")
    names = recorded or _source_class_names(data)
    if names is not None and len(names) != num_classes:
        log.warning("the training data has %d class names, the model %d classes", len(names), num_classes)
        return None
    return None if names is None else list(names)


def _model_plan(config: Config, record: dict[str, Any], weights: dict[str, torch.Tensor]) -> ModelPlan:
    """The model to build: the config's options (overrides applied), the classes and channels the checkpoint
    records (older checkpoints: its weights)."""
    name = config.model.name
    try:
        args = model_spec(name).args
    except KeyError as error:
        raise CheckpointError(f"the checkpoint's model: {error.args[0]}") from None
    saved = record.get("model") or {}
    inferred = {} if saved else inferred_model_args(weights, name)
    num_classes = saved.get("num_classes", inferred.get("num_classes"))
    if num_classes is None:
        raise CheckpointError(f"the checkpoint's {name} weights have no classifier to predict with")
    return ModelPlan(
        name=name,
        options=model_overrides(config.model, args),
        image_size=config.data.image_size,
        in_chans=saved.get("in_chans", inferred.get("in_chans", args.in_chans)),
        num_classes=num_classes,
        patch_size=saved.get("patch_size", 0),
        choose_attention=False,
    )


def inference_plan(config: Config, info: dict[str, Any], weights: dict[str, torch.Tensor]) -> InferencePlan:
    """How the checkpoint's model classifies on this machine, from the checkpoint (``info``, ``weights``) and
    its adjusted config alone. ``precision=auto`` is what the training run computed in (fp32 if unknown)."""
    record = info.get("inference")
    record = record if isinstance(record, dict) else {}  # checkpoints before the record: None
    model = _model_plan(config, record, weights)
    device = resolve_device(config.train.device, torch.cuda.is_available())
    precision = config.precision
    if precision == "auto":
        precision = info.get("plan", {}).get("precision") or "fp32"
    nominal = None if record else nominal_source_info(config.data)
    mean = tuple(config.data.mean or record.get("mean") or nominal.mean)
    std = tuple(config.data.std or record.get("std") or nominal.std)
    names = known_class_names(config.data, info, model.num_classes)
    return InferencePlan(model, device, precision_policy(precision, "autocast", device), config.data, mean, std, names)


def build_inference_model(plan: InferencePlan, weights: dict[str, torch.Tensor]) -> nn.Module:
    """The plan's model with ``weights``, in eval mode on the plan's device (``attn_impl=auto``: torch's SDPA)."""
    model = build_model(plan.model.name, **plan.model.arguments)
    model.load_state_dict(weights)
    return model.to(plan.device).eval()


@dataclasses.dataclass(frozen=True)
class TrainedModel:
    """A checkpoint's model in eval mode on its device, with the plan of its inputs and its class names."""

    model: nn.Module
    plan: InferencePlan
    class_names: list[str]
    normalize: Normalize
    """uint8 batch -> the model's input, with the run's mean and std."""


def read_trained(
    checkpoint: Path, weights: str = "live", yaml_files: Sequence[Path] = (), overrides: Sequence[str] = ()
) -> tuple[InferencePlan, dict[str, torch.Tensor]]:
    """The inference plan and full weights of ``checkpoint`` (file, sharded folder, or run folder: its best
    checkpoint, else its newest; ``weights``: live or ema), ``yaml_files`` and ``overrides`` applied."""
    state, info = read_checkpoint_model(resolve_checkpoint_argument(checkpoint), weights)
    config = checkpoint_config(info.get("config", {}), yaml_files, overrides, info.get("plan"))
    return inference_plan(config, info, state), state


def load_trained_model(
    checkpoint: Path, weights: str = "live", yaml_files: Sequence[Path] = (), overrides: Sequence[str] = ()
) -> TrainedModel:
    """The model of ``checkpoint`` (see :func:`read_trained`), ready to classify; unknown class names are
    ``class_N`` (with a warning)."""
    plan, state = read_trained(checkpoint, weights, yaml_files, overrides)
    names = plan.class_names
    if names is None:
        log.warning("naming the classes class_0 .. class_%d", plan.model.num_classes - 1)
        names = [f"class_{index}" for index in range(plan.model.num_classes)]
    normalize = Normalize(plan.mean, plan.std, plan.device)
    return TrainedModel(build_inference_model(plan, state), plan, names, normalize)


def exported_model(checkpoint: Path, weights: str = "live") -> tuple[nn.Module, InferencePlan]:
    """A checkpoint's model (either format; ``weights``: ``live`` or ``ema``) as the exports write it: built
    by the registry, on the CPU in fp32, with no converter applied; with its inference plan."""
    plan, state = read_trained(checkpoint, weights, overrides=["train.device=cpu", "precision=fp32"])
    return build_inference_model(plan, state), plan
