"""Classifying image files with a trained checkpoint (``vitrain predict``), without its training data.

The checkpoint's saved config rebuilds the model and the evaluation input pipeline: files decode as in
training (:func:`vitrain.data.decode.decode_image`: grayscale, CMYK, palette, 16-bit and EXIF-rotated
files converted to RGB; one-channel models see Pillow's luminance), then the evaluation transform
(short side resized to ``data.image_size / data.crop_pct``, centre crop), the run's normalization, and the
forward under the run's precision autocast, on ``train.device``. Files that cannot be decoded come back
as errors with a :data:`~vitrain.data.decode.BAD_REASONS` code; they never stop the others.

Class names come from the training data: an image folder's class folder names in index order (kept in
the checkpoint since they were recorded at training; read from ``data.root`` for older checkpoints),
Fashion-MNIST's ten names, ``class_N`` for synthetic data; ``class_N`` with a warning when unknown.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from vitrain.checkpoint import CheckpointError, resolve_checkpoint_argument
from vitrain.checkpoint.sharded import read_checkpoint_model
from vitrain.config import Config, ConfigError, DataConfig, DatasetInfo, Hardware, Plan, build_config, resolve
from vitrain.data import Normalize, describe_source
from vitrain.data.loader import ImageFileDataset, collate_decoded, draft_size
from vitrain.data.sources import (
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    IMAGE_EXTENSIONS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    image_folder_root,
    image_folder_samples,
)
from vitrain.data.transforms import build_eval_transform
from vitrain.models.convert import inferred_model_args

log = logging.getLogger("vitrain")

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
"""Fashion-MNIST's labels 0-9 (Xiao et al. 2017)."""

OutputStyle = Literal["table", "json", "csv"]


# --- the checkpoint ------------------------------------------------------------------------------


def checkpoint_config(
    saved: dict[str, Any],
    yaml_files: Sequence[Path] = (),
    overrides: Sequence[str] = (),
    recorded: dict[str, Any] | None = None,
) -> Config:
    """A checkpoint's saved config, YAML files and ``--set`` overrides applied, for using its model in one
    process: whatever sharded the training run, and without the distillation teacher, the token-label maps
    and the initial checkpoint it trained from (they may be gone); an SDPA kernel the training run pinned
    (``model.attn_impl=sdpa_cudnn``, ...) becomes torch's choice (``sdpa``) unless ``overrides`` pin one.
    ``recorded``: the checkpoint's plan record, whose precision and mode (what the run's ``auto`` measured)
    replace ``auto`` unless ``overrides`` set them."""
    from vitrain.config.resolve import TOKEN_LABEL_KEYS
    from vitrain.models.layers import SDPA_BACKENDS

    base = Config.model_validate(saved)
    recorded = recorded or {}
    if base.precision == "auto" and recorded.get("precision"):
        base.precision = recorded["precision"]
    if base.precision_mode == "auto":
        base.precision_mode = recorded.get("precision_mode") or "autocast"
    if base.model.attn_impl in SDPA_BACKENDS:  # pinned for the training device; this one may lack the kernel
        base.model.attn_impl = "sdpa"
    config = build_config(base, list(yaml_files), list(overrides))
    config.parallel.strategy = "ddp"
    defaults = Config()
    for key in ("distill", "teacher", "teacher_weights", "teacher_model", "init_from", *TOKEN_LABEL_KEYS):
        setattr(config.train, key, getattr(defaults.train, key))
    config.data.token_labels = None
    return config


def training_data_info(config: Config, info: dict[str, Any], weights: dict[str, torch.Tensor]) -> DatasetInfo:
    """What resolve() needs to know of the training data, from the checkpoint alone (the data may be gone):
    classes from the weights, channels and normalization from the source, the epoch size from the record."""
    data, recorded = config.data, info.get("plan", {})
    # resolve checks the training batch against the epoch: the one trained, at least one batch
    num_train = max(recorded.get("steps_per_epoch", 1) * recorded.get("global_batch", 1), config.train.batch_size)
    if data.name == "synthetic":  # generated from the config: nothing to read
        return dataclasses.replace(describe_source(data), num_train=num_train)
    num_classes = inferred_model_args(weights, config.model.name).get("num_classes")
    if num_classes is None:
        raise CheckpointError(f"the checkpoint's {config.model.name} weights have no classifier to predict with")
    grayscale = data.name == "fashion-mnist"
    return DatasetInfo(
        num_train=num_train,
        num_eval=1,
        num_classes=num_classes,
        channels=1 if grayscale else 3,
        mean=FASHION_MNIST_MEAN if grayscale else IMAGENET_MEAN,
        std=FASHION_MNIST_STD if grayscale else IMAGENET_STD,
    )


def checkpoint_plan(config: Config, info: dict[str, Any], weights: dict[str, torch.Tensor]) -> Plan:
    """The resolved plan of a checkpoint's (adjusted) config on this machine, without its training data."""
    hardware = Hardware.detect(config.train.device)
    return resolve(config, training_data_info(config, info, weights), hardware)


def _source_class_names(data: DataConfig) -> list[str] | None:
    if data.name == "fashion-mnist":
        return list(FASHION_MNIST_CLASSES)
    if data.name == "synthetic":
        return [f"class_{index}" for index in range(data.synthetic_num_classes)]
    try:
        return image_folder_samples(image_folder_root(data), "train")[1]
    except (ConfigError, OSError) as error:
        log.warning("class names unknown (the checkpoint has none and its image folder cannot be read: %s)", error)
        return None


def known_class_names(data: DataConfig, info: dict[str, Any], num_classes: int) -> list[str] | None:
    """The name of each class index: recorded in the checkpoint, else read from the training data's
    source; None (with a warning) when neither gives ``num_classes`` names."""
    names = info.get("plan", {}).get("class_names") or _source_class_names(data)
    if names is not None and len(names) != num_classes:
        log.warning("the training data has %d class names, the model %d classes", len(names), num_classes)
        return None
    return None if names is None else list(names)


@dataclasses.dataclass(frozen=True)
class TrainedModel:
    """A checkpoint's model in eval mode on its device, with the plan of its inputs and its class names."""

    model: nn.Module
    plan: Plan
    class_names: list[str]
    normalize: Normalize
    """uint8 batch -> the model's input, with the run's mean and std."""


def load_trained_model(
    checkpoint: Path, weights: str = "live", yaml_files: Sequence[Path] = (), overrides: Sequence[str] = ()
) -> TrainedModel:
    """The model of ``checkpoint`` (file, sharded folder, or run folder: its best checkpoint, else its newest;
    ``weights``: live or ema) built as its saved config says (``yaml_files`` and ``overrides`` applied), ready
    to classify."""
    from vitrain.train import build_model_for

    state, info = read_checkpoint_model(resolve_checkpoint_argument(checkpoint), weights)
    config = checkpoint_config(info.get("config", {}), yaml_files, overrides, info.get("plan"))
    plan = checkpoint_plan(config, info, state)
    model = build_model_for(plan)
    model.load_state_dict(state)
    model.eval()
    names = known_class_names(config.data, info, plan.model.num_classes)
    if names is None:
        log.warning("naming the classes class_0 .. class_%d", plan.model.num_classes - 1)
        names = [f"class_{index}" for index in range(plan.model.num_classes)]
    return TrainedModel(model, plan, names, Normalize(plan.data.mean, plan.data.std, plan.device))


# --- images ---------------------------------------------------------------------------------------


def collect_image_paths(paths: Sequence[Path]) -> list[Path]:
    """The files to classify: each file as given (whatever its name), and every file under each folder
    (recursively, sorted) whose extension the image-folder source reads; each once."""
    collected: list[Path] = []
    for path in map(Path, paths):
        if path.is_file():
            collected.append(path)
        elif path.is_dir():
            found = (item for item in path.rglob("*") if item.suffix.lower() in IMAGE_EXTENSIONS and item.is_file())
            collected.extend(sorted(found))
        else:
            raise ConfigError(f"{path} does not exist; give image files or folders of images")
    return list(dict.fromkeys(collected))


def input_transform(trained: TrainedModel) -> v2.Compose:
    """Decoded RGB PIL image -> the uint8 tensor the model's evaluation sees (one channel: luminance)."""
    evaluation = build_eval_transform(trained.plan.data.source)
    if trained.plan.model.in_chans == 1:
        return v2.Compose([v2.Grayscale(num_output_channels=1), evaluation])
    return evaluation


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One file's result: its top classes best first with their probabilities, or why it was not read."""

    path: str
    classes: tuple[int, ...] = ()
    probabilities: tuple[float, ...] = ()
    error: str | None = None
    """A :data:`~vitrain.data.decode.BAD_REASONS` code; None when classified."""
    detail: str = ""


@torch.inference_mode()
def classify(trained: TrainedModel, images: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, class indices) of the ``topk`` most likely classes of a uint8 batch, best first:
    the softmax of the logits of the model's forward, run as evaluation runs it."""
    plan = trained.plan
    inputs = trained.normalize(images.to(plan.device))
    with plan.precision.autocast_context():
        logits = trained.model(inputs)
    return logits.float().softmax(dim=1).topk(min(topk, logits.shape[1]), dim=1)


def predict_files(
    trained: TrainedModel, paths: Sequence[Path], batch_size: int = 64, topk: int = 5, num_workers: int = 0
) -> Iterator[Prediction]:
    """A :class:`Prediction` per file, in order; files are decoded ``batch_size`` at a time by
    ``num_workers`` processes (0: this one), as the evaluation loader decodes them."""
    source = trained.plan.data.source
    dataset = ImageFileDataset(
        [(str(path), index) for index, path in enumerate(paths)],
        input_transform(trained),
        draft_size(source, source.image_size, train=False),
        source.max_image_pixels,
        replace_bad=False,
    )
    num_batches = -(-len(paths) // batch_size)
    workers = min(num_workers, num_batches) if num_batches > 1 else 0
    keys = [(index, 0) for index in range(len(paths))]
    loader = DataLoader(dataset, batch_size, sampler=keys, collate_fn=collate_decoded, num_workers=workers)
    for images, indices, events, _ in loader:
        results = {
            index: Prediction(str(paths[index]), error=reason, detail=detail) for index, reason, detail in events
        }
        if images is not None:
            probabilities, classes = classify(trained, images, topk)
            for index, top, chances in zip(indices.tolist(), classes.tolist(), probabilities.tolist(), strict=True):
                results[index] = Prediction(str(paths[index]), tuple(top), tuple(chances))
        yield from (results[index] for index in sorted(results))


# --- output ---------------------------------------------------------------------------------------

CSV_HEADER = ("path", "rank", "class", "index", "prob")


def prediction_record(prediction: Prediction, names: Sequence[str]) -> dict[str, Any]:
    """``{"path", "top": [{"class", "index", "prob"}, ...]}``, or ``{"path", "error", "detail"}``."""
    if prediction.error is not None:
        return {"path": prediction.path, "error": prediction.error, "detail": prediction.detail}
    top = [
        {"class": names[index], "index": index, "prob": round(probability, 6)}
        for index, probability in zip(prediction.classes, prediction.probabilities, strict=True)
    ]
    return {"path": prediction.path, "top": top}


def _csv_line(row: Sequence[Any]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="").writerow(row)
    return buffer.getvalue()


def _cell_width(names: Sequence[str], topk: int) -> int:
    """A table column: the longest class name and `` (0.123)``, or the header ``top-N (prob)``."""
    return max(max(len(name) for name in names) + 8, len(f"top-{topk} (prob)"))


def header_lines(style: OutputStyle, names: Sequence[str], path_width: int, topk: int) -> list[str]:
    """What goes before the first prediction: the CSV header, the table's column names, nothing for JSON."""
    if style == "csv":
        return [_csv_line(CSV_HEADER)]
    if style == "table":
        width = _cell_width(names, topk)
        ranks = "  ".join(f"{f'top-{rank} (prob)':<{width}}" for rank in range(1, topk + 1))
        return [f"{'path':<{path_width}}  {ranks}".rstrip()]
    return []


def prediction_lines(prediction: Prediction, names: Sequence[str], style: OutputStyle, path_width: int) -> list[str]:
    """One prediction's output lines: a table row, a JSON line (errors included), or one CSV row per rank;
    a file that was not classified has no table or CSV line (it is reported on stderr)."""
    if style == "json":
        return [json.dumps(prediction_record(prediction, names))]
    if prediction.error is not None:
        return []
    ranked = list(enumerate(zip(prediction.classes, prediction.probabilities, strict=True), start=1))
    if style == "csv":
        return [_csv_line((prediction.path, rank, names[index], index, f"{p:.6f}")) for rank, (index, p) in ranked]
    width = _cell_width(names, len(ranked))
    cells = "  ".join(f"{f'{names[index]} ({probability:.3f})':<{width}}" for _, (index, probability) in ranked)
    return [f"{prediction.path:<{path_width}}  {cells}".rstrip()]


def error_line(prediction: Prediction) -> str:
    """The stderr report of a file that was not classified."""
    return f"vitrain: {prediction.path}: not classified: {prediction.error} ({prediction.detail})"


__all__ = [
    "FASHION_MNIST_CLASSES",
    "Prediction",
    "TrainedModel",
    "checkpoint_config",
    "checkpoint_plan",
    "known_class_names",
    "classify",
    "collect_image_paths",
    "error_line",
    "header_lines",
    "load_trained_model",
    "predict_files",
    "prediction_lines",
    "prediction_record",
]
