"""A teacher as a dense labeler, and the labeling of a training set into label maps (``vitrain label``).

The teacher's classifier is applied at every spatial position instead of once to the pooled
features, as the TokenLabeling toolbox's ``generate_label.py`` does:

- vitrain ViT / DeiT / LocalViT: the head on every patch token (prefix tokens dropped; ``fc_norm`` first
  for pooled-head models; a distilled model's two heads averaged, as its logits are);
- vitrain VOLO: the auxiliary head on the patch tokens (``forward_head_with_tokens``), or the class head on
  each patch token when the model has none;
- CNNs (vitrain ResNet, timm models whose ``forward_features`` gives ``(B, C, H, W)``) and timm ViTs: the
  linear classifier (``get_classifier()``, ``fc`` or ``head.fc``) as a 1x1 convolution over the final feature
  map, global pooling removed (after ``head.norm`` where the head normalizes, as timm's ConvNeXt does).

What is stored, like the toolbox: the top-k of the raw **logits** (no softmax) at each position, and
their class indices. Training turns them into targets (``vitrain.token_labeling.targets``).

Labeling walks the training split in dataset order with the evaluation transform (resize the short
side to size / crop_pct, center-crop), at the teacher's input size, with no augmentation. Under
torchrun the shards still to do are split into contiguous runs, one per rank; rank 0 writes
``index.json`` after all have finished. Undecodable files get no map and are listed as ``missing``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from vitrain.config import ConfigError, DataPlan, Plan, World
from vitrain.config.precision import PrecisionPolicy
from vitrain.data import sources
from vitrain.data.loader import BadImageLog, ImageFileDataset, draft_size, in_memory_split
from vitrain.data.transforms import Normalize, batch_eval_resize, build_eval_transform
from vitrain.models.vit import VisionTransformer
from vitrain.models.volo import VOLO
from vitrain.parallel.distributed import barrier, gather_objects
from vitrain.token_labeling.maps import (
    DEFAULT_SHARD_SIZE,
    MISSING_INDEX,
    DatasetFingerprint,
    LabelMaps,
    LabelMapWriter,
    MapLayout,
    in_memory_sample_keys,
    sample_keys_of_paths,
)
from vitrain.weights.teacher import TeacherError, load_teacher

log = logging.getLogger("vitrain")
DEFAULT_TOPK = 5
"""Scores kept per position: the toolbox's (its ImageNet maps are top-5)."""


# --- dense logits ---------------------------------------------------------------------------------


def dense_logits(teacher: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The teacher's class logits at every position of its output grid: ``(B, classes, H, W)``."""
    if isinstance(teacher, VisionTransformer):
        return _vit_dense_logits(teacher, images)
    if isinstance(teacher, VOLO):
        return _volo_dense_logits(teacher, images)
    classifier = _linear_classifier(teacher)
    if classifier is None or not callable(getattr(teacher, "forward_features", None)):
        raise _unsupported(teacher, "it has no forward_features and linear classifier (get_classifier(), fc, head.fc)")
    features = teacher.forward_features(images)
    if features.ndim == 3 and hasattr(teacher, "num_prefix_tokens"):  # a timm ViT
        features = _tokens_to_grid(features[:, teacher.num_prefix_tokens :], images, _patch_stride(teacher, images))
        features = _apply_channelwise(getattr(teacher, "fc_norm", None), features)
    elif features.ndim == 4:
        features = _head_norm(teacher, features)
    else:
        raise _unsupported(teacher, f"its forward_features gives shape {tuple(features.shape)}, not (B, C, H, W)")
    return _classifier_as_conv(classifier, features)


def _unsupported(teacher: nn.Module, why: str) -> TeacherError:
    return TeacherError(
        f"{type(teacher).__name__} cannot label tokens: {why}; use a vitrain ViT/DeiT/LocalViT/VOLO/ResNet or a timm CNN"
    )


def _linear_classifier(teacher: nn.Module) -> nn.Linear | None:
    candidates = []
    if callable(getattr(teacher, "get_classifier", None)):
        candidates.append(teacher.get_classifier())
    candidates += [getattr(teacher, "fc", None), getattr(getattr(teacher, "head", None), "fc", None)]
    candidates.append(getattr(teacher, "head", None))
    return next((module for module in candidates if isinstance(module, nn.Linear)), None)


def _classifier_as_conv(classifier: nn.Linear, features: torch.Tensor) -> torch.Tensor:
    """The linear classifier applied at every position of ``(B, C, H, W)``: a 1x1 convolution."""
    weight = classifier.weight[:, :, None, None]
    return F.conv2d(features, weight.to(features.dtype), None if classifier.bias is None else classifier.bias)


def _head_norm(teacher: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """timm heads that normalize the pooled features (ConvNeXt's ``head.norm``, a LayerNorm2d): per position."""
    norm = getattr(getattr(teacher, "head", None), "norm", None)
    return features if norm is None or isinstance(norm, nn.Identity) else norm(features)


def _apply_channelwise(norm: nn.Module | None, grid: torch.Tensor) -> torch.Tensor:
    """A per-token module (LayerNorm) applied at every position of ``(B, C, H, W)``."""
    if norm is None or isinstance(norm, nn.Identity):
        return grid
    return norm(grid.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _patch_stride(teacher: nn.Module, images: torch.Tensor) -> int:
    patch_size = getattr(getattr(teacher, "patch_embed", None), "patch_size", None)
    if isinstance(patch_size, (tuple, list)):
        patch_size = patch_size[0]
    if not isinstance(patch_size, int):
        raise _unsupported(teacher, "its patch size is unknown (no patch_embed.patch_size)")
    return patch_size


def _tokens_to_grid(tokens: torch.Tensor, images: torch.Tensor, stride: int) -> torch.Tensor:
    """``(B, H*W, C)`` patch tokens of ``images`` (row-major) -> ``(B, C, H, W)``."""
    height, width = images.shape[-2] // stride, images.shape[-1] // stride
    if tokens.shape[1] != height * width:
        raise TeacherError(f"{tokens.shape[1]} patch tokens do not form the {height}x{width} grid of the input")
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], height, width)


def _vit_dense_logits(teacher: VisionTransformer, images: torch.Tensor) -> torch.Tensor:
    if teacher.aux_head is not None:  # trained with token labeling: its per-token head, as for VOLO
        logits = teacher.forward_head_with_tokens(teacher.forward_features(images))[1]
        return _tokens_to_grid(logits, images, teacher.args.patch_size)
    tokens = teacher.forward_features(images)[:, teacher.num_prefix_tokens :]
    tokens = teacher.fc_norm(tokens)  # the pooled head's norm (identity for CLS-token models)
    logits = teacher.head(tokens)
    if teacher.head_dist is not None:
        logits = (logits + teacher.head_dist(tokens)) / 2
    return _tokens_to_grid(logits, images, teacher.args.patch_size)


def _volo_dense_logits(teacher: VOLO, images: torch.Tensor) -> torch.Tensor:
    tokens = teacher.forward_features(images)
    if teacher.aux_head is not None:
        logits = teacher.forward_head_with_tokens(tokens)[1]
    else:
        logits = teacher.head(tokens[:, 1:])
    return _tokens_to_grid(logits, images, teacher.args.total_stride)


def top_k_maps(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` logits and their class indices at each position: ``(B, k, H, W)`` float16 and int16."""
    scores, indices = logits.float().topk(k, dim=1)
    return scores.half(), indices.to(torch.int16)


def teacher_input_size(teacher: nn.Module, default: int) -> int:
    """The image side the teacher was made for: a vitrain model's ``img_size``, a timm model's pretrained
    config ``input_size``, else ``default``."""
    args = getattr(teacher, "args", None)
    if isinstance(getattr(args, "img_size", None), int):
        return args.img_size
    input_size = (getattr(teacher, "pretrained_cfg", None) or {}).get("input_size")
    return int(input_size[-1]) if input_size else default


def describe_teacher(teacher: nn.Module, source: str, image_size: int) -> dict[str, Any]:
    """What ``index.json`` records of the teacher: its source, class (and timm architecture), input side."""
    architecture = (getattr(teacher, "pretrained_cfg", None) or {}).get("architecture")
    return {"source": str(source), "type": architecture or type(teacher).__name__, "image_size": image_size}


# --- the training split in dataset order ----------------------------------------------------------


LabelBatch = tuple[list[int], torch.Tensor | None, list[int]]
"""(indices of the images, their uint8 images, indices that could not be decoded)."""


class _IndexedImages(Dataset):
    def __init__(self, files: ImageFileDataset):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        image, _, events, _ = self.files[(index, 0)]
        return index, image, events


def _collate_indexed(items):
    kept = [(index, image) for index, image, _ in items if image is not None]
    images = torch.stack([image for _, image in kept]) if kept else None
    missing = [index for index, image, _ in items if image is None]
    return [index for index, _ in kept], images, missing, [event for *_, events in items for event in events]


class TrainingImages:
    """The training split of a data plan, in dataset order, through the evaluation transform at
    ``image_size``: ``keys`` identify its samples, ``batches(indices, size)`` yields :data:`LabelBatch`."""

    def __init__(self, data: DataPlan, image_size: int):
        self.data, self.image_size = data, image_size
        config = data.source
        if config.name == "imagefolder":
            root = Path(sources.image_folder_root(config))
            self.samples = sources.image_folder_samples(root, "train", config.val_fraction)[0][: config.limit_train]
            self.keys = sample_keys_of_paths(sources.image_folder_base(root), [path for path, _ in self.samples])
            self.memory = None
        else:
            self.memory = in_memory_split(data, "train")
            self.keys = in_memory_sample_keys(config.name, len(self.memory))

    def __len__(self) -> int:
        return len(self.keys)

    def batches(self, indices: Sequence[int], batch_size: int) -> Iterator[LabelBatch]:
        if self.memory is not None:
            yield from self._memory_batches(indices, batch_size)
        else:
            yield from self._file_batches(indices, batch_size)

    def _memory_batches(self, indices: Sequence[int], batch_size: int) -> Iterator[LabelBatch]:
        images, crop_pct = self.memory.images, self.data.source.crop_pct
        for start in range(0, len(indices), batch_size):
            chunk = list(indices[start : start + batch_size])
            selected = images[torch.tensor(chunk, device=images.device)]
            yield chunk, batch_eval_resize(selected, self.image_size, crop_pct), []

    def _file_batches(self, indices: Sequence[int], batch_size: int) -> Iterator[LabelBatch]:
        config = self.data.source
        files = ImageFileDataset(
            self.samples,
            build_eval_transform(config, self.image_size),
            draft_size(config, self.image_size, train=False),
            config.max_image_pixels,
            replace_bad=False,
        )
        bad_images = BadImageLog(self.samples, config.max_bad_fraction, "training")
        loader = DataLoader(
            _IndexedImages(files),
            batch_size=batch_size,
            sampler=list(indices),  # dataset order: never shuffled
            collate_fn=_collate_indexed,
            num_workers=config.num_workers,
        )
        for kept, images, missing, events in loader:
            if events:
                bad_images.record(events)  # raises past data.max_bad_fraction
            yield kept, images, missing


# --- generation -----------------------------------------------------------------------------------


class _ShardBuffer:
    """Collects the maps of the shards under way (indices arrive in dataset order, a batch may span two
    shards) and hands each to the writer once all its images are in."""

    def __init__(self, writer: LabelMapWriter):
        self.writer, self.layout = writer, writer.layout
        self.open: dict[int, dict[str, Any]] = {}

    def _shard(self, shard: int) -> dict[str, Any]:
        if shard not in self.open:
            layout = self.layout
            shape = (len(layout.shard_range(shard)), layout.k, layout.height, layout.width)
            self.open[shard] = {
                "scores": np.zeros(shape, np.float16),
                "indices": np.full(shape, MISSING_INDEX, np.int16),
                "missing": [],
                "filled": 0,
            }
        return self.open[shard]

    def add(
        self, indices: Sequence[int], scores: np.ndarray | None, classes: np.ndarray | None, missing: Sequence[int]
    ):
        per_shard = self.layout.samples_per_shard
        for row, index in enumerate(indices):
            state = self._shard(index // per_shard)
            state["scores"][index % per_shard], state["indices"][index % per_shard] = scores[row], classes[row]
            state["filled"] += 1
        for index in missing:
            state = self._shard(index // per_shard)
            state["missing"].append(index)
            state["filled"] += 1
        for shard in [shard for shard, state in self.open.items() if state["filled"] == len(state["scores"])]:
            state = self.open.pop(shard)
            self.writer.write_shard(shard, state["scores"], state["indices"], state["missing"])


@dataclasses.dataclass(frozen=True)
class LabelSettings:
    """What ``vitrain label`` was asked for."""

    teacher: str
    out: Path
    teacher_weights: Path | None = None
    teacher_model: str | None = None
    k: int = DEFAULT_TOPK
    batch_size: int = 64
    shard_size: int = DEFAULT_SHARD_SIZE
    image_size: int | None = None
    """The side images are labeled at; the teacher's input size when unset."""
    progress: bool = True


def _check_settings(settings: LabelSettings) -> None:
    for name, value in (
        ("--topk", settings.k),
        ("--batch", settings.batch_size),
        ("--shard-size", settings.shard_size),
    ):
        if value < 1:
            raise ConfigError(f"{name} {value}: must be >= 1")
    if settings.image_size is not None and settings.image_size < 1:
        raise ConfigError(f"--image-size {settings.image_size}: must be >= 1")


def _load_labeling_teacher(plan: Plan, settings: LabelSettings) -> nn.Module:
    try:
        return load_teacher(
            settings.teacher,
            weights=settings.teacher_weights,
            model=settings.teacher_model,
            num_classes=plan.model.num_classes,
            in_chans=plan.data.in_chans,
            device=plan.device,
        )
    except TeacherError as error:
        raise ConfigError(f"--teacher {settings.teacher}: {error}") from None


class DenseLabeler:
    """uint8 images -> top-k maps (float16 scores, int16 indices) of a frozen teacher, on its device."""

    def __init__(self, teacher: nn.Module, k: int, mean, std, precision: PrecisionPolicy):
        self.teacher, self.k, self.device, self.precision = teacher, k, precision.device, precision
        self.normalize = Normalize(mean, std, self.device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        with self.precision.autocast_context():  # the run's precision, as evaluation computes
            logits = dense_logits(self.teacher, self.normalize(images.to(self.device, non_blocking=True)))
        scores, indices = top_k_maps(logits, self.k)
        return scores.cpu().numpy(), indices.cpu().numpy()

    @torch.no_grad()
    def output_shape(self, channels: int, image_size: int) -> tuple[int, int, int]:
        """(classes, H, W) of the teacher's dense logits at ``image_size``."""
        probe = torch.zeros(1, channels, image_size, image_size, dtype=torch.uint8)
        try:
            logits = dense_logits(self.teacher, self.normalize(probe.to(self.device)))
        except TeacherError as error:
            raise ConfigError(f"--teacher: {error}") from None
        except (ValueError, RuntimeError, AssertionError) as error:  # e.g. a fixed-size model at another size
            raise ConfigError(
                f"--teacher: it does not take {image_size} px images ({error}); set --image-size to its input size"
            ) from None
        return tuple(logits.shape[1:])


def _my_shards(todo: list[int], world: World) -> list[int]:
    """This rank's contiguous run of the shards still to do (balanced, also when resuming)."""
    return todo[world.rank * len(todo) // world.size : (world.rank + 1) * len(todo) // world.size]


def generate_label_maps(
    labeler: DenseLabeler, images: TrainingImages, writer: LabelMapWriter, world: World, settings: LabelSettings
) -> int:
    """Label this rank's share of the unfinished shards; returns the number of images it labeled."""
    todo = sorted(set(range(writer.layout.num_shards)) - writer.finished_shards())
    barrier()  # every rank lists the finished shards before any rank writes one
    shards = _my_shards(todo, world)
    layout = writer.layout
    log.info(
        "label maps in %s: %d of %d shards to do (%d images, top-%d on a %dx%d grid) over %d process(es)",
        writer.path,
        len(todo),
        layout.num_shards,
        layout.count,
        layout.k,
        layout.height,
        layout.width,
        world.size,
    )
    indices = [index for shard in shards for index in writer.layout.shard_range(shard)]
    buffer = _ShardBuffer(writer)
    labeled = 0
    with tqdm(total=len(indices), disable=not (settings.progress and world.is_main), unit="img") as progress:
        for kept, batch, missing in images.batches(indices, settings.batch_size):
            scores, classes = labeler(batch) if batch is not None else (None, None)
            buffer.add(kept, scores, classes, missing)
            labeled += len(kept)
            progress.update(len(kept) + len(missing))
    if buffer.open:
        raise RuntimeError(f"shards {sorted(buffer.open)} were not completed")  # the loader lost images
    return labeled


def _folder_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def _labeling_header(teacher: nn.Module, settings: LabelSettings, plan: Plan, images: TrainingImages) -> dict:
    data = plan.data.source.model_dump(mode="json")
    return {
        "teacher": describe_teacher(teacher, settings.teacher, images.image_size),
        "fingerprint": dataclasses.asdict(DatasetFingerprint.of_keys(images.keys)),
        "data": {**data, "label_image_size": images.image_size, "mean": plan.data.mean, "std": plan.data.std},
    }


def label_training_set(plan: Plan, settings: LabelSettings) -> dict[str, Any]:
    """Label maps of the plan's training split in ``settings.out`` (resuming a folder left unfinished), checked;
    returns the report: images, shards, bytes, seconds, images/s (over all ranks)."""
    _check_settings(settings)
    if plan.data.source.name == "webdataset":
        raise ConfigError(
            "vitrain label needs indexed samples; data.name=webdataset streams its shards: label the image "
            "folder they were written from (data.name=imagefolder)"
        )
    teacher = _load_labeling_teacher(plan, settings)
    image_size = settings.image_size or teacher_input_size(teacher, plan.data.source.image_size)
    labeler = DenseLabeler(teacher, settings.k, plan.data.mean, plan.data.std, plan.precision)
    num_classes, height, width = labeler.output_shape(plan.data.in_chans, image_size)
    if settings.k > num_classes:
        raise ConfigError(
            f"--topk {settings.k}: the teacher has only {num_classes} classes; use --topk <= {num_classes}"
        )
    images = TrainingImages(plan.data, image_size)
    layout = MapLayout(len(images), num_classes, settings.k, height, width, settings.shard_size)
    writer = LabelMapWriter(settings.out, layout, _labeling_header(teacher, settings, plan, images))
    if plan.world.is_main:
        writer.write_header()
    started = time.perf_counter()
    labeled = sum(gather_objects(generate_label_maps(labeler, images, writer, plan.world, settings)))
    seconds = time.perf_counter() - started
    barrier()  # every shard is written
    if not plan.world.is_main:
        return {}
    index = writer.write_index()
    LabelMaps(settings.out).check(num_classes, DatasetFingerprint.of_keys(images.keys))
    total_bytes = _folder_bytes(Path(settings.out))
    return {
        "out": str(settings.out),
        "images": layout.count,
        "labeled_now": labeled,
        "missing": len(index["missing"]),
        "shards": layout.num_shards,
        "grid": [height, width],
        "k": settings.k,
        "bytes_per_image": round(total_bytes / max(layout.count, 1), 1),
        "total_bytes": total_bytes,
        "seconds": round(seconds, 3),
        "images_per_s": round(labeled / seconds, 1) if seconds > 0 else None,
    }
