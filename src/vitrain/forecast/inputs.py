"""The forecast's measured inputs, read from where vitrain writes them: a ``vitrain bench --json`` record (one
device's step), a ``vitrain bench-data --json`` record or an image folder (the data), the device's memory
from its datasheet. Every error names the input and the fix (ValueError)."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

from vitrain.data.sources import IMAGE_EXTENSIONS
from vitrain.forecast.model import Data, Measured

DEVICE_MEMORY_GB: tuple[tuple[str, float], ...] = (
    (r"H200", 141.0),
    (r"H100.*NVL", 94.0),
    (r"H100", 80.0),
    (r"A100.*80", 80.0),
    (r"A100", 40.0),
    (r"V100.*32", 32.0),
    (r"V100", 16.0),
    (r"L40S|\bL40\b", 48.0),
    (r"\bL4\b|\bA10\b", 24.0),
    (r"\bT4\b", 16.0),
)
"""Memory per GPU from the vendors' datasheets (GB as printed; the smaller variant where a name has two)."""


def device_memory_bytes(device_name: str) -> int | None:
    """The datasheet memory of a GPU named ``device_name``; this machine's RAM for a CPU; None if unknown."""
    if device_name.upper().startswith("CPU"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for pattern, gigabytes in DEVICE_MEMORY_GB:
        if re.search(pattern, device_name, re.IGNORECASE):
            return int(gigabytes * 1e9)
    return None


def read_bench(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--bench {path}: cannot read a `vitrain bench --json` record ({error})") from None
    missing = [key for key in ("model", "image_size", "batch", "step_ms_median", "precision") if key not in record]
    if missing:
        raise ValueError(f"--bench {path}: no {', '.join(missing)}; write it with `vitrain bench ... --json FILE`")
    if record.get("world_size", 1) != 1:
        raise ValueError(f"--bench {path}: measured on {record['world_size']} processes; the forecast starts from one")
    return record


def measured_from_bench(record: dict[str, Any], source: str) -> Measured:
    """One device's step from a bench record (the optimizer's first word: ``adamw auto (...)`` -> adamw)."""
    return Measured(
        step_s=record["step_ms_median"] / 1e3,
        batch=int(record["batch"]),
        precision=record["precision"],
        precision_mode=record.get("precision_mode") or "autocast",
        optimizer=str(record.get("optimizer", "adamw")).split()[0],
        memory_bytes=record.get("peak_memory_bytes"),
        device_name=record.get("device_name", "unknown"),
        source=source,
    )


def read_data(text: str, seed: int = 0) -> Data:
    """The data from a ``bench-data --json`` record or a folder of images (those the loaders read, counted;
    the mean size of up to 2,000 files drawn at random)."""
    path = Path(text)
    if path.is_file():
        try:
            record = json.loads(path.read_text())
            images, mean_kib = int(record["num_images"]), float(record["storage"]["mean_file_kib"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"--data {text}: not a `vitrain bench-data --json` record ({error})") from None
        decode = [row for row in record.get("decode", []) if row.get("backend", "pillow") == "pillow"]
        per_core = max((row["img_s_per_core"] for row in decode), default=None)
        return Data(images, mean_kib * 1024, source=f"vitrain bench-data {text}", decode_img_s_per_core=per_core)
    if path.is_dir():
        files = [
            os.path.join(folder, name)
            for folder, _, names in os.walk(path)
            for name in names
            if name.lower().endswith(IMAGE_EXTENSIONS)
        ]
        if not files:
            raise ValueError(f"--data {text}: no image files ({', '.join(IMAGE_EXTENSIONS)}) under it")
        sample = random.Random(seed).sample(files, min(len(files), 2000))
        mean = sum(os.path.getsize(name) for name in sample) / len(sample)
        return Data(len(files), mean, source=f"the folder {text}")
    raise ValueError(f"--data {text}: no such file or folder; give a bench-data JSON or an image folder")
