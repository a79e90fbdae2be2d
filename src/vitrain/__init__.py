"""vitrain: train vision transformers from scratch, fast, and say honestly what the hardware does."""

__version__ = "0.1.0"
