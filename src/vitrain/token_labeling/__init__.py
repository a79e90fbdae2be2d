"""Token labeling (Jiang et al. 2021, "All Tokens Matter"): a teacher's dense label maps and their use
as per-token training targets."""

from vitrain.token_labeling.label import LabelSettings, dense_logits, label_training_set
from vitrain.token_labeling.maps import LabelMaps, PublishedLabelMaps, open_label_maps

__all__ = ["LabelMaps", "LabelSettings", "PublishedLabelMaps", "dense_logits", "label_training_set", "open_label_maps"]
