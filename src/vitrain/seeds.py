"""How every random stream of a run is seeded from the run's seed: the data order, each sample's
augmentation, mixing draws, the synthetic images and each process's RNG state at resume all take
:func:`derive_seed` of the run seed and their own integers (epoch, sample, rank), so that a resumed run
draws what an uninterrupted one would have."""

from __future__ import annotations

import numpy as np


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (NumPy's SeedSequence hashing)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))
