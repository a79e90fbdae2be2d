"""Token labeling (Jiang et al. 2021, "All Tokens Matter"; LV-ViT, VOLO): dense per-token targets from a
teacher's label maps, the token-labeling loss and MixToken."""

from vitrain.token_labeling.loss import soft_target_cross_entropy, token_labeling_loss
from vitrain.token_labeling.mixtoken import (
    MixTokenHook,
    TokenBox,
    apply_mix_token,
    draw_token_box,
    mix_token_scale,
    mix_tokens,
    token_box_mask,
    unmix_tokens,
)
from vitrain.token_labeling.targets import dense_targets, scatter_label_maps

__all__ = [
    "MixTokenHook",
    "TokenBox",
    "apply_mix_token",
    "dense_targets",
    "draw_token_box",
    "mix_token_scale",
    "mix_tokens",
    "scatter_label_maps",
    "soft_target_cross_entropy",
    "token_box_mask",
    "token_labeling_loss",
    "unmix_tokens",
]
