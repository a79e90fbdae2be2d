"""ONNX export of a checkpoint's model (``vitrain export --format onnx``), checked with onnxruntime.

The file holds the plain model as the registry builds it from the checkpoint's saved config: fp32
weights, eval mode, no converter (no fused CPU kernels, no compile), and every attention core set to
SDPA, which the exporter writes as standard ONNX ops. It is exported by torch's dynamo exporter
(``torch.export`` + onnxscript) with one input ``images`` (N, C, H, W float32, normalized as the training
data; N free, named ``batch``) and one output ``logits`` (N, classes): what ``vitrain predict`` and
``vitrain eval`` take the softmax and top-1 of, so a token-labeling model's class logits plus 0.5 x the
auxiliary head's maximum, a distilled DeiT's mean of both heads. What a deployer needs to prepare images
is in the model's metadata (``metadata_props``, :func:`transform_metadata`).

After writing, onnxruntime (CPU) runs the file on random batches of 1 and 3 images and its logits are
compared with PyTorch's; a larger difference than :data:`MAX_ABS_DIFF` removes the file and raises.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitrain import torch_at_least
from vitrain.config import ConfigError
from vitrain.io import CheckpointError

ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
"""What the export needs besides torch: the ONNX format, torch's dynamo exporter's translator, the check."""
INSTALL_HINT = "pip install 'vitrain[onnx]'"
INPUT_NAME, OUTPUT_NAME, BATCH_DIM = "images", "logits", "batch"
METADATA_FORMAT = "vitrain-onnx-v1"
MAX_ABS_DIFF = 1e-4
"""Largest |onnxruntime - PyTorch| logit accepted (fp32 on both sides: only the order of sums differs)."""
CHECK_BATCHES = (1, 3)
"""Batch sizes the written file is checked at: one of them differs from the export's example (2)."""
FAKE_TENSOR_CACHE_MIN_TORCH = (2, 10)
"""The oldest torch whose ``torch.export`` may keep its fake-tensor dispatch cache with a free batch size:
on 2.8 and 2.9 a cached result whose shape is a product with the batch size (VOLO's outlook attention)
fails the export ("7776*s34 ... is not tracked with proxy")."""


class OnnxCheckError(CheckpointError):
    """The written ONNX file does not give the checkpoint's model's logits (it has been removed)."""


def require_onnx_packages() -> Any:
    """The onnxruntime module, after checking that every package of the ``onnx`` extra imports; a
    ConfigError naming the missing ones and the extra to install otherwise."""
    modules, missing = {}, []
    for name in ONNX_PACKAGES:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise ConfigError(f"--format onnx needs {', '.join(missing)}, which {verb} not installed: {INSTALL_HINT}")
    return modules["onnxruntime"]


def apply_standard_attention(model: nn.Module) -> nn.Module:
    """Set every attention core of ``model`` (``vitrain.models.layers.Attention``, VOLO's transformer
    stages included) to SDPA, whatever ``model.attn_impl`` chose for training; returns ``model``."""
    from vitrain.models.layers import Attention

    for module in model.modules():
        if isinstance(module, Attention):
            module.impl = "sdpa"
    return model


def transform_metadata(
    model_name: str,
    input_size: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    crop_pct: float,
    class_names: Sequence[str] | None,
) -> dict[str, str]:
    """The ONNX file's ``metadata_props``: how to turn an image into ``images`` (vitrain's evaluation
    transform: resize the short side bilinearly to ``floor(side / crop_pct)``, centre-crop ``side``, scale
    to [0, 1], subtract ``mean``, divide by ``std``) and the name of each output column. Values are strings
    (JSON for lists); ``class_names`` is left out when unknown."""
    from vitrain.data.transforms import eval_resize_size

    metadata = {
        "format": METADATA_FORMAT,
        "model": model_name,
        "input_size": json.dumps(list(input_size)),
        "resize": str(eval_resize_size(input_size[-1], crop_pct)),
        "crop_pct": str(crop_pct),
        "interpolation": "bilinear",
        "mean": json.dumps(list(mean)),
        "std": json.dumps(list(std)),
    }
    if class_names is not None:
        metadata["class_names"] = json.dumps(list(class_names))
    return metadata


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter's graph passes log every rewrite at INFO (hundreds of lines); keep their warnings only."""
    loggers = [logging.getLogger(name) for name in ("onnxscript", "onnx_ir", "torch.onnx")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def fake_tensor_cache_exports(version: str) -> bool:
    """Whether torch ``version``'s export works with the fake-tensor cache on (unreadable: assumed so)."""
    return torch_at_least(version, FAKE_TENSOR_CACHE_MIN_TORCH)


def _export_settings(version: str) -> contextlib.AbstractContextManager:
    """The export with the fake-tensor cache off where torch ``version`` needs it, as it is otherwise."""
    if fake_tensor_cache_exports(version):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(fake_tensor_cache_enabled=False)


def _write(model: nn.Module, out: Path, input_size: Sequence[int], metadata: dict[str, str]) -> int:
    """Export ``model`` (already plain, fp32, eval) to ``out`` with a free batch dimension; returns the opset."""
    example = torch.randn(2, *input_size, generator=torch.Generator().manual_seed(0))
    with _quiet_exporter(), _export_settings(torch.__version__):
        program = torch.onnx.export(
            model,
            (example,),
            dynamo=True,
            verbose=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            # min 2: torch.export may specialize a size of 1 (torch 2.9 does in VOLO's window copies); the
            # file is free in N all the same, and checked at batch 1 after writing
            dynamic_shapes=({0: torch.export.Dim(BATCH_DIM, min=2)},),
        )
    program.model.metadata_props.update(metadata)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        program.save(out)  # weights past 2 GB go to OUT.data beside it (ONNX external data)
    except OSError as error:
        raise CheckpointError(f"cannot write {out}: {error.strerror or error}; choose a writable path") from None
    return program.model.opset_imports[""]


def _tensor_description(argument: Any) -> dict[str, Any]:
    return {"name": argument.name, "shape": list(argument.shape), "type": argument.type}


def max_abs_difference(model: nn.Module, session: Any, input_size: Sequence[int]) -> float:
    """The largest |onnxruntime - PyTorch| logit over random batches of :data:`CHECK_BATCHES` images of
    ``input_size``; ``session`` is an ``onnxruntime.InferenceSession`` of ``model``'s export."""
    generator, worst = torch.Generator().manual_seed(1), 0.0
    for batch in CHECK_BATCHES:
        images = torch.randn(batch, *input_size, generator=generator)
        with torch.no_grad():
            expected = model(images)
        (logits,) = session.run([OUTPUT_NAME], {INPUT_NAME: images.numpy()})
        worst = max(worst, (torch.from_numpy(logits) - expected).abs().max().item())
    return worst


def export_onnx_model(model: nn.Module, out: Path, input_size: Sequence[int], metadata: dict[str, str]) -> dict:
    """Write ``model`` (a registered vitrain model; its attention is set to SDPA, weights to fp32, eval mode)
    as the ONNX file ``out`` for ``input_size`` (C, H, W) images with ``metadata``, and check it with
    onnxruntime. Returns ``opset``, ``inputs``, ``outputs`` (name, shape, type) and ``max_abs_diff``; an
    :class:`OnnxCheckError` when the difference is over :data:`MAX_ABS_DIFF`."""
    onnxruntime = require_onnx_packages()
    out = Path(out)
    model = apply_standard_attention(model).float().eval()
    opset = _write(model, out, input_size, metadata)
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    difference = max_abs_difference(model, session, input_size)
    if not difference <= MAX_ABS_DIFF:  # NaN included
        for path in (out, out.with_name(out.name + ".data")):
            path.unlink(missing_ok=True)
        raise OnnxCheckError(
            f"the ONNX export's logits differ from PyTorch's by {difference:.3g} (over {MAX_ABS_DIFF:g}) on random "
            f"inputs, so {out} was removed; export --format safetensors instead, and report this model"
        )
    return {
        "opset": opset,
        "inputs": [_tensor_description(argument) for argument in session.get_inputs()],
        "outputs": [_tensor_description(argument) for argument in session.get_outputs()],
        "max_abs_diff": difference,
    }


def export_onnx(checkpoint: Path, out: Path, weights: str = "live") -> dict[str, Any]:
    """Write a checkpoint's model (either format; ``weights``: ``live`` or ``ema``) as the ONNX file ``out``
    at the run's image size, with the evaluation transform and class names in its metadata, checked with
    onnxruntime (:func:`export_onnx_model`; its result, plus the model's name)."""
    from vitrain.weights.inference import exported_model

    require_onnx_packages()  # before reading the checkpoint: fail fast
    model, plan = exported_model(checkpoint, weights)
    input_size = (plan.model.in_chans, plan.model.image_size, plan.model.image_size)
    metadata = transform_metadata(
        plan.model.name, input_size, plan.mean, plan.std, plan.data.crop_pct, plan.class_names
    )
    metadata["weights"] = weights
    return {"model": plan.model.name, **export_onnx_model(model, out, input_size, metadata)}


__all__ = [
    "INSTALL_HINT",
    "MAX_ABS_DIFF",
    "OnnxCheckError",
    "apply_standard_attention",
    "export_onnx",
    "export_onnx_model",
    "max_abs_difference",
    "require_onnx_packages",
    "transform_metadata",
]
