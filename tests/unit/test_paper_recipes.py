"""The papers' recipes hold the published hyper-parameters, resolve, and train on synthetic data.

Each table lists every value a recipe sets, with where it comes from, so that a changed recipe fails.
Sources: DeiT = Touvron et al. 2021 (Table 9) and facebookresearch/deit main.py defaults / README commands;
DeiT III = Touvron et al. 2022 and facebookresearch/deit README_revenge.md's ImageNet-1k commands;
VOLO = NVIDIA's VOLO walkthrough (Table 2, setup notes) and sail-sg/volo main.py defaults;
Borealis = Irandoust et al. 2022, appendix A.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.conftest import SMALL_SYNTHETIC_RUN, make_config
from vitrain.config import ConfigError
from vitrain.recipes import get_recipe
from vitrain.train import make_plan, train

DEIT_COMMON: dict[str, Any] = {
    "data.name": "imagefolder",
    "data.image_size": 224,  # Table 9: train and test at 224
    "data.crop_pct": 0.875,  # timm's eval crop used by DeiT's datasets.py (resize 256 -> crop 224)
    "data.randaugment": "rand-m9-mstd0.5-inc1",  # Table 9 "Rand-Augment 9/0.5"; main.py --aa
    "data.color_jitter": 0.0,  # main.py's 0.4 is dropped by timm when RandAugment is on
    "data.random_erase": 0.25,  # Table 9 "Erasing 0.25"; main.py --reprob
    "data.repeated_aug": 3,  # Table 9 "Repeated Aug"; samplers.py RASampler repeats 3
    "data.mixup": 0.8,  # Table 9 "Mixup alpha 0.8"
    "data.cutmix": 1.0,  # Table 9 "Cutmix alpha 1.0"
    "data.mix_prob": 1.0,  # main.py --mixup-prob
    "data.mix_switch_prob": 0.5,  # main.py --mixup-switch-prob
    "data.mix_mode": "batch",  # main.py --mixup-mode
    "train.batch_size": 1024,  # Table 9 "Batch size 1024"
    "train.epochs": 300,  # Table 9 "Epochs 300"
    "train.loss": "ce",  # soft-target cross-entropy with mixup (main.py)
    "train.label_smoothing": 0.1,  # Table 9 "Label smoothing 0.1"
    "train.ema.decay": 0.0,  # main.py keeps an EMA but evaluates the live model
    "optim.name": "adamw",  # Table 9 "Optimizer AdamW"
    "optim.lr": 5e-4,  # Table 9 "lr 5e-4 x batch/512"
    "optim.reference_batch": 512,  # main.py linear_scaled_lr divides by 512
    "optim.weight_decay": 0.05,  # Table 9 "Weight decay 0.05"
    "optim.grad_clip": None,  # Table 9 "Gradient Clip no"
    "optim.betas": (0.9, 0.999),  # main.py --opt-betas: AdamW's defaults
    "optim.eps": 1e-8,  # main.py --opt-eps
    "schedule.name": "cosine",  # Table 9 "LR decay cosine"
    "schedule.warmup_epochs": 5,  # Table 9 "Warmup epochs 5"
    "schedule.warmup_start": 1e-6 / 1e-3,  # main.py --warmup-lr 1e-6 at peak 1e-3 (batch 1024)
    "schedule.min_lr_ratio": 1e-5 / 1e-3,  # main.py --min-lr 1e-5 at peak 1e-3
    "model.drop_path_rate": 0.1,  # Table 9 "Stoch. Depth 0.1"; main.py --drop-path, README leaves it
}

DEIT3_COMMON: dict[str, Any] = {
    "data.name": "imagefolder",
    "data.crop_pct": 1.0,  # timm's configs of the deit3_*_224 weights; main.py default 0.875 unset by commands
    "data.randaugment": None,  # --ThreeAugment replaces RandAugment
    "data.three_augment": True,  # README_revenge.md --ThreeAugment
    "data.color_jitter": 0.3,  # README_revenge.md --color-jitter 0.3
    "data.random_erase": 0.0,  # README_revenge.md --reprob 0.0
    "data.repeated_aug": 3,  # README_revenge.md --repeated-aug (RASampler's 3)
    "data.mixup": 0.8,  # README_revenge.md --mixup .8
    "data.cutmix": 1.0,  # README_revenge.md --cutmix 1.0
    "data.mix_prob": 1.0,  # main.py --mixup-prob default
    "data.mix_switch_prob": 0.5,  # main.py --mixup-switch-prob default
    "data.mix_mode": "batch",  # main.py --mixup-mode default
    "train.batch_size": 2048,  # README_revenge.md --batch 256 on 8 GPUs
    "train.epochs": 800,  # README_revenge.md --epochs 800; the model zoo's 81.4 / 83.8
    "train.loss": "bce",  # README_revenge.md --bce-loss; paper sec. 3
    "train.label_smoothing": 0.0,  # README_revenge.md --smoothing 0.0
    "train.ema.decay": 0.0,  # no EMA in the commands' evaluation
    "optim.name": "lamb",  # README_revenge.md --opt fusedlamb
    "optim.reference_batch": 2048,  # --unscale-lr: lr applies at the command's batch as given
    "optim.weight_decay": 0.05,  # README_revenge.md --weight-decay 0.05
    "optim.grad_clip": None,  # main.py --clip-grad default None
    "schedule.name": "cosine",  # README_revenge.md --sched cosine
    "schedule.warmup_epochs": 5,  # README_revenge.md --warmup-epochs 5
}

VOLO_COMMON: dict[str, Any] = {
    "data.name": "imagefolder",
    "data.image_size": 224,  # walkthrough: pretraining at 224
    "data.randaugment": "rand-m9-mstd0.5-inc1",  # setup notes "RandAug"; sail-sg/volo main.py --aa
    "data.random_erase": 0.25,  # setup notes "CutOut"; sail-sg/volo main.py --reprob (timm random erasing)
    "data.mixup": 0.0,  # setup notes: no MixUp (conflicts with MixToken)
    "data.cutmix": 0.0,  # setup notes: no CutMix
    "optim.name": "adamw",  # Table 2 "Optimizer AdamW"
    "optim.weight_decay": 0.05,  # Table 2 "Weight Decay 5e-2"
    "train.epochs": 300,  # setup notes: 300 epochs
    "schedule.warmup_epochs": 20,  # sail-sg/volo main.py --warmup-epochs
}

BOREALIS_COMMON: dict[str, Any] = {
    "data.name": "imagefolder",
    "data.image_size": 224,  # appendix A: ImageNet at 224
    "train.batch_size": 64,  # appendix A: batch 64
    "train.budget": "24h",  # the benchmark: 24 h on one GPU
    "train.epochs": None,
    "train.loss": "ce",  # appendix A: cross-entropy
    "train.label_smoothing": 0.1,  # appendix A: label smoothing (DeiT's 0.1)
    "optim.name": "adamw",  # appendix A: AdamW
    "optim.lr": 1e-3,  # appendix A: lr 1e-3
    "optim.reference_batch": 64,
    "schedule.warmup_epochs": 0,  # appendix A: no warmup
    # appendix A: "quite similar to DeiT"; no augmentation change is named, so DeiT's main.py defaults
    "data.randaugment": "rand-m9-mstd0.5-inc1",
    "data.mixup": 0.8,
    "data.cutmix": 1.0,
    "data.mix_prob": 1.0,
    "data.mix_switch_prob": 0.5,
    "data.mix_mode": "batch",
    "data.random_erase": 0.25,
    "data.repeated_aug": 3,
}

DEIT_DISTILLED: dict[str, Any] = {
    **DEIT_COMMON,
    "train.distill.kind": "hard",  # README commands --distillation-type hard; sec. 5.2 "hard distillation"
    "train.distill.alpha": 0.5,  # main.py --distillation-alpha default
    "train.distill.tau": 1.0,  # main.py --distillation-tau default
    "train.distill.teacher": "regnety_160",  # README commands --teacher-model regnety_160 (RegNetY-16GF, sec. 5.2)
    "train.distill.teacher_weights": None,  # the user's local copy of regnety_160-a5fe301d.pth
}

EXPECTED: dict[str, dict[str, Any]] = {
    "deit_ti_300ep": {**DEIT_COMMON, "model.name": "deit_tiny_patch16"},
    "deit_s_300ep": {**DEIT_COMMON, "model.name": "deit_small_patch16"},
    "deit_b_300ep": {**DEIT_COMMON, "model.name": "deit_base_patch16"},
    "deit_ti_distilled_300ep": {**DEIT_DISTILLED, "model.name": "deit_tiny_distilled_patch16"},
    "deit_s_distilled_300ep": {**DEIT_DISTILLED, "model.name": "deit_small_distilled_patch16"},
    "deit_b_distilled_300ep": {**DEIT_DISTILLED, "model.name": "deit_base_distilled_patch16"},
    "deit3_s": {
        **DEIT3_COMMON,
        "model.name": "deit3_small_patch16",  # README_revenge.md --model deit_small_patch16_LS (LayerScale)
        "model.drop_path_rate": 0.05,  # README_revenge.md ViT-S --drop-path 0.05
        "data.image_size": 224,  # README_revenge.md ViT-S --input-size 224
        "optim.lr": 4e-3,  # README_revenge.md ViT-S --lr 4e-3
        "schedule.warmup_start": 1e-6 / 4e-3,  # --warmup-lr 1e-6
        "schedule.min_lr_ratio": 1e-5 / 4e-3,  # main.py --min-lr 1e-5
    },
    "deit3_b": {
        **DEIT3_COMMON,
        "model.name": "deit3_base_patch16",  # README_revenge.md --model deit_base_patch16_LS (LayerScale)
        "model.drop_path_rate": 0.2,  # README_revenge.md ViT-B --drop-path 0.2
        "data.image_size": 192,  # README_revenge.md ViT-B --input-size 192 (then fine-tuned at 224)
        "optim.lr": 3e-3,  # README_revenge.md ViT-B --lr 3e-3
        "schedule.warmup_start": 1e-6 / 3e-3,
        "schedule.min_lr_ratio": 1e-5 / 3e-3,
    },
    "volo_d1_224": {
        **VOLO_COMMON,
        "model.name": "volo_d1",
        "model.drop_path_rate": 0.1,  # Table 2 "Stochastic Depth Rate" D1
        "data.crop_pct": 0.96,  # Table 2 "Crop Ratio" D1
        "optim.lr": 1.6e-3,  # sail-sg/volo README command at batch 1024
        "optim.reference_batch": 1024,  # Table 2: LR = LRbase x batch / 1024
        "train.batch_size": 1024,  # Table 2: batch 1024
    },
    "volo_d5_224": {
        **VOLO_COMMON,
        "model.name": "volo_d5",
        "model.drop_path_rate": 0.75,  # Table 2 D5
        "data.crop_pct": 1.15,  # Table 2 "Crop Ratio" D5
        "optim.lr": 1e-4,  # Table 2 LRbase D5
        "optim.reference_batch": 352,  # the walkthrough's command: batch 44 x 8 GPUs
        "train.batch_size": 352,
    },
    "volo_d5_ft_512": {
        **VOLO_COMMON,
        "model.name": "volo_d5",
        "model.drop_path_rate": 0.5,  # the walkthrough's fine-tune command
        "data.image_size": 512,
        "data.crop_pct": 1.15,  # Table 2 D5
        "optim.lr": 2.3e-5,
        "optim.reference_batch": 32,  # batch 4 x 8 GPUs
        "optim.weight_decay": 1e-8,
        "train.batch_size": 32,
        "train.epochs": 30,
        "schedule.warmup_epochs": 5,
    },
    "borealis_24h_1gpu": {
        **BOREALIS_COMMON,
        "model.name": "locality_vit_small_patch16",  # the paper's model: locality ViT-S/16
        "curriculum.start_size": 32,  # sec. 2.2: 32 px first
        "curriculum.grow_by": 32,  # sec. 2.2: +32 px
        "curriculum.grow_every_epochs": 5,  # sec. 2.2: every 5 epochs
    },
    "deit_s_24h_1gpu": {**BOREALIS_COMMON, "model.name": "deit_small_patch16"},
}


def value_at(config: Any, dotted: str) -> Any:
    return functools.reduce(getattr, dotted.split("."), config)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_holds_the_published_values(name):
    config = get_recipe(name)
    differing = {
        key: (value_at(config, key), expected)
        for key, expected in EXPECTED[name].items()
        if value_at(config, key) != pytest.approx(expected)
    }
    assert not differing, f"{name}: (recipe, published) per key: {differing}"


@pytest.fixture
def teacher_weights(tmp_path):
    """A stand-in for the distilled recipes' teacher weights file: resolve checks only that it exists."""
    path = tmp_path / "regnety_160.pth"
    path.touch()
    return path


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_resolves_to_its_batch_and_lr(name, teacher_weights):
    config = get_recipe(name)
    if config.train.distill.teacher is not None:
        config.train.distill.teacher_weights = teacher_weights
    plan = make_plan(make_config("data.name=synthetic", base=config), measure=False)  # the plan, not its speed
    assert plan.batch.global_batch == config.train.batch_size
    assert plan.schedule.lr == pytest.approx(config.optim.lr * config.train.batch_size / config.optim.reference_batch)


@pytest.mark.parametrize("name", [name for name in sorted(EXPECTED) if "distilled" in name])
def test_distilled_recipe_asks_for_the_teacher_weights(name, teacher_weights):
    with pytest.raises(ConfigError, match="--set train.distill.teacher_weights=PATH"):
        make_plan(make_config("data.name=synthetic", base=get_recipe(name)), measure=False)
    plan = make_plan(
        make_config("data.name=synthetic", f"train.distill.teacher_weights={teacher_weights}", base=get_recipe(name)),
        measure=False,
    )
    assert (plan.step.distill.kind, plan.step.distill.teacher) == ("hard", "regnety_160")


def test_deit_peak_lr_is_1e_3_at_batch_1024():
    plan = make_plan(make_config("data.name=synthetic", base=get_recipe("deit_s_300ep")), measure=False)
    assert plan.schedule.lr == pytest.approx(1e-3)  # 5e-4 x 1024 / 512, DeiT's linear scaling


@pytest.mark.parametrize("name", ["deit_s_300ep", "deit3_s", "volo_d1_224"])
def test_recipe_augmentation_trains_two_steps(name, tmp_path, one_thread):
    tiny = [*SMALL_SYNTHETIC_RUN, "train.steps=2", "train.epochs=null", f"train.out_dir={tmp_path / 'run'}"]
    plan = make_plan(make_config(*tiny, "precision_mode=autocast", base=get_recipe(name)))
    summary = train(plan)
    assert summary["steps"] == 2
