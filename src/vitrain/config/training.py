"""The plan parts beyond the plain classification step: batch mixing (Mixup/CutMix), the weight EMA,
knowledge distillation and token labeling, each from its config section, with the keys that mean
nothing while it is off refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitrain.config import plan as parts
from vitrain.config.checks import model_facts_of, require, require_unused
from vitrain.config.plan import ModelFacts, ModelLookup, Stage
from vitrain.config.schema import Config
from vitrain.config.weights import WEIGHTS_SUFFIXES, teacher_source_kind


def mix_plan(
    config: Config, num_classes: int, stages: tuple[Stage, ...], batch: parts.BatchPlan
) -> parts.MixPlan | None:
    """Mixup/CutMix of the training batches (None when both are off), after checking that every stage's
    per-process batch can be paired and every stage's image size can hold a cutmix_minmax box."""
    data = config.data
    cutmix_alpha = 1.0 if data.cutmix_minmax is not None else data.cutmix  # timm: minmax turns CutMix on
    if data.mixup == 0 and cutmix_alpha == 0:
        return None
    for stage in stages:
        share = batch.per_process(stage.batch_size)
        require(
            data.mix_mode == "batch" or share % 2 == 0,
            f"data.mix_mode={data.mix_mode} pairs the images of each process's batch, but a batch of "
            f"{stage.batch_size} gives {share} per process; use an even per-process batch or data.mix_mode=batch",
        )
        if data.cutmix_minmax is not None:
            low, high = (int(stage.image_size * fraction) for fraction in data.cutmix_minmax)
            require(
                low < high,
                f"data.cutmix_minmax={list(data.cutmix_minmax)} leaves no box side to draw at {stage.image_size} px "
                f"({low} to {low} pixels); widen the range or set data.cutmix_minmax=null",
            )
    return parts.MixPlan(
        mixup_alpha=data.mixup,
        cutmix_alpha=cutmix_alpha,
        cutmix_minmax=data.cutmix_minmax,
        prob=data.mix_prob,
        switch_prob=data.mix_switch_prob,
        mode=data.mix_mode,
        label_smoothing=config.train.label_smoothing,
        num_classes=num_classes,
    )


def ema_plan(config: Config, total_steps: int | None) -> parts.EmaPlan:
    """The weight EMA; its other keys without train.ema.decay, or a cadence the run never reaches, are mistakes."""
    ema = config.train.ema
    if ema.decay == 0:
        unused = ema.model_copy(update={"evaluate": True})
        require_unused(unused, "train.ema", "decay", "an EMA", "set train.ema.decay (e.g. 0.9998)")
        return parts.EmaPlan()
    require(
        total_steps is None or ema.every_steps <= total_steps,
        f"train.ema.every_steps={ema.every_steps} exceeds the run's {total_steps} optimizer steps, so the EMA "
        f"would never be updated; use at most {total_steps}",
    )
    return parts.EmaPlan(decay=ema.decay, warmup=ema.warmup, every_steps=ema.every_steps, evaluate=ema.evaluate)


def _check_distill_token(config: Config, facts: ModelFacts) -> bool:
    """Whether the student has a distillation token (set here or by the variant), which needs the CLS head."""
    args = facts.args
    token = (
        config.model.distill_token if config.model.distill_token is not None else getattr(args, "distill_token", False)
    )
    head = config.model.head or getattr(args, "head", None)
    require(
        not token or head == "cls",
        f"model.distill_token=true with model.head={head}: the distillation head reads the CLS and distillation "
        "tokens; set model.head=cls or model.distill_token=false",
    )
    aux_head = config.model.aux_head if config.model.aux_head is not None else getattr(args, "aux_head", False)
    require(
        not (token and aux_head),
        "model.aux_head=true with a distillation token (model.distill_token, or a deit_*_distilled variant): "
        "the two heads do not combine; set model.aux_head=false or model.distill_token=false",
    )
    return token


def _check_teacher_source(distill: Any, models: ModelLookup) -> None:
    """The teacher's files exist and the keys fit its kind (a timm name needs its local weights file)."""
    kind = teacher_source_kind(distill.teacher)
    if kind == "timm":
        require(
            distill.teacher_weights is not None,
            f"train.distill.teacher={distill.teacher} is a timm model name and nothing is downloaded: pass "
            "--set train.distill.teacher_weights=PATH (a local .safetensors, .pth or .bin file of its weights)",
        )
        require(
            Path(distill.teacher_weights).is_file() and Path(distill.teacher_weights).suffix in WEIGHTS_SUFFIXES,
            f"train.distill.teacher_weights={distill.teacher_weights}: no such .safetensors/.pth/.bin file; give the path "
            f"of {distill.teacher}'s weights",
        )
    else:
        require(
            Path(distill.teacher).exists(),
            f"train.distill.teacher={distill.teacher}: no such run folder or file; give a run folder, a checkpoint, a "
            ".safetensors file from `vitrain export` or a timm model name",
        )
        require(
            distill.teacher_weights is None,
            f"train.distill.teacher_weights is for a timm-name teacher; train.distill.teacher={distill.teacher} holds its own "
            "weights: remove train.distill.teacher_weights",
        )
    require(
        distill.teacher_model is None or kind == "safetensors",
        "train.distill.teacher_model names the model of a .safetensors teacher; remove it for other teachers",
    )
    if distill.teacher_model is not None:
        model_facts_of(distill.teacher_model, models, "train.distill.teacher_model")


def distill_plan(config: Config, facts: ModelFacts, models: ModelLookup) -> parts.DistillPlan | None:
    """Knowledge distillation; its other keys without train.distill.kind, or distillation without a teacher,
    are mistakes. Loading the teacher (and checking its classes and image size) waits for the build."""
    distill = config.train.distill
    _check_distill_token(config, facts)
    if distill.kind == "none":
        require_unused(distill, "train.distill", "kind", "distillation", "set train.distill.kind=hard or soft,")
        return None
    require(
        distill.teacher is not None,
        f"train.distill.kind={distill.kind} needs a teacher: set train.distill.teacher to a run folder, checkpoint, "
        ".safetensors file or timm model name",
    )
    _check_teacher_source(distill, models)
    return parts.DistillPlan(**distill.model_dump())


def _check_token_label_inputs(config: Config) -> None:
    """What the dense targets cannot follow: pixel mixing, translation, another loss, another teacher signal."""
    data, train = config.data, config.train
    mixing = [f"data.{key}" for key in ("mixup", "cutmix") if getattr(data, key)]
    mixing += ["data.cutmix_minmax"] if data.cutmix_minmax is not None else []
    require(
        not mixing,
        f"{' and '.join(mixing)} with token_labels.maps: the dense targets do not follow pixel mixing (VOLO drops "
        "Mixup/CutMix for MixToken); set "
        + " ".join(f"{key}=0" for key in mixing)
        + " and token_labels.mix_token=true",
    )
    require(
        data.translate == 0,
        f"data.translate={data.translate} with token_labels.maps: the dense targets follow the crop and flip, not "
        "the shift; set data.translate=0",
    )
    require(
        train.loss == "ce",
        f"train.loss={train.loss} with token_labels.maps: the token-labeling loss is a soft-target cross-entropy; "
        "set train.loss=ce",
    )
    require(
        train.distill.kind == "none",
        f"train.distill.kind={train.distill.kind} with token_labels.maps: use one teacher signal; set "
        "train.distill.kind=none or token_labels.maps=null",
    )


def token_label_plan(config: Config, num_classes: int, patch: int, facts: ModelFacts) -> parts.TokenLabelPlan | None:
    """Token labeling (``token_labels.maps``); its other keys without it, or with what its targets cannot
    follow, or a model without an auxiliary head, are mistakes. The maps themselves are opened and checked
    against the training images at the build."""
    labels = config.token_labels
    if labels.maps is None:
        how = "set token_labels.maps to a folder of label maps (`vitrain label`)"
        require_unused(labels, "token_labels", "maps", "token labels", how)
        return None
    require(
        labels.maps.is_dir(),
        f"token_labels.maps={labels.maps}: no such folder; make label maps with "
        f"`vitrain label --teacher T --out {labels.maps}` (docs/token-labeling.md)",
    )
    _check_token_label_inputs(config)
    args = facts.args
    default_aux = getattr(args, "aux_head", getattr(args, "use_aux_head", None))
    aux_head = config.model.aux_head if config.model.aux_head is not None else default_aux
    require(
        default_aux is not None,
        f"token_labels.maps: {config.model.name} has no token grid to label; use a ViT, DeiT, LocalViT or VOLO",
    )
    require(
        bool(aux_head),
        f"token_labels.maps needs an auxiliary head on the patch tokens, which {config.model.name} is built "
        "without; set model.aux_head=true",
    )
    return parts.TokenLabelPlan(
        maps=labels.maps,
        num_classes=num_classes,
        dense_weight=labels.dense_weight,
        cls_weight=labels.cls_weight,
        ground_truth=labels.ground_truth,
        mix_token=labels.mix_token,
        mix_alpha=labels.mix_token_alpha,
        patch_size=patch,
    )
