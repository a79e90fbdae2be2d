"""The papers' ImageNet-1k training recipes: DeiT (Touvron et al. 2021) and DeiT III (Touvron et al. 2022).

Each needs ``--set data.root=/path/to/imagenet`` (train/ and val/ inside); DeiT's distilled recipes also
need the teacher's weights file (``--set train.distill.teacher_weights=PATH``).
"""

from __future__ import annotations

from vitrain.config import Config
from vitrain.recipes import register_recipe

# facebookresearch/deit main.py defaults: peak lr = 5e-4 x batch / 512, warmup from 1e-6, cosine down to 1e-5.
_DEIT_LR = 5e-4
_DEIT_WARMUP_LR = 1e-6
_DEIT_MIN_LR = 1e-5


def _deit_family(model: str, image_size: int, drop_path: float) -> Config:
    """What DeiT and DeiT III share (facebookresearch/deit main.py): ImageNet folders, Mixup 0.8 / CutMix
    1.0 switched per batch with probability 0.5, repeated augmentation 3, cosine after 5 warmup epochs,
    no gradient clipping, no weight EMA in the reported numbers."""
    config = Config(precision="auto")
    config.model.name = model
    config.model.drop_path_rate = drop_path
    config.data.name = "imagefolder"
    config.data.image_size = image_size
    config.data.num_workers = 8
    config.data.repeated_aug = 3
    config.data.mixup = 0.8
    config.data.cutmix = 1.0
    config.data.mix_prob = 1.0
    config.data.mix_switch_prob = 0.5
    config.data.mix_mode = "batch"
    # main.py keeps a weight EMA (0.99996) by default but evaluates and reports the live weights.
    config.train.ema.decay = 0.0
    config.optim.grad_clip = None
    config.schedule.name = "cosine"
    config.schedule.warmup_epochs = 5
    return config


def _deit_lr_ends(config: Config, peak_lr: float) -> None:
    """Warmup from 1e-6 and cosine down to 1e-5 (main.py's --warmup-lr, --min-lr), as fractions of the peak."""
    config.schedule.warmup_start = _DEIT_WARMUP_LR / peak_lr
    config.schedule.min_lr_ratio = _DEIT_MIN_LR / peak_lr


def _deit(model: str) -> Config:
    """DeiT, Table 9 and facebookresearch/deit main.py defaults (the README commands override only the model
    and batch): AdamW, batch 1024, lr 5e-4 x batch / 512, weight decay 0.05, cosine, 5 warmup epochs, 300
    epochs, label smoothing 0.1, RandAugment m9 mstd0.5, Mixup 0.8 / CutMix 1.0, random erasing 0.25,
    repeated augmentation 3, stochastic depth 0.1, no gradient clipping, eval crop 0.875 at 224 px."""
    config = _deit_family(model, 224, 0.1)  # main.py --drop-path default; no README command changes it
    config.data.crop_pct = 0.875
    config.data.randaugment = "rand-m9-mstd0.5-inc1"
    # main.py's --color-jitter 0.4 is unused: timm (0.3.x, DeiT's) applies color jitter only without RandAugment.
    config.data.color_jitter = 0.0
    config.data.random_erase = 0.25
    config.train.batch_size = 1024
    config.train.epochs = 300
    config.train.loss = "ce"
    config.train.label_smoothing = 0.1
    config.optim.name = "adamw"
    config.optim.lr = _DEIT_LR
    config.optim.reference_batch = 512
    config.optim.weight_decay = 0.05
    _deit_lr_ends(config, _DEIT_LR * config.train.batch_size / config.optim.reference_batch)
    return config


@register_recipe
def deit_ti_300ep() -> Config:
    """DeiT-Ti/16, 300 epochs at 224 px with DeiT's recipe (Touvron et al. 2021, Table 9 and the official
    main.py defaults); the paper reports 72.2 % top-1 without distillation.
    `vitrain train --recipe deit_ti_300ep --set data.root=/data/imagenet`."""
    return _deit("deit_tiny_patch16")


@register_recipe
def deit_s_300ep() -> Config:
    """DeiT-S/16, 300 epochs at 224 px with DeiT's recipe (Touvron et al. 2021, Table 9 and the official
    main.py defaults); the paper reports 79.8 % top-1 without distillation.
    `vitrain train --recipe deit_s_300ep --set data.root=/data/imagenet`."""
    return _deit("deit_small_patch16")


@register_recipe
def deit_b_300ep() -> Config:
    """DeiT-B/16, 300 epochs at 224 px with DeiT's recipe (Touvron et al. 2021, Table 9 and the official
    main.py defaults); the paper reports 81.8 % top-1 without distillation.
    `vitrain train --recipe deit_b_300ep --set data.root=/data/imagenet`."""
    return _deit("deit_base_patch16")


def _deit_distilled(model: str) -> Config:
    """DeiT's distilled models (Touvron et al. 2021, sec. 5.2; facebookresearch/deit README commands): the DeiT
    recipe with hard distillation (--distillation-type hard, alpha 0.5 and tau 1.0 by main.py's defaults)
    from a RegNetY-16GF teacher (--teacher-model regnety_160). Nothing is downloaded: the teacher's weights
    (DeiT's regnety_160-a5fe301d.pth) must be given with --set train.distill.teacher_weights=PATH."""
    config = _deit(model)
    config.train.distill.kind = "hard"
    config.train.distill.alpha = 0.5
    config.train.distill.tau = 1.0
    config.train.distill.teacher = "regnety_160"
    return config


@register_recipe
def deit_ti_distilled_300ep() -> Config:
    """DeiT-Ti/16 with the distillation token, 300 epochs at 224 px, hard distillation from RegNetY-16GF
    (Touvron et al. 2021); the paper reports 74.5 % top-1 (the mean of both heads).
    `vitrain train --recipe deit_ti_distilled_300ep --set data.root=/data/imagenet
    --set train.distill.teacher_weights=/weights/regnety_160-a5fe301d.pth`."""
    return _deit_distilled("deit_tiny_distilled_patch16")


@register_recipe
def deit_s_distilled_300ep() -> Config:
    """DeiT-S/16 with the distillation token, 300 epochs at 224 px, hard distillation from RegNetY-16GF
    (Touvron et al. 2021); the paper reports 81.2 % top-1 (the mean of both heads).
    `vitrain train --recipe deit_s_distilled_300ep --set data.root=/data/imagenet
    --set train.distill.teacher_weights=/weights/regnety_160-a5fe301d.pth`."""
    return _deit_distilled("deit_small_distilled_patch16")


@register_recipe
def deit_b_distilled_300ep() -> Config:
    """DeiT-B/16 with the distillation token, 300 epochs at 224 px, hard distillation from RegNetY-16GF
    (Touvron et al. 2021); the paper reports 83.4 % top-1 (the mean of both heads).
    `vitrain train --recipe deit_b_distilled_300ep --set data.root=/data/imagenet
    --set train.distill.teacher_weights=/weights/regnety_160-a5fe301d.pth`."""
    return _deit_distilled("deit_base_distilled_patch16")


def _deit3(model: str, lr: float, drop_path: float, image_size: int) -> Config:
    """DeiT III's ImageNet-1k pretraining as facebookresearch/deit README_revenge.md's commands give it: LAMB,
    batch 2048 (256 x 8 GPUs) at lr `lr` unscaled (--unscale-lr), weight decay 0.05, cosine, 5 warmup epochs
    from 1e-6, 800 epochs, BCE loss without label smoothing, 3-Augment + color jitter 0.3, Mixup 0.8 / CutMix
    1.0, no random erasing, repeated augmentation (3, the sampler's). Eval crop 1.0, as timm's configs of the
    released DeiT III weights and the paper's Table 1 (main.py's default is 0.875; the commands leave it).
    The paper's Table 1 lists lr 3e-3 and weight decay 0.02; the released commands, used here, differ."""
    config = _deit_family(model, image_size, drop_path)
    config.data.crop_pct = 1.0
    config.data.randaugment = None
    config.data.three_augment = True
    config.data.color_jitter = 0.3
    config.data.random_erase = 0.0
    config.train.batch_size = 2048
    config.train.epochs = 800
    config.train.loss = "bce"
    config.train.label_smoothing = 0.0
    config.optim.name = "lamb"
    config.optim.lr = lr
    config.optim.reference_batch = 2048
    config.optim.weight_decay = 0.05
    _deit_lr_ends(config, lr)
    return config


@register_recipe
def deit3_s() -> Config:
    """DeiT III ViT-S/16, 800 epochs at 224 px (Touvron et al. 2022; README_revenge.md's ViT-S command: lr 4e-3
    at batch 2048, stochastic depth 0.05); the paper reports 81.4 % top-1 for 800 epochs. The model is DeiT
    III's ViT (``deit3_small_patch16``: LayerScale from 1e-4, no CLS position embedding, the same stochastic
    depth in every block).
    `vitrain train --recipe deit3_s --set data.root=/data/imagenet`."""
    return _deit3("deit3_small_patch16", 4e-3, 0.05, 224)


@register_recipe
def deit3_b() -> Config:
    """DeiT III ViT-B/16 pretraining, 800 epochs at 192 px (Touvron et al. 2022; README_revenge.md's ViT-B
    command: lr 3e-3 at batch 2048, stochastic depth 0.2); the paper's 83.8 % top-1 comes after a 20-epoch
    fine-tune at 224 px (README_revenge.md), which is not part of this recipe. The model is DeiT III's ViT
    (``deit3_base_patch16``: LayerScale from 1e-4, no CLS position embedding, the same stochastic depth in
    every block).
    `vitrain train --recipe deit3_b --set data.root=/data/imagenet`."""
    return _deit3("deit3_base_patch16", 3e-3, 0.2, 192)
