"""Token labeling (Jiang et al. 2021, "All Tokens Matter"; LV-ViT, VOLO): a teacher's dense label maps,
the per-token targets cut from them for each crop, the token-labeling loss and MixToken."""

from vitrain.token_labeling.label import LabelSettings, dense_logits, label_training_set
from vitrain.token_labeling.loss import token_labeling_loss
from vitrain.token_labeling.maps import LabelMaps, PublishedLabelMaps, open_label_maps
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
    "LabelMaps",
    "LabelSettings",
    "MixTokenHook",
    "PublishedLabelMaps",
    "TokenBox",
    "apply_mix_token",
    "dense_logits",
    "dense_targets",
    "draw_token_box",
    "label_training_set",
    "mix_token_scale",
    "mix_tokens",
    "open_label_maps",
    "scatter_label_maps",
    "token_box_mask",
    "token_labeling_loss",
    "unmix_tokens",
]
