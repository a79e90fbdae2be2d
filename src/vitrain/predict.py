"""Classifying image files with a trained checkpoint (``vitrain predict``), without its training data.

The checkpoint's inference record and saved config rebuild the model and the evaluation input pipeline
(:mod:`vitrain.weights.inference`, no training plan): files decode as in
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
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from vitrain.config import ConfigError
from vitrain.data.loader import ImageFileDataset, collate_decoded, draft_size
from vitrain.data.sources import IMAGE_EXTENSIONS
from vitrain.data.transforms import build_eval_transform
from vitrain.weights.inference import TrainedModel, load_trained_model

log = logging.getLogger("vitrain")


OutputStyle = Literal["table", "json", "csv"]


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
    evaluation = build_eval_transform(trained.plan.data)
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
    source = trained.plan.data
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
    "Prediction",
    "TrainedModel",
    "classify",
    "collect_image_paths",
    "error_line",
    "header_lines",
    "load_trained_model",
    "predict_files",
    "prediction_lines",
    "prediction_record",
]
