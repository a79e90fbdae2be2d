"""RNG streams as checkpoint data: captured as plain tensors, lists and ints (loadable with
``weights_only=True``) and restored per process."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """All RNG streams as plain tensors, lists and ints (loadable with weights_only=True)."""
    numpy_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def restore_rank_rng_state(payload: dict[str, Any], rank: int, world_size: int, fallback_seed: int) -> None:
    """Restore this rank's RNG streams from a checkpoint payload. Every rank draws its own dropout, so
    each rank's streams are saved (``rng_by_rank``); a checkpoint written by another number of processes
    gives rank 0's streams and then a distinct torch stream per rank (``fallback_seed``)."""
    by_rank = payload.get("rng_by_rank")
    if by_rank and len(by_rank) == world_size:
        restore_rng_state(by_rank[rank])
        return
    restore_rng_state(payload["rng"])
    if world_size > 1:
        torch.manual_seed(fallback_seed)
