"""Fashion-MNIST recipes: the default run, sized for a 2-core CPU in under 10 minutes."""

from __future__ import annotations

from vitrain.config import Config
from vitrain.recipes import register_recipe


@register_recipe
def fmnist() -> Config:
    """Default run: 6-block locality ViT (width 192, patch 7) on Fashion-MNIST, bf16 where
    supported. `vitrain train`; reaches >= 90 % test top-1 in under 10 minutes on 2 CPU cores
    (docs/benchmarks.md)."""
    config = Config(precision="auto")
    config.model.name = "locality_vit_tiny6_patch7"
    config.model.attn_impl = "matmul"  # faster than SDPA's CPU kernels here (docs/benchmarks.md)
    config.data.name = "fashion-mnist"
    config.data.image_size = 28
    config.data.scale = (0.35, 1.0)
    config.data.crop_pct = 1.0
    config.train.batch_size = 256
    config.train.epochs = 12
    config.optim.lr = 8e-3
    config.optim.weight_decay = 0.05
    config.schedule.warmup_epochs = 1
    return config


@register_recipe
def fmnist_vit() -> Config:
    """The default run with a plain ViT FFN (no locality), for the Borealis comparison."""
    config = fmnist()
    config.model.name = "vit_tiny6_patch7"
    return config
