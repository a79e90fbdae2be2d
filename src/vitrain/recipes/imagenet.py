"""ImageNet-layout recipes (data.root must point at a folder holding train/ and val/)."""

from __future__ import annotations

from vitrain.config import Config
from vitrain.recipes import register_recipe


@register_recipe
def imagenet_locality_vit_s() -> Config:
    """Locality ViT-S/16 at 224 px with the Borealis hyper-parameters (Irandoust et al. 2022, appendix A):
    AdamW, batch 64, lr 1e-3, no warmup, label smoothing. Curriculum and 24 h budget come with
    the budget recipes. `vitrain train --recipe imagenet_locality_vit_s --set data.root=/data/imagenet`."""
    config = Config(precision="auto")
    config.model.name = "locality_vit_small_patch16"
    config.data.name = "imagefolder"
    config.data.image_size = 224
    config.data.num_workers = 8
    config.train.batch_size = 64
    config.train.epochs = 30
    config.optim.lr = 1e-3
    config.optim.reference_batch = 64
    config.schedule.warmup_epochs = 0
    config.train.label_smoothing = 0.1
    return config
