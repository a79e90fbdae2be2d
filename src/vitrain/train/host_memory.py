"""The host allocator (``performance.host_allocator``): keep freed CPU memory for reuse.

glibc serves every allocation above 128 KiB with its own ``mmap`` and unmaps it on ``free``, so each
large CPU tensor of a training step (activations, gradients, a VOLO stem's 51 MB feature maps) is
fresh memory whose pages fault in, zeroed by the kernel, on first touch: system time in every step.
``cached`` turns glibc's ``mmap`` path off and stops it returning the top of the heap to the system, so
freed blocks are reused from the second step on: what jemalloc or tcmalloc (``LD_PRELOAD``, Intel's advice
for PyTorch on CPU) would do, with no library to install (what it saves: docs/benchmarks.md, "What each
technique buys"). The peak resident memory is the same; it is just not given back until the
process ends (``malloc_trim`` still gives it back on request). Elsewhere than glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from typing import Literal

log = logging.getLogger("vitrain")

# mallopt parameters (glibc malloc.h) and glibc's defaults for them (malloc/malloc.c)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD_MAX = 2**31 - 1  # mallopt takes an int
DEFAULT_MMAP_MAX = 65536
DEFAULT_TRIM_THRESHOLD = 128 * 1024

_cached = False  # whether this process has set "cached" (what "system" then has to undo)


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc only
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def configure_host_allocator(policy: Literal["cached", "system"]) -> bool:
    """Apply ``policy`` to this process (and to processes forked from it later); True when glibc took
    it. ``system`` in a process that never set ``cached`` changes nothing; after ``cached`` it puts
    glibc's default limits back (its dynamic mmap threshold stays off once a limit was set)."""
    global _cached
    libc = glibc()
    if libc is None or (policy == "system" and not _cached):
        return False
    mmap_max, trim_threshold = (
        (0, TRIM_THRESHOLD_MAX) if policy == "cached" else (DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD)
    )
    applied = libc.mallopt(M_MMAP_MAX, mmap_max) == 1 and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    if not applied:
        log.warning("performance.host_allocator=%s: glibc refused the mallopt settings", policy)
    _cached = policy == "cached" if applied else _cached
    return applied


def return_free_heap_to_os() -> None:
    """Give the free heap pages back (``malloc_trim``): glibc keeps them resident otherwise."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)
