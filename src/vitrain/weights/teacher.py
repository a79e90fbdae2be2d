"""A frozen teacher model for knowledge distillation (DeiT, Touvron et al. 2021), from one of:

- a vitrain run folder (its best checkpoint, else its newest) or checkpoint (``step-N.pt`` file or
  sharded ``step-N/`` folder): the model its saved config names;
- a ``.safetensors`` file written by ``vitrain export`` (the config is in its metadata), or any
  other safetensors state dict of a vitrain model named by ``model``;
- a timm model name with a local weights file (``.safetensors``, ``.pth``, ``.bin``): nothing is
  downloaded.

The teacher comes back in eval mode with ``requires_grad=False`` on ``device``; the caller runs it
under ``torch.no_grad()``. Every process holds a whole copy (it is not sharded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitrain.config.weights import WEIGHTS_SUFFIXES, teacher_source_kind
from vitrain.models import build_model, load_weights, model_spec
from vitrain.models.timm_weights import inferred_model_args
from vitrain.weights.sources import (
    WeightsSourceError,
    read_vitrain_weights,
    read_weights_file,
)

__all__ = ["WEIGHTS_SUFFIXES", "TeacherError", "load_teacher", "teacher_source_kind"]


class TeacherError(WeightsSourceError):
    """A teacher that cannot be loaded; the message says which file or name and what to do."""


def load_teacher(
    source: str | Path,
    *,
    weights: str | Path | None = None,
    model: str | None = None,
    num_classes: int,
    in_chans: int = 3,
    image_sizes: Iterable[int] = (),
    device: str | torch.device = "cpu",
) -> nn.Module:
    """The frozen teacher ``source`` names (see the module docstring): eval mode, no gradients, on
    ``device``. ``weights``: the weights file of a timm name; ``model``: the vitrain model of a safetensors
    file without vitrain metadata. It must output ``num_classes`` logits and accept images of
    ``in_chans`` channels at every size of ``image_sizes``; otherwise :class:`TeacherError`."""
    kind = teacher_source_kind(source)
    if kind == "timm":
        teacher = _timm_teacher(str(source), weights, num_classes, in_chans)
    else:
        if weights is not None:
            raise TeacherError(f"a weights file ({weights}) goes with a timm model name, not with {source}; drop it")
        try:
            state_dict, config = read_vitrain_weights(Path(source), kind)
        except WeightsSourceError as error:
            raise TeacherError(str(error)) from None
        teacher = _vitrain_teacher(state_dict, config, model, source, num_classes)
    _check_sizes(teacher, image_sizes, source)
    teacher.to(device).eval().requires_grad_(False)
    return teacher


def _vitrain_teacher(
    state_dict: Mapping[str, torch.Tensor], config: dict[str, Any], name: str | None, source: Any, num_classes: int
) -> nn.Module:
    """The vitrain model of ``config`` (or ``name``) holding ``state_dict``; sizes read from the weights."""
    saved = config.get("model", {})
    name = name or saved.get("name")
    if name is None:
        raise TeacherError(
            f"{source} carries no vitrain config (not written by `vitrain export`); name its model with "
            "train.distill.teacher_model (see `vitrain list-models`)"
        )
    try:
        spec = model_spec(name)
    except KeyError as error:
        raise TeacherError(f"teacher model: {error.args[0]}") from None
    fields = {field.name for field in dataclasses.fields(spec.args)}
    options = {key: value for key, value in saved.items() if key in fields and value is not None and value != "auto"}
    options.update(inferred_model_args(state_dict, name))
    if options.get("num_classes", num_classes) != num_classes:
        raise _class_count_error(source, options["num_classes"], num_classes)
    teacher = build_model(name, **options)
    try:
        load_weights(teacher, dict(state_dict))
    except RuntimeError as error:
        raise TeacherError(f"the weights do not fit {name}: {_load_problem(error)}") from None
    return teacher


def _load_problem(error: RuntimeError) -> str:
    """The first lines of ``load_state_dict``'s complaint (missing, unexpected or mismatched keys), shortened."""
    details = " ".join(line.strip() for line in str(error).splitlines()[1:3])
    return details[:300] + ("..." if len(details) > 300 else "")


def _class_count_error(source: Any, teacher_classes: int, data_classes: int) -> TeacherError:
    return TeacherError(
        f"the teacher {source} outputs {teacher_classes} classes but the data has {data_classes}; "
        f"use a teacher trained on this data's {data_classes} classes (or fine-tune it to them first)"
    )


def _timm_teacher(name: str, weights: str | Path | None, num_classes: int, in_chans: int) -> nn.Module:
    try:
        import timm
    except ImportError:
        raise TeacherError(f"{name} is a timm model name but timm is not installed; pip install timm") from None
    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:5]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise TeacherError(f"{name} is neither a file nor a timm model name{hint}; check the name or the path")
    if weights is None:
        raise TeacherError(
            f"the timm teacher {name} needs its weights file: pass --set train.distill.teacher_weights=PATH"
        )
    path = Path(weights)
    try:
        state_dict = read_weights_file(path)
    except WeightsSourceError as error:
        raise TeacherError(f"teacher {error}") from None
    teacher = timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_chans)
    own = teacher.state_dict()
    classifier = teacher.get_classifier()
    classifier_names = {
        f"{module_name}.weight"
        for module_name, module in teacher.named_modules()
        if module is classifier or (isinstance(classifier, tuple) and any(module is c for c in classifier))
    }
    for key in classifier_names:
        if key in state_dict and state_dict[key].shape[0] != own[key].shape[0]:
            raise _class_count_error(f"{name} ({path})", state_dict[key].shape[0], num_classes)
    try:
        teacher.load_state_dict(state_dict)
    except RuntimeError as error:
        raise TeacherError(f"{path} does not hold weights of timm's {name}: {_load_problem(error)}") from None
    return teacher


def _fixed_image_size(teacher: nn.Module) -> tuple[int, int] | None:
    """The one input size a timm ViT-like model accepts (its patch embedding's strict size), else None."""
    patch_embed = getattr(teacher, "patch_embed", None)
    if getattr(patch_embed, "strict_img_size", False) and not getattr(teacher, "dynamic_img_size", False):
        return tuple(patch_embed.img_size)
    return None


def _check_sizes(teacher: nn.Module, image_sizes: Iterable[int], source: Any) -> None:
    """The teacher sees the student's images as they are (no resizing): each size must be one it accepts."""
    fixed = _fixed_image_size(teacher)
    args = getattr(teacher, "args", None)
    stride = getattr(args, "total_stride", getattr(args, "patch_size", 1))
    for size in image_sizes:
        if fixed is not None and (size, size) != fixed:
            raise TeacherError(
                f"the teacher {source} takes {fixed[0]}x{fixed[1]} images but the student trains on {size} px; "
                "images are not resized for it: use a teacher for this size or change data.image_size"
            )
        if size % stride:
            raise TeacherError(
                f"the teacher {source} needs image sides divisible by {stride}, but the student trains on {size} px"
            )
