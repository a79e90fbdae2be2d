"""``vitrain bench-data``: how fast this machine feeds training from an image folder, and whether that is
enough.

Three measurements on the training split of an ImageNet-layout folder (or one split folder):

1. Storage: read bandwidth (MB/s, MB = 10^6 bytes) and file IOPS of the image files, cold and warm. With
   ``fio`` on PATH, fio reads a sample of the files (sequential 1 MiB reads for the bandwidth, 4 KiB random
   reads for the IOPS; cold: fio's ``--invalidate=1``). Otherwise vitrain's own reader: whole files read
   sequentially for the bandwidth, and files opened, read (4 KiB) and closed per second for the IOPS. A
   cold read needs the files out of the page cache: before each cold pass every sampled file gets
   ``posix_fadvise(POSIX_FADV_DONTNEED)``; the record says whether the kernel accepted it. The call is
   advice (pages another process maps, dirty pages, or a network filesystem's own cache can stay), so for
   a certain cold read drop the caches as root first (``sync; echo 3 > /proc/sys/vm/drop_caches``).
2. Decode + augment: img/s of training's own loaders at each worker count, after a warm-up of one batch per
   worker, time-boxed per point; per worker-core (img/s over min(workers, cores), 0 workers: one core). The
   backends (``--backend``): ``pillow``, the image folder through :class:`~vitrain.data.loader.FileLoader`
   (the same dataset, transform, collate and worker settings as training); ``shards``, the same images as tar
   shards through :class:`~vitrain.data.shards.ShardLoader` (``--shards DIR`` from ``vitrain shard``, else
   written to a temporary folder first); ``dali``, the image folder through DALI's CPU pipeline
   (:class:`~vitrain.data.dali.DaliFileLoader`, workers as its threads). With ``--compare-timm``, timm's loader
   (``create_dataset`` + ``create_loader``, the equivalent training transform, no prefetcher) at the same
   worker counts, and each backend's ratio to it.
3. The verdict against a training throughput (given, or measured with ``vitrain bench``'s harness):
   input-bound or not at each worker count, and the workers it takes not to be.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vitrain.config import BatchPlan, Config, ConfigError, DataConfig, DataPlan, World, build_config
from vitrain.data.check import find_splits
from vitrain.data.loader import FileLoader
from vitrain.data.sources import IMAGE_EXTENSIONS, IMAGENET_MEAN, IMAGENET_STD, scan_image_folder
from vitrain.doctor.cpu import check_model
from vitrain.metrics.records import run_environment
from vitrain.report import pyplot

log = logging.getLogger("vitrain")

READ_CHUNK = 1 << 20
"""Bytes per read call of a whole-file read (1 MiB, fio's bandwidth block size here too)."""
SMALL_READ = 4096
"""Bytes read per file for the IOPS figure (one page)."""
MAX_SAMPLE_FILES = 2000
"""Files the storage measurement samples, spread evenly over the sorted file list."""
MAX_FIO_FILES = 256
"""Files given to fio (its command line lists them)."""
CACHE_DROP = "posix_fadvise(POSIX_FADV_DONTNEED)"
SHARD_BYTES = 256 * 10**6
"""Shard size when bench-data writes the shards itself."""


@dataclasses.dataclass(frozen=True)
class DataBenchSettings:
    """What ``vitrain bench-data`` measures; see the module docstring."""

    root: Path
    workers: tuple[int, ...] = (1, 2, 4)
    image_size: int = 224
    batch: int = 64
    seconds: float = 3.0
    """Time box of each storage pass and of each decode point (after its warm-up)."""
    compare_timm: bool = False
    train_img_s: float | None = None
    """A measured training throughput to judge against (or None)."""
    backends: tuple[str, ...] = ("pillow",)
    """Loaders to time (``BACKENDS``); the verdict judges the first."""
    shards: Path | None = None
    """The root's shards (``vitrain shard``) for the shards backend; None: written to a temporary folder."""

    def __post_init__(self) -> None:
        for flag, value in (("--image-size", self.image_size), ("--batch", self.batch)):
            if value < 1:
                raise ConfigError(f"{flag} {value}: must be >= 1")
        for flag, value in (("--seconds", self.seconds), ("--train-img-s", self.train_img_s)):
            if value is not None and not value > 0:
                raise ConfigError(f"{flag} {value}: must be > 0")


BACKENDS = ("pillow", "shards", "dali")


def parse_backends(text: str) -> tuple[str, ...]:
    """``"pillow,dali"`` -> ``("pillow", "dali")``, in the order given, each one of ``BACKENDS``."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in names if name not in BACKENDS]
    if not names or unknown:
        raise ConfigError(f"--backend {text!r}: give backends among {', '.join(BACKENDS)} separated by commas")
    return names


def parse_worker_counts(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``: sorted, without repeats, each >= 0 (0: decode in the main process)."""
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 0:
        raise ConfigError(f"--workers {text!r}: give worker counts >= 0 separated by commas, like 1,2,4")
    return tuple(counts)


def describe_machine() -> dict[str, Any]:
    """CPU model and cores (``vitrain doctor``'s; usable: this process's affinity), versions and revision
    (``vitrain bench``'s)."""
    cpu = {check.name: check.data for check in check_model(None)}
    return {
        "cpu_model": cpu["model"]["model"],
        "logical_cores": cpu["cores"]["logical"],
        "usable_cores": cpu["cores"]["usable"],
        **run_environment("cpu"),
    }


def training_split(root: Path) -> tuple[Path, list[tuple[str, int]]]:
    """The folder of the training split (``train/``, else the only split given) and its ``(path, class index)``
    samples, sorted as training lists them. ConfigError when ``root`` is missing or holds no images."""
    if not root.is_dir():
        raise ConfigError(
            f"bench-data: {root} is not a folder; give a dataset root holding train/<class>/* "
            "(or one split folder of class folders)"
        )
    try:
        splits = find_splits(root)
    except ConfigError as error:
        raise ConfigError(str(error).replace("check-data:", "bench-data:", 1)) from None
    folder = splits.get("train") or next(iter(splits.values()))
    samples = scan_image_folder(folder)[0]
    if not samples:
        raise ConfigError(
            f"bench-data: no image files under {folder}/<class>/ (extensions {', '.join(IMAGE_EXTENSIONS)}); "
            "give the folder of a dataset with images"
        )
    return folder, samples


# --- storage ---------------------------------------------------------------------------------------


def sample_files(paths: list[str], limit: int = MAX_SAMPLE_FILES) -> list[str]:
    """At most ``limit`` of ``paths``, spread evenly over the list (so over the classes)."""
    step = max(1, math.ceil(len(paths) / limit))
    return paths[::step][:limit]


def drop_page_cache(paths: list[str]) -> dict[str, Any]:
    """Ask the kernel to drop the cached pages of each file; how many it accepted, and why not where not."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return {"method": CACHE_DROP, "files": len(paths), "files_dropped": 0, "reason": "not on this platform"}
    dropped, reason = 0, None
    for path in paths:
        try:
            descriptor = os.open(path, os.O_RDONLY)
            try:
                advise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += 1
            finally:
                os.close(descriptor)
        except OSError as error:
            reason = f"{type(error).__name__}: {error}"
    return {"method": CACHE_DROP, "files": len(paths), "files_dropped": dropped, "reason": reason}


def read_file(path: str, limit: int | None = None) -> int:
    """Open ``path``, read it sequentially (whole, or its first ``limit`` bytes), close it; the bytes read."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        total = 0
        while limit is None or total < limit:
            chunk = os.read(descriptor, READ_CHUNK if limit is None else limit - total)
            if not chunk:
                break
            total += len(chunk)
        return total
    finally:
        os.close(descriptor)


def timed_reads(paths: list[str], limit: int | None, seconds: float | None) -> dict[str, Any]:
    """Read files in order until all are read or ``seconds`` passed (at least one); what was read, how fast."""
    started, num_bytes, done = time.perf_counter(), 0, 0
    for path in paths:
        num_bytes += read_file(path, limit)
        done += 1
        if seconds is not None and time.perf_counter() - started >= seconds:
            break
    elapsed = max(time.perf_counter() - started, 1e-9)
    return {"files": done, "bytes": num_bytes, "seconds": elapsed, "read_mb_s": num_bytes / elapsed / 1e6}


def measure_storage_reader(paths: list[str], seconds: float) -> dict[str, Any]:
    """vitrain's reader: cold then warm whole-file reads (bandwidth), cold then warm 4 KiB reads (IOPS)."""
    drop = drop_page_cache(paths)
    cold = timed_reads(paths, None, seconds)
    warm = timed_reads(paths[: cold["files"]], None, None)  # the same files, now in the page cache
    drop_page_cache(paths)
    cold_small = timed_reads(paths, SMALL_READ, seconds)
    warm_small = timed_reads(paths[: cold_small["files"]], SMALL_READ, None)
    passes = {}
    for name, whole, small in (("cold", cold, cold_small), ("warm", warm, warm_small)):
        iops = small["files"] / small["seconds"]
        passes[name] = {"read_mb_s": whole["read_mb_s"], "iops": iops, "files_read": whole["files"]}
    return {
        "tool": "vitrain reader",
        "iops_means": f"files opened, read ({SMALL_READ} bytes) and closed per second",
        "cache_drop": drop,
        **passes,
    }


def _fio_filename(paths: list[str]) -> str:
    return ":".join(path.replace(":", "\\:") for path in paths)  # fio separates files by ':'


def fio_command(fio: str, paths: list[str], seconds: float) -> list[str]:
    """One fio run of four jobs in a row (``--stonewall``): cold and warm 1 MiB sequential reads, cold and
    warm 4 KiB random reads, over ``paths`` (read only; cold: ``--invalidate=1`` drops their cached pages)."""
    command = [fio, "--output-format=json", "--readonly", "--ioengine=psync", f"--runtime={max(1, round(seconds))}"]
    command.append(f"--filename={_fio_filename(paths)}")
    jobs = (("cold_bandwidth", "read", "1M", 1), ("warm_bandwidth", "read", "1M", 0))
    jobs += (("cold_iops", "randread", "4k", 1), ("warm_iops", "randread", "4k", 0))
    for name, pattern, block, invalidate in jobs:
        command += [f"--name={name}", "--stonewall", f"--rw={pattern}", f"--bs={block}", f"--invalidate={invalidate}"]
    return command


def parse_fio(output: str) -> dict[str, Any]:
    """The storage record from fio's JSON output (``fio_command``'s four jobs)."""
    report = json.loads(output)
    jobs = {job["jobname"]: job["read"] for job in report["jobs"]}
    passes = {
        name: {"read_mb_s": jobs[f"{name}_bandwidth"]["bw_bytes"] / 1e6, "iops": jobs[f"{name}_iops"]["iops"]}
        for name in ("cold", "warm")
    }
    return {
        "tool": report.get("fio version", "fio"),
        "iops_means": "4 KiB random reads per second (fio randread)",
        "cache_drop": {"method": "fio --invalidate=1", "files": None, "files_dropped": None, "reason": None},
        **passes,
    }


def _fio_failure(error: Exception) -> str:
    if isinstance(error, subprocess.CalledProcessError):
        return f"fio exit status {error.returncode}: {(error.stderr or '').strip()[-300:]}"
    return f"{type(error).__name__}: {str(error)[-300:]}"


def measure_storage(paths: list[str], seconds: float) -> dict[str, Any]:
    """Storage bandwidth and IOPS of a sample of ``paths``: with fio when on PATH, else vitrain's reader
    (also when fio fails, with fio's error in ``fio_error``)."""
    fio, error = shutil.which("fio"), None
    if fio is not None:
        sample = sample_files(paths, MAX_FIO_FILES)
        try:
            done = subprocess.run(
                fio_command(fio, sample, seconds), capture_output=True, text=True, timeout=4 * seconds + 60, check=True
            )
            return {**_sample_facts(sample), **parse_fio(done.stdout)}
        except (OSError, subprocess.SubprocessError, ValueError, KeyError) as failure:
            error = _fio_failure(failure)
            log.warning("%s; measuring with vitrain's reader", error)
    sample = sample_files(paths)
    return {
        **_sample_facts(sample),
        **({"fio_error": error} if error else {}),
        **measure_storage_reader(sample, seconds),
    }


def _sample_facts(sample: list[str]) -> dict[str, Any]:
    sizes = [os.path.getsize(path) for path in sample]
    return {"files_in_sample": len(sample), "mean_file_kib": sum(sizes) / len(sizes) / 1024}


# --- decode + augment ------------------------------------------------------------------------------


def bench_data_plan(data: DataConfig, seed: int, image_size: int, batch: int, workers: int) -> DataPlan:
    """The data plan a one-process CPU training run on an image folder hands its training loader."""
    source = data.model_copy(update={"image_size": image_size, "num_workers": workers})
    batches = BatchPlan(global_batch=batch, eval_batch=2 * batch, micro_batch=None, data_slices=1)
    mean, std = tuple(data.mean or IMAGENET_MEAN), tuple(data.std or IMAGENET_STD)
    return DataPlan(source, 3, mean, std, seed, "cpu", World(), batches)


def endless_batches(loader) -> Iterator:
    """The batches of ``loader``, epoch after epoch (positioned by its ``start_epoch`` where it has one)."""
    epoch = 0
    while True:
        if hasattr(loader, "start_epoch"):
            loader.start_epoch(epoch)
        yield from loader
        epoch += 1


def time_batches(batches: Iterator, warmup: int, seconds: float) -> dict[str, float]:
    """Take ``warmup`` batches, then batches until ``seconds`` passed (at least one): images and img/s."""
    for _ in range(warmup):
        next(batches)
    started, images = time.perf_counter(), 0
    while True:
        images += len(next(batches)[1])
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return {"images": images, "seconds": elapsed, "img_s": images / elapsed}


def _shard_loader(shards: Path, plan: DataPlan):
    from vitrain.data.shards import ShardLoader, shard_source

    source = plan.source.model_copy(update={"name": "webdataset", "root": shards})
    return ShardLoader(shard_source(source), dataclasses.replace(plan, source=source), train=True)


def backend_loader(backend: str, samples: list[tuple[str, int]], plan: DataPlan, shards: Path | None):
    """Training's loader of ``backend`` over ``samples`` (shards: the folder written from them)."""
    if backend == "shards":
        return _shard_loader(shards, plan)
    if backend == "dali":
        from vitrain.data.dali import DaliFileLoader

        return DaliFileLoader(
            samples, dataclasses.replace(plan, source=plan.source.model_copy(update={"backend": "dali"})), True
        )
    return FileLoader(samples, plan, train=True)


def measure_vitrain_loader(loader, workers: int, settings: DataBenchSettings) -> dict[str, Any]:
    """img/s of one of training's loaders with ``workers`` workers, and what it read per second."""
    batches = endless_batches(loader)
    for _ in range(max(1, workers)):  # the warm-up: every worker started and delivered
        next(batches)
    bytes_before, files_before = loader.read_counts
    timed = time_batches(batches, 0, settings.seconds)
    num_bytes, num_files = loader.read_counts[0] - bytes_before, loader.read_counts[1] - files_before
    batches.close()
    return {
        **timed,
        "read_mb_s": num_bytes / timed["seconds"] / 1e6,
        "files_s": num_files / timed["seconds"],
    }


def timm_loader(folder: Path, data: DataConfig, settings: DataBenchSettings, workers: int, batch: int):
    """timm's training loader over ``folder`` with the transform equivalent to vitrain's training transform
    (crop scale and ratio, flip, RandAugment, color jitter, random erasing), on the CPU without prefetcher."""
    from vitrain.bench.timm_reference import _import_timm

    _import_timm()
    import torch
    from timm.data import create_dataset, create_loader

    dataset = create_dataset("", root=str(folder), split="train", is_training=True, batch_size=batch)
    return create_loader(
        dataset,
        input_size=(3, settings.image_size, settings.image_size),
        batch_size=batch,
        is_training=True,
        scale=data.scale,
        ratio=data.ratio,
        hflip=data.hflip,
        color_jitter=data.color_jitter or None,
        auto_augment=data.randaugment,
        re_prob=data.random_erase,
        mean=tuple(data.mean or IMAGENET_MEAN),
        std=tuple(data.std or IMAGENET_STD),
        num_workers=workers,
        use_prefetcher=False,
        device=torch.device("cpu"),
    )


def measure_timm_loader(folder: Path, data: DataConfig, settings: DataBenchSettings, workers: int, batch: int):
    """img/s of timm's training loader (:func:`timm_loader`), timed as :func:`measure_vitrain_loader` times ours."""
    loader = timm_loader(folder, data, settings, workers, batch)
    batches = endless_batches(loader)
    timed = time_batches(batches, max(1, workers), settings.seconds)
    batches.close()
    return timed


def measure_decode(
    folder: Path, samples: list[tuple[str, int]], config: Config, settings: DataBenchSettings, cores: int
) -> tuple[list[dict[str, Any]], int]:
    """One row per worker count and backend: img/s, per worker-core, read MB/s and files/s; with
    ``compare_timm`` timm's img/s at that worker count and the ratio. Also the batch used (at most the number
    of images)."""
    batch = min(settings.batch, len(samples))
    if batch < settings.batch:
        log.warning("--batch %d: only %d images, measuring batches of %d", settings.batch, len(samples), batch)
    rows = []
    for workers in settings.workers:
        used = max(1, min(workers, cores))
        plan = bench_data_plan(config.data, config.train.seed, settings.image_size, batch, workers)
        theirs = None
        for backend in settings.backends:
            log.info("decode + augment: %s, %d worker(s), %.1f s", backend, workers, settings.seconds)
            loader = backend_loader(backend, samples, plan, settings.shards)
            ours = measure_vitrain_loader(loader, workers, settings)
            del loader
            gc.collect()  # ends the point's workers before the next starts its own
            row = {"backend": backend, "workers": workers, "cores_used": used, **ours}
            row["img_s_per_core"] = ours["img_s"] / used
            if settings.compare_timm:
                if theirs is None:
                    theirs = measure_timm_loader(folder, config.data, settings, workers, batch)
                    gc.collect()
                row["timm_img_s"] = theirs["img_s"]
                row["timm_img_s_per_core"] = theirs["img_s"] / used
                row["vitrain_over_timm"] = ours["img_s"] / theirs["img_s"]
            rows.append(row)
    return rows, batch


@contextlib.contextmanager
def shards_for(settings: DataBenchSettings, root: Path) -> Iterator[DataBenchSettings]:
    """``settings`` with the shards the shards backend reads: ``--shards``, else written from ``root`` into a
    temporary folder (removed afterwards)."""
    if "shards" not in settings.backends or settings.shards is not None:
        yield settings
        return
    from vitrain.data.shards import shard_folder

    with tempfile.TemporaryDirectory(prefix="vitrain-bench-shards-") as folder:
        log.info("writing %s as shards into %s (give --shards DIR to reuse shards)", root, folder)
        shard_folder(root, Path(folder), shard_bytes=SHARD_BYTES, workers=os.cpu_count() or 1)
        yield dataclasses.replace(settings, shards=Path(folder))


def files_per_epoch(settings: DataBenchSettings, samples: list[tuple[str, int]]) -> dict[str, int]:
    """Files opened per training epoch by each backend: one per image, or one per shard."""
    opened = {}
    for backend in settings.backends:
        if backend == "shards":
            index = json.loads((settings.shards / "index.json").read_text())
            opened[backend] = len(index["splits"]["train"]["shards"])
        else:
            opened[backend] = len(samples)
    return opened


# --- the verdict -----------------------------------------------------------------------------------


def input_verdict(points: list[tuple[int, float]], train_img_s: float, cores: int) -> dict[str, Any]:
    """Whether the input pipeline keeps up with training at ``train_img_s``, from ``(workers, img/s)`` points.

    Each point is input-bound when its img/s is below ``train_img_s``, and always at 0 workers (decoding in
    the training process adds its time to every step's). The workers needed: the fewest measured that keep
    up; else extrapolated linearly from the best per worker-core rate (img/s over min(workers, cores), 0
    workers counting as one), at least one more than the most measured, capped at ``cores`` (None: not
    reachable on this machine's cores)."""
    rows = [
        {"workers": workers, "img_s": rate, "input_bound": workers == 0 or rate < train_img_s}
        for workers, rate in points
    ]
    enough = [row["workers"] for row in rows if not row["input_bound"]]
    verdict = {"train_img_s": train_img_s, "cores": cores, "points": rows, "extrapolated": False, "capped": False}
    if enough:
        return {**verdict, "workers_needed": min(enough)}
    best = max(rate / max(1, min(workers, cores)) for workers, rate in points)
    needed = max(math.ceil(train_img_s / best), max(workers for workers, _ in points) + 1)
    verdict.update(extrapolated=True, best_img_s_per_core=best)
    if needed > cores:
        return {**verdict, "workers_needed": None, "capped": True}
    return {**verdict, "workers_needed": needed}


def describe_verdict(verdict: dict[str, Any]) -> str:
    """The verdict in one sentence."""
    train = verdict["train_img_s"]
    needed, cores = verdict["workers_needed"], verdict["cores"]
    if verdict["capped"]:
        reach = verdict["best_img_s_per_core"] * cores
        return (
            f"input-bound at every worker count: training takes {train:.0f} img/s, and even {cores} workers (all "
            f"cores) would decode only about {reach:.0f} img/s (extrapolated); use fewer augmentations, smaller "
            "stored images, or more CPU cores"
        )
    how = "extrapolated linearly from the best rate per worker-core" if verdict["extrapolated"] else "measured"
    return f"training takes {train:.0f} img/s: {needed} worker(s) keep up with it ({how})"


def measure_training_img_s(
    base: Config,
    config_files: list[Path],
    overrides: list[str],
    model: str,
    precision: str,
    image_size: int,
    batch: int,
) -> dict[str, Any]:
    """img/s of a few training steps of ``model`` at ``image_size`` and ``batch`` on synthetic data
    (``vitrain bench``'s harness: warm-up, then the median of timed windows)."""
    from vitrain.bench.throughput import BenchSettings, bench_overrides, measure_training_step
    from vitrain.train import make_plan

    settings = BenchSettings(steps=3, warmup=1, repeats=3)
    flags = bench_overrides(model, image_size, batch, precision, None, settings)
    plan = make_plan(build_config(base, config_files, flags + overrides))
    record = measure_training_step(plan, settings)
    keys = ("model", "image_size", "batch", "precision", "precision_mode", "device", "img_s_median", "step_ms_median")
    return {**{key: record[key] for key in keys}, "source": "vitrain bench's harness, synthetic data"}


# --- running and reporting -------------------------------------------------------------------------


def run_bench_data(settings: DataBenchSettings, config: Config, training: Callable[[], dict] | None = None):
    """Every measurement of ``vitrain bench-data`` as one record. ``config``: the data settings of the training
    transform; ``training``: measures the training throughput when no ``train_img_s`` is given (or None). Bad
    input (the folder, the model, timm missing) fails before the first measurement: training is timed first."""
    folder, samples = training_split(settings.root)
    if settings.compare_timm:
        from vitrain.bench.timm_reference import _import_timm

        _import_timm()
    machine = describe_machine()
    cores = machine["usable_cores"]
    measured = None if settings.train_img_s is not None or training is None else training()
    log.info("bench-data: %d images under %s, %d usable core(s)", len(samples), folder, cores)
    storage = measure_storage([path for path, _ in samples], settings.seconds)
    root = settings.root if folder != settings.root else folder.parent
    with shards_for(settings, root) as settings:
        rows, batch = measure_decode(folder, samples, config, settings, cores)
        opened = files_per_epoch(settings, samples)
    result = {
        "root": str(settings.root),
        "split_folder": str(folder),
        "num_images": len(samples),
        "image_size": settings.image_size,
        "batch": batch,
        "seconds_per_point": settings.seconds,
        "machine": machine,
        "storage": storage,
        "backends": list(settings.backends),
        "files_per_epoch": opened,
        "decode": rows,
        "training": measured,
        "verdict": None,
    }
    if settings.train_img_s is not None:
        result["training"] = {"img_s_median": settings.train_img_s, "source": "--train-img-s"}
    if result["training"] is not None:
        points = [(row["workers"], row["img_s"]) for row in rows if row["backend"] == settings.backends[0]]
        verdict = input_verdict(points, result["training"]["img_s_median"], cores)
        result["verdict"] = {**verdict, "summary": describe_verdict(verdict)}
    return result


def _storage_lines(storage: dict[str, Any]) -> list[str]:
    drop = storage["cache_drop"]
    if drop["files"] is None:
        dropped = f"cold: {drop['method']}"
    else:
        dropped = f"cold: {drop['method']} accepted for {drop['files_dropped']} of {drop['files']} files"
        dropped += f" ({drop['reason']})" if drop["reason"] else " (advice: the kernel may keep some pages)"
    lines = [
        f"storage ({storage['tool']}, {storage['files_in_sample']} files of {storage['mean_file_kib']:.1f} KiB "
        f"on average; {dropped})",
        "         read MB/s     IOPS",
    ]
    for name in ("cold", "warm"):
        lines.append(f"  {name:5}  {storage[name]['read_mb_s']:10.1f} {storage[name]['iops']:9.0f}")
    return lines + [f"  IOPS: {storage['iops_means']}"]


def _decode_lines(result: dict[str, Any]) -> list[str]:
    rows = result["decode"]
    timm = "timm_img_s" in rows[0]
    header = "| backend | workers | img/s | img/s per core | read MB/s | files/s |"
    header += " timm img/s | over timm |" * timm
    opened = ", ".join(f"{name} {count}" for name, count in result["files_per_epoch"].items())
    lines = [
        f"decode + augment at {result['image_size']} px, batch {result['batch']}, {result['seconds_per_point']:g} s "
        f"per point (files opened per epoch: {opened}):",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for row in rows:
        line = f"| {row['backend']} | {row['workers']} | {row['img_s']:.1f} | {row['img_s_per_core']:.1f} "
        line += f"| {row['read_mb_s']:.2f} | {row['files_s']:.1f} |"
        if timm:
            line += f" {row['timm_img_s']:.1f} | {row['vitrain_over_timm']:.2f} |"
        lines.append(line)
    return lines


def format_report(result: dict[str, Any]) -> str:
    """The console report: machine, storage, decode table, verdict."""
    machine = result["machine"]
    lines = [
        f"{result['num_images']} images in {result['split_folder']}",
        f"machine: {machine['cpu_model']}, {machine['usable_cores']} usable of {machine['logical_cores']} cores",
        *_storage_lines(result["storage"]),
        *_decode_lines(result),
    ]
    verdict = result["verdict"]
    if verdict is not None:
        bound = ", ".join(
            f"{point['workers']}: {'input-bound' if point['input_bound'] else 'keeps up'}"
            for point in verdict["points"]
        )
        lines += [f"verdict (workers: {bound}): {verdict['summary']}"]
    return "\n".join(lines)


def plot_decode(result: dict[str, Any], path: Path) -> bool:
    """img/s against workers (vitrain, timm where measured, the training rate where known) as a PNG; False
    when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    rows = result["decode"]
    figure, axes = plt.subplots(figsize=(6, 4))
    for backend in result["backends"]:
        mine = [row for row in rows if row["backend"] == backend]
        axes.plot(
            [row["workers"] for row in mine], [row["img_s"] for row in mine], marker="o", label=f"vitrain {backend}"
        )
    first = [row for row in rows if row["backend"] == result["backends"][0]]
    workers = [row["workers"] for row in first]
    if "timm_img_s" in rows[0]:
        axes.plot(workers, [row["timm_img_s"] for row in first], marker="s", label="timm create_loader")
    if result["verdict"] is not None:
        axes.axhline(result["verdict"]["train_img_s"], linestyle="--", color="gray", label="training img/s")
    axes.set_xlabel("data-loader workers")
    axes.set_ylabel("decoded + augmented img/s")
    axes.set_xticks(workers)
    axes.set_title(f"{Path(result['root']).name}: {result['image_size']} px, batch {result['batch']}")
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
