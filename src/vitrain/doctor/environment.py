"""Environment checks: shared memory, open-file limit, free disk for runs, the recipe's data, and
which optional packages are installed."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
from pathlib import Path

from vitrain.config import ConfigError
from vitrain.doctor.report import Check, Context

SECTION = "Environment"
GIB = 2**30
SHM_WARN_BYTES = 1 * GIB
"""DataLoader workers hand batches over through /dev/shm; Docker's default 64 MiB is too little."""
OPEN_FILES_WARN = 4096
DISK_WARN_BYTES, DISK_FAIL_BYTES = 10 * GIB, 1 * GIB

# import name -> (distribution, what vitrain does with it, or None when vitrain does not use it)
OPTIONAL_PACKAGES = {
    "timm": ("timm", "bench --compare-timm and weight conversion from/to timm"),
    "matplotlib": ("matplotlib", "vitrain plot and the plots of bench --ladder/--nproc"),
    "tensorboard": ("tensorboard", "log.sinks=[tensorboard]"),
    "mlflow": ("mlflow-skinny", "log.sinks=[mlflow]"),
    "wandb": ("wandb", "log.sinks=[wandb]"),
    "nvidia.dali": ("nvidia-dali", None),  # distributed as nvidia-dali-cudaXXX
    "webdataset": ("webdataset", None),
    "onnx": ("onnx", "export --format onnx"),
    "onnxscript": ("onnxscript", "export --format onnx"),
    "onnxruntime": ("onnxruntime", "export --format onnx (its check)"),
}


def check_shm(context: Context) -> list[Check]:
    if not Path("/dev/shm").is_dir():
        fix = "no /dev/shm: set data.num_workers=0, or mount a tmpfs there"
        return [Check(SECTION, "/dev/shm", "WARN", "missing", fix, {"bytes": None})]
    total = shutil.disk_usage("/dev/shm").total
    value = f"{total / GIB:.1f} GiB"
    if total < SHM_WARN_BYTES:
        fix = "DataLoader workers pass batches through /dev/shm: docker run --shm-size=8g (or data.num_workers=0)"
        return [Check(SECTION, "/dev/shm", "WARN", value, fix, {"bytes": total})]
    return [Check(SECTION, "/dev/shm", "PASS", value, data={"bytes": total})]


def check_open_files(context: Context) -> list[Check]:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    data = {"soft": None if soft == unlimited else soft, "hard": None if hard == unlimited else hard}
    value = f"soft {data['soft'] or 'unlimited'}, hard {data['hard'] or 'unlimited'}"
    if soft != unlimited and soft < OPEN_FILES_WARN:
        target = OPEN_FILES_WARN * 16 if hard == unlimited else min(hard, OPEN_FILES_WARN * 16)
        fix = f"loader workers and sharded checkpoints open many files: ulimit -n {target} before vitrain"
        return [Check(SECTION, "open files", "WARN", value, fix, data)]
    return [Check(SECTION, "open files", "PASS", value, data=data)]


def runs_root(out_dir: str) -> Path:
    """The folder runs are written under: ``train.out_dir`` up to its first ``{placeholder}``."""
    if "{" not in out_dir:
        return Path(out_dir)
    prefix = out_dir.split("{", 1)[0]
    return Path(prefix) if prefix.endswith("/") or not prefix else Path(prefix).parent


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(context: Context) -> list[Check]:
    folder = Path(context.out) if context.out is not None else runs_root(context.config.train.out_dir)
    measured = _existing(folder)
    free = shutil.disk_usage(measured).free
    data = {"path": str(folder), "measured_at": str(measured), "free_bytes": free}
    value = f"{free / GIB:.1f} GiB free at {measured}"
    fix = "free space there or write runs elsewhere (train.out_dir=/big/disk/runs/{recipe}-{time})"
    if free < DISK_FAIL_BYTES:
        return [Check(SECTION, "disk", "FAIL", value, f"under 1 GiB: checkpoints will not fit; {fix}", data)]
    if free < DISK_WARN_BYTES:
        return [Check(SECTION, "disk", "WARN", value, f"under 10 GiB: a few ViT-B checkpoints fill it; {fix}", data)]
    return [Check(SECTION, "disk", "PASS", value, data=data)]


def _data_root(data) -> Path | None:
    from vitrain.data.sources import fashion_mnist_root, image_folder_root

    if data.name == "fashion-mnist":
        return fashion_mnist_root(data)
    if data.name == "imagefolder":
        return image_folder_root(data)
    if data.name == "webdataset":
        from vitrain.data.shards import shard_source

        first = shard_source(data).train.urls[0]  # ConfigError when the shards are missing or incomplete
        return Path(first).parent if Path(first).is_file() else None
    return None


def check_data(context: Context) -> list[Check]:
    data = context.config.data
    facts = {"recipe": context.config.recipe, "source": data.name, "root": str(data.root) if data.root else None}
    try:
        root = _data_root(data)
    except ConfigError as error:
        fix = "see docs/data.md" + (
            "; Fashion-MNIST: apt-get install dataset-fashion-mnist" if data.name == "fashion-mnist" else ""
        )
        return [Check(SECTION, "data", "FAIL", f"{data.name}: {error}", fix, facts)]
    if root is None:
        what = "shards streamed from a command or URL" if data.name == "webdataset" else "generated in memory"
        return [Check(SECTION, "data", "PASS", f"{data.name}: {what}, nothing to read", data=facts)]
    facts["root"] = str(root)
    if not os.access(root, os.R_OK | os.X_OK):
        fix = f"make {root} readable by this user (chmod/chown), or set data.root to a readable copy"
        return [Check(SECTION, "data", "FAIL", f"{data.name}: {root} is not readable", fix, facts)]
    return [Check(SECTION, "data", "PASS", f"{data.name} at {root} (recipe {context.config.recipe})", data=facts)]


def _installed_version(module: str, distribution: str) -> str | None:
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):  # a parent package (nvidia) missing or broken
        return None
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pass
    for found in importlib.metadata.distributions():  # e.g. nvidia-dali-cuda120 for nvidia-dali
        if (found.metadata["Name"] or "").lower().startswith(distribution):
            return found.version
    return "installed"


def check_optional_packages(context: Context) -> list[Check]:
    checks = []
    for module, (distribution, use) in OPTIONAL_PACKAGES.items():
        version = _installed_version(module, distribution)
        data = {"installed": version is not None, "version": version, "used_for": use}
        if version is not None:
            checks.append(Check(SECTION, module, "PASS", f"{version}" + (f" ({use})" if use else ""), data=data))
        elif use is not None:
            checks.append(
                Check(SECTION, module, "WARN", "not installed", f"pip install {distribution} for {use}", data)
            )
        else:
            checks.append(Check(SECTION, module, "PASS", "not installed (vitrain does not need it)", data=data))
    return checks


CHECKS = [check_shm, check_open_files, check_disk, check_data, check_optional_packages]
