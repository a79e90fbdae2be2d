"""Fashion-MNIST recipes: the default run, sized for a 2-core CPU in under 10 minutes."""

from __future__ import annotations

from vitrain.config import Config
from vitrain.recipes import register_recipe


@register_recipe
def fmnist() -> Config:
    """Default run: a 6-block LocalViT (width 192, FFN ratio 2; Li et al.'s FFN: a depthwise convolution with
    BatchNorm and squeeze-excitation) with Xiao et al.'s convolutional stem (three
    3x3 stride-2 convolutions, so patch 8 and a 4x4 token grid at 32 px) on Fashion-MNIST resized to
    32 px; the precision (fp32, bf16 autocast or bf16 O2) and the fused CPU kernels that time the fastest step
    on this machine (bf16 O2 with the kernels where bf16 is native); a 9-minute training budget
    so that `vitrain train` ends within 10 minutes on any 2-core machine; Muon on the blocks'
    matrices, AdamW on the rest. Expected test top-1: about 93 % (docs/results.md, which also compares the
    alternatives)."""
    config = Config(precision="auto", precision_mode="auto")  # measured: fp32, bf16 autocast or O2
    config.model.name = "localvit_tiny6_convstem_patch8"  # conv stem: beats patchify at equal epochs (docs/results.md)
    config.model.head = "gap"  # pooled head: beats the CLS head (docs/results.md)
    config.model.mlp_ratio = 2.0  # a faster step than ratio 4: more epochs in the budget, same accuracy
    config.model.attn_impl = "matmul"  # faster than SDPA's CPU kernels here (docs/benchmarks.md)
    config.data.name = "fashion-mnist"
    config.data.image_size = 32  # 28 px resized (bilinear, train and eval alike) for the power-of-two stem
    config.data.scale = (1.0, 1.0)  # random crops cost accuracy at these epoch counts (docs/results.md)
    config.data.hflip = 0.0  # flips cost accuracy early and are neutral by 9 epochs
    config.data.crop_pct = 1.0  # no translation or erasing either: shifts cost accuracy too
    config.train.batch_size = 256
    config.train.epochs = None
    config.train.budget = "9m"  # + per-epoch evaluation and start-up: under 10 minutes of wall clock
    config.optim.name = "muon"  # beats AdamW in the same time despite a slower step (docs/results.md)
    config.optim.lr = 1.2e-2  # 3e-3 at batch 256; Muon is flat from 6e-3 to 2.4e-2 here (1 epoch)
    config.optim.weight_decay = 0.05
    config.schedule.warmup_epochs = 0.5
    return config


@register_recipe
def fmnist_10m() -> Config:
    """The Borealis benchmark (Irandoust et al. 2022) at this machine's scale: the default run with a 10-minute
    training budget (evaluation excluded) on 2 CPU cores. `vitrain train --recipe fmnist_10m`;
    the variants compared in docs/results.md come from experiments/borealis_fmnist.py."""
    config = fmnist()
    config.train.budget = "10m"
    return config


@register_recipe
def fmnist_vit() -> Config:
    """The default run with a plain ViT FFN (no locality): same stem, size and training."""
    config = fmnist()
    config.model.name = "vit_tiny6_convstem_patch8"
    return config


@register_recipe
def fmnist_volo_10m() -> Config:
    """fmnist_10m with a small VOLO (volo_tiny_patch4: outlook attention on an 8x8 grid, then transformer blocks
    on 4x4; 2.35M parameters, 85 MFLOPs an image) in place of the LocalViT; its token-labeling head is on, so
    `--set token_labels.maps=DIR --set token_labels.mix_token=true` trains it as VOLO is trained."""
    config = fmnist_10m()
    config.model.name = "volo_tiny_patch4"
    config.model.head = config.model.mlp_ratio = None  # the variant's: VOLO has no pooled head
    return config
