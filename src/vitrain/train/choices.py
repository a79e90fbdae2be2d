"""The cache of measured choices: what ``auto`` picked on this machine, and the figures it picked by.

Every automatic choice of a run is decided by timing its candidates here, never by a library's
capability flag: the attention implementation per shape (:mod:`vitrain.train.attention_probe`), and the
precision, precision mode and fused CPU kernels (:mod:`vitrain.train.precision_choice`). Each answer is
kept in ``$VITRAIN_CACHE_DIR/measured.json`` (default ``~/.cache/vitrain``) under a key that names the
question, the device as it computes (:func:`device_key`: on a CPU its model, the ISA ATen and oneDNN use,
vitrain's AMX switch, the threads and torch) and the shape; later runs of the same shape start at once. A
missing, unreadable or read-only cache costs a measurement per run, never the run. An answer measured while
other processes took the cores the measurement needed serves its run and is not cached (:class:`LoadWatch`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vitrain import cpu_features
from vitrain.config import ModelPlan
from vitrain.io import write_file_atomic

log = logging.getLogger("vitrain")

CACHE_NAME = "measured.json"


def cache_path() -> Path:
    root = (
        os.environ.get("VITRAIN_CACHE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vitrain"
    )
    return Path(root) / CACHE_NAME


def device_key(device: str) -> str:
    """The device as it computes: a GPU's name, capability and the CUDA torch was built for; on a CPU
    :func:`vitrain.cpu_features.cpu_key` (so an emulated CPU level never reads a native level's answers)."""
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
        return f"{name} sm{major}{minor} | cuda {torch.version.cuda} | torch {torch.__version__}"
    return cpu_features.cpu_key()


def model_key(model: ModelPlan) -> str:
    """The model as a measurement sees it: name, options set, input shape and classes."""
    options = ", ".join(f"{name}={value}" for name, value in sorted(model.options.items()) if value is not None)
    return f"{model.name} ({options}) {model.image_size} px x{model.in_chans}, {model.num_classes} classes"


def read_cache(path: Path | None = None) -> dict[str, Any]:
    try:
        cache = json.loads((path or cache_path()).read_text())
    except (OSError, ValueError):
        return {}  # missing or unreadable: measure again
    return cache if isinstance(cache, dict) else {}


def write_cache(cache: dict[str, Any], path: Path | None = None) -> None:
    path = path or cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(path, json.dumps(cache, indent=1).encode())
    except OSError as error:  # a read-only home costs a measurement per run, not the run
        log.warning("measured choices: could not cache results in %s (%s)", path, error)


BUSY_CORES = 0.25
"""Cores' worth of CPU time that other processes may take, beyond the cores this process leaves free, before
a measurement counts as taken on a busy machine (one such measurement cached 169 img/s for a 1,358 img/s
choice: 2 cores, another 2-thread job beside it)."""


def other_processes_cpu_s() -> float | None:
    """The CPU seconds that every process this one can see, itself excepted, has used (Linux ``/proc``; in
    a container, the container's processes). None where there is no ``/proc``."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    own, ticks, total = str(os.getpid()), os.sysconf("SC_CLK_TCK"), 0
    for name in names:
        if not name.isdigit() or name == own:
            continue
        try:  # after the command's closing parenthesis: fields 3 on; utime and stime are fields 14 and 15
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
    return total / ticks


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class LoadWatch:
    """How many cores other processes kept busy, on average, over a ``with`` block; ``busy`` when they took
    more than the cores this process's threads leave free (plus :data:`BUSY_CORES`)."""

    def __enter__(self) -> LoadWatch:
        self.others_cores: float | None = None
        self._start = (time.perf_counter(), other_processes_cpu_s())
        return self

    def __exit__(self, *exc) -> None:
        start_s, start_cpu = self._start
        end_cpu, wall_s = other_processes_cpu_s(), time.perf_counter() - start_s
        if start_cpu is not None and end_cpu is not None and wall_s > 0:
            self.others_cores = max(0.0, end_cpu - start_cpu) / wall_s

    @property
    def spare_cores(self) -> int:
        return max(0, usable_cores() - torch.get_num_threads())

    @property
    def busy(self) -> bool:
        return self.others_cores is not None and self.others_cores > self.spare_cores + BUSY_CORES


def measured_entry(
    key: str, measure: Callable[[], dict[str, Any]], complete: Callable[[dict[str, Any]], bool] = bool
) -> tuple[dict[str, Any], bool]:
    """The cache entry of ``key`` and whether it came from the cache; ``measure()`` makes it (and it is
    cached) where there is none or ``complete(entry)`` says it lacks an answer the caller needs now."""
    cache = read_cache()
    entry = cache.get(key)
    if isinstance(entry, dict) and complete(entry):
        return entry, True
    with LoadWatch() as load:
        entry = measure()
    if load.busy:
        log.warning(
            "measured choices: other processes kept %.1f of %d cores busy while %s was measured; the answer "
            "serves this run and is not cached (the next run measures again)",
            load.others_cores, usable_cores(), key.split(" | ")[0],
        )  # fmt: skip
        return entry, False
    cache = read_cache()  # another process may have written meanwhile: keep its answers
    cache[key] = entry
    write_cache(cache)
    return entry, False


__all__ = [
    "CACHE_NAME",
    "LoadWatch",
    "cache_path",
    "device_key",
    "measured_entry",
    "other_processes_cpu_s",
    "read_cache",
    "write_cache",
]
