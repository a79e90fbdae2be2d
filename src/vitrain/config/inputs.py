"""Checks of what a run reads and where: data sources and decoders (image folders, shards, DALI, GPU
decode), pinned attention kernels, the fine-tuning source and the profiling window. Each raises
:class:`ConfigError` naming the key and a fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitrain.config.checks import require
from vitrain.config.plan import DatasetInfo
from vitrain.config.schema import CUDA_HALF_ONLY_IMPLS, CUDA_ONLY_IMPLS, Config
from vitrain.config.weights import WEIGHTS_SUFFIXES, init_source_kind

FP16_MIN_ADAM_EPS = 1e-4
"""Smallest AdamW eps allowed with fp16 weights: below it, squared gradients under fp16's 6e-8 floor
leave eps alone in the denominator (measured: eps 1e-8 -> NaN, 1e-6 -> divergence, 1e-4 trains)."""


def check_inputs(config: Config, data: DatasetInfo, precision: str, mode: str, device: str) -> None:
    """Cross-field checks that no single field's validator can make: normalization against the
    data's channels, keys the source ignores, fp16 Adam epsilon, the init checkpoint's existence."""
    for key in ("mean", "std"):
        value = getattr(config.data, key)
        require(
            value is None or len(value) == data.channels,
            f"data.{key} has {len(value or ())} values but the data has {data.channels} channels; "
            f"give {data.channels} values or null for the source default",
        )
    require(
        config.data.translate < config.data.image_size,
        f"data.translate={config.data.translate} shifts a {config.data.image_size}-pixel image out of view; "
        "give a few pixels (2-4 for 28-32 px images) or 0 to turn it off",
    )
    _check_pinned_attention(config.model.attn_impl, precision, device)
    require(
        config.data.root is None or config.data.name != "synthetic",
        "data.root is not used by data.name=synthetic; remove it",
    )
    require(
        not (precision == "fp16" and mode == "full" and config.optim.name in ("adamw", "muon"))
        or config.optim.eps >= FP16_MIN_ADAM_EPS,
        f"optim.eps={config.optim.eps:g} with fp16 weights (precision_mode=full): Adam's second moment "
        f"underflows in fp16 and the update divides by eps alone, which diverged in our tests; set "
        f"optim.eps>={FP16_MIN_ADAM_EPS:g} or use precision_mode=o2 (fp32 master weights)",
    )
    performance = config.performance
    require(
        performance.compile_mode == "default" or performance.compile_backend == "inductor",
        f"performance.compile_mode={performance.compile_mode} is a mode of inductor, not of "
        f"performance.compile_backend={performance.compile_backend}; set performance.compile_backend=inductor or "
        "performance.compile_mode=default",
    )
    check_init_source(config.train)
    _check_webdataset(config)
    _check_dali(config)
    _check_device_decode(config, device)
    profile_window(config.train.profile)


def _check_pinned_attention(impl: str | None, precision: str, device: str) -> None:
    """A pinned SDPA kernel the run's device or precision lacks fails at the first step with torch's "No
    available kernel": refuse it here, naming what does run."""
    require(
        impl not in CUDA_ONLY_IMPLS or device.startswith("cuda"),
        f"model.attn_impl={impl} pins an SDPA kernel that exists on CUDA only and this run is on {device}; "
        "use sdpa, sdpa_flash, sdpa_math, matmul or auto",
    )
    require(
        impl not in CUDA_HALF_ONLY_IMPLS or not device.startswith("cuda") or precision != "fp32",
        f"model.attn_impl={impl} pins an SDPA kernel that takes only bf16/fp16 on CUDA and this run is in fp32; "
        "set precision=bf16, or use sdpa, sdpa_efficient, sdpa_math, matmul or auto",
    )


def _check_webdataset(config: Config) -> None:
    """What a stream of tar shards cannot do: it has no sample index to repeat or to look label maps up by."""
    if config.data.name != "webdataset":
        return
    require(
        config.data.repeated_aug == 1,
        f"data.repeated_aug={config.data.repeated_aug} needs indexed samples; data.name=webdataset streams its "
        "shards: set data.repeated_aug=1 or train from the image folder (data.name=imagefolder)",
    )
    require(
        config.token_labels.maps is None,
        "token_labels.maps needs indexed samples; data.name=webdataset streams its shards: train token labeling "
        "from the image folder (data.name=imagefolder)",
    )


DALI_UNSUPPORTED = ("data.randaugment", "data.three_augment", "data.color_jitter", "token_labels.maps")
"""Keys that need Pillow's per-image path (set: truthy)."""


def _pillow_only_keys(config: Config) -> list[str]:
    """The :data:`DALI_UNSUPPORTED` keys ``config`` sets."""
    values = {key: getattr(getattr(config, key.split(".")[0]), key.split(".")[1]) for key in DALI_UNSUPPORTED}
    return [key for key, value in values.items() if value]


def _check_device_decode(config: Config, device: str) -> None:
    """data.decode=gpu: a CUDA run of the Pillow path without the per-image policies."""
    data = config.data
    if data.decode != "gpu":
        return
    require(
        device.startswith("cuda"),
        f"data.decode=gpu decodes on the run's CUDA device; this run is on {device}: set data.decode=cpu",
    )
    require(
        data.name in ("imagefolder", "webdataset") and data.backend == "pillow",
        f"data.decode=gpu decodes image files of the Pillow path (data.name=imagefolder or webdataset, "
        f"data.backend=pillow), not data.name={data.name} with data.backend={data.backend}; DALI decodes on the "
        "GPU by itself",
    )
    used = _pillow_only_keys(config)
    require(
        not used,
        f"data.decode=gpu crops, flips, translates and erases on the device; {', '.join(used)} runs on PIL images: "
        "set data.decode=cpu or turn it off",
    )


def _check_dali(config: Config) -> None:
    """What the DALI pipelines do not do: in-memory sources, per-image policies, token labels, remote shards."""
    data = config.data
    if data.backend != "dali":
        return
    require(
        data.name in ("imagefolder", "webdataset"),
        f"data.backend=dali decodes image files; data.name={data.name} is decoded in memory: set data.backend=pillow "
        "or train from files (data.name=imagefolder or webdataset)",
    )
    used = _pillow_only_keys(config)
    require(
        not used,
        f"data.backend=dali applies crop, flip, random erasing and translation only; {', '.join(used)} needs the "
        "Pillow path: set data.backend=pillow or turn it off",
    )
    root = str(data.root or "")
    require(
        data.name != "webdataset" or not (":" in data.wds_label_key or root.startswith("pipe:") or "://" in root),
        "data.backend=dali reads local shard files with a text label entry (data.wds_label_key=cls); pipe:/URL "
        "shards and JSON label fields need data.backend=pillow",
    )


def profile_window(text: str | None) -> tuple[int, int] | None:
    """train.profile ``"START:N"`` -> (START, N); None for None; ConfigError naming the form otherwise."""
    if text is None:
        return None
    start, separator, count = str(text).partition(":")
    window = (int(start), int(count)) if separator and start.isdigit() and count.isdigit() else None
    require(
        window is not None and window[1] >= 1,
        f"train.profile={text}: give START:N, the first step to trace (0-based) and how many steps (>= 1), "
        "e.g. train.profile=20:5",
    )
    return window


def check_init_source(train: Any) -> None:
    """``train.init_from`` names something that holds weights; ``train.init_weights`` only with timm:NAME."""
    if train.init_from is None:
        require(train.init_weights is None, "train.init_weights is for train.init_from=timm:NAME; set both or neither")
        return
    if init_source_kind(train.init_from) == "timm":
        require(
            train.init_weights is None
            or (Path(train.init_weights).is_file() and Path(train.init_weights).suffix in WEIGHTS_SUFFIXES),
            f"train.init_weights={train.init_weights}: no such .safetensors/.pth/.bin file; give the path of "
            f"{train.init_from[5:]}'s weights (or leave it unset to use the local Hugging Face cache)",
        )
        return
    path = Path(train.init_from)
    require(
        path.is_file() or (path / "COMPLETE").is_file() or (path / "checkpoints").is_dir(),
        f"train.init_from={train.init_from}: no such checkpoint (or an incomplete one); give a run folder, a "
        "runs/.../checkpoints/step-* file or sharded folder, a .safetensors file or timm:NAME",
    )
    require(
        train.init_weights is None,
        f"train.init_weights is for train.init_from=timm:NAME; {train.init_from} holds its own weights: remove it",
    )
