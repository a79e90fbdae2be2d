"""What a plan's data source holds, and its loaders: Pillow (in memory or image files), tar shards or DALI.

The dispatch to each kind of source lives here, above the modules it picks from, so that none of them
imports one that imports it back: :mod:`vitrain.data.shards` and :mod:`vitrain.data.dali` build on
:mod:`vitrain.data.sources` and :mod:`vitrain.data.loader`.
"""

from __future__ import annotations

from typing import Any

from vitrain.config import DataConfig, DataPlan, DatasetInfo
from vitrain.data import sources
from vitrain.data.dali import build_dali_loaders
from vitrain.data.loader import FileLoader, InMemoryLoader, image_folder_splits, in_memory_split
from vitrain.data.shards import build_shard_loaders, shard_source


def describe_source(config: DataConfig) -> DatasetInfo:
    """Read what resolve() needs without loading the data; raise ConfigError if it is missing."""
    if config.name != "webdataset":
        return sources.describe_unsharded_source(config)
    # index.json's counts and classes; shards without one are read once to count them
    shards = shard_source(config)
    sizes = (shards.train.num_samples, shards.eval.num_samples, shards.num_classes, 3)
    return sources.source_info(config, (*sizes, sources.IMAGENET_MEAN, sources.IMAGENET_STD))


def build_loaders(data: DataPlan) -> tuple[Any, Any]:
    """Train and eval loaders for the plan's data source."""
    config = data.source
    if config.backend == "dali" and config.name in ("imagefolder", "webdataset"):
        return build_dali_loaders(data)
    if config.name == "webdataset":
        return build_shard_loaders(data)
    if config.name == "imagefolder":
        train_samples, eval_samples = image_folder_splits(config)
        return FileLoader(train_samples, data, train=True), FileLoader(eval_samples, data, train=False)
    return InMemoryLoader(in_memory_split(data, "train"), data, True), InMemoryLoader(
        in_memory_split(data, "eval"), data, False
    )
