"""Data: sources (uint8 images + labels), transforms, resumable loaders."""

from vitrain.data.build import build_loaders, describe_source
from vitrain.data.transforms import Normalize

__all__ = ["Normalize", "build_loaders", "describe_source"]
