"""data.decode=gpu: the workers send bytes and the training process decodes and transforms on the device. The
device here is the CPU (the same code, torchvision's CPU JPEG decoder); tests/gpu/test_cuda.py runs it on CUDA.
Checked against the Pillow path on the same images: the same seeded crop boxes and flips, so close pixels."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import make_config
from vitrain.config import ConfigError, DatasetInfo, Hardware, resolve
from vitrain.data import build_loaders
from vitrain.data.device_decode import DeviceDecoder, encoded_tensor
from vitrain.models import model_facts
from vitrain.train import make_plan

CLASSES = ("ant", "bee")


def _smooth(seed: int, height: int, width: int) -> Image.Image:
    coarse = np.random.default_rng(seed).integers(0, 255, (4, 5, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.BICUBIC)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Small smooth JPEGs (too small for Pillow's draft mode to shrink at 14 px) and one PNG per class."""
    root = tmp_path_factory.mktemp("device_decode")
    for split, count in (("train", 6), ("val", 3)):
        for class_index, name in enumerate(CLASSES):
            (root / split / name).mkdir(parents=True)
            for index in range(count):
                image = _smooth(10 * class_index + index + 100 * (split == "val"), 30 + index, 40 - index)
                suffix = ".png" if index == 2 else ".jpg"
                image.save(root / split / name / f"{index}{suffix}", quality=95)
    return root


def _loaders(root: Path, decode: str, *extra: str):
    """The loaders of a CPU plan, with data.decode set afterwards (resolve allows gpu only on CUDA runs)."""
    overrides = [
        "data.name=imagefolder",
        f"data.root={root}",
        "data.image_size=14",
        "data.num_workers=0",
        "model.name=vit_tiny6_patch7",
        "precision=fp32",
        "train.batch_size=4",
        *extra,
    ]
    plan = make_plan(make_config(*overrides))
    source = plan.data.source.model_copy(update={"decode": decode})
    return build_loaders(dataclasses.replace(plan.data, source=source))


@pytest.mark.parametrize("split", [0, 1], ids=["train", "eval"])
def test_device_decoding_gives_the_pillow_paths_crops_and_flips(folder, split):
    ours, theirs = _loaders(folder, "gpu")[split], _loaders(folder, "cpu")[split]
    ours.start_epoch(3)
    theirs.start_epoch(3)
    batches, reference = list(ours), list(theirs)
    assert len(batches) == len(reference) == len(ours) > 0
    for (images, labels), (expected, expected_labels) in zip(batches, reference, strict=True):
        assert images.dtype == torch.uint8 and images.shape == expected.shape
        assert torch.equal(labels, expected_labels)
        # the same box and flip of the same pixels; two antialiased bilinear resizes (PIL's, torch's)
        assert (images.float() - expected.float()).abs().mean() < 3.0
    assert ours.read_counts[1] == theirs.read_counts[1] > 0


def test_a_bad_jpeg_takes_a_neighbours_place_in_training_and_is_left_out_of_evaluation():
    good = [encoded_tensor(_jpeg(seed)) for seed in range(3)]
    broken = encoded_tensor(_jpeg(9)[:120])
    encoded, labels = [good[0], broken, good[1], good[2]], torch.tensor([0, 1, 2, 3])
    config = make_config("data.image_size=8").data
    train = DeviceDecoder(config, 8, train=True, device="cpu")
    images, kept, events = train(encoded, labels, [1, 2, 3, 4], ["a", "b", "c", "d"])
    assert images.shape == (4, 3, 8, 8) and kept.tolist() == [0, 2, 2, 3]  # slot 1 takes the next good image
    assert [name for name, _, _ in events] == ["b"] and events[0][1] in ("truncated", "corrupt")
    evaluation = DeviceDecoder(config, 8, train=False, device="cpu")
    images, kept, events = evaluation(encoded, labels, [0] * 4, ["a", "b", "c", "d"])
    assert images.shape == (3, 3, 8, 8) and kept.tolist() == [0, 2, 3] and len(events) == 1
    assert evaluation([broken], labels[:1], [0], ["b"])[:2] == (None, None)
    # refused before decoding: more pixels than data.max_image_pixels (from the header), a file that was not read
    strict = DeviceDecoder(make_config("data.max_image_pixels=400").data, 8, train=False, device="cpu")
    _, kept, events = strict([good[0], encoded_tensor(b"")], labels[:2], [0, 0], ["big", "gone"])
    assert kept is None  # nothing left to evaluate
    assert [(name, reason) for name, reason, _ in events] == [("big", "decompression_bomb"), ("gone", "empty")]


def _jpeg(seed: int) -> bytes:
    import io

    buffer = io.BytesIO()
    _smooth(seed, 20, 24).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def test_shards_decode_on_the_device_too(folder, tmp_path):
    pytest.importorskip("webdataset", reason="the webdataset extra is not installed")
    from vitrain.data.shards import shard_folder

    shard_folder(folder, tmp_path, shard_bytes=2000, workers=0)
    extra = ["data.name=webdataset", f"data.root={tmp_path}", "data.wds_shuffle_buffer=0"]
    for split in (0, 1):
        ours, theirs = _loaders(tmp_path, "gpu", *extra)[split], _loaders(tmp_path, "cpu", *extra)[split]
        batches, reference = list(ours), list(theirs)
        assert [labels.tolist() for _, labels in batches] == [labels.tolist() for _, labels in reference]
        for (images, _), (expected, _) in zip(batches, reference, strict=True):
            assert (images.float() - expected.float()).abs().mean() < 3.0


CUDA_HOST = Hardware(cuda_available=True, bf16_supported=True)
DATA = DatasetInfo(num_train=1000, num_eval=10, num_classes=2, channels=3, mean=(0.5,) * 3, std=(0.25,) * 3)


@pytest.mark.parametrize(
    ("extra", "hardware", "message"),
    [
        ([], Hardware(cuda_available=False, bf16_supported=True), "this run is on cpu: set data.decode=cpu"),
        (["data.name=synthetic", "data.root=null"], CUDA_HOST, "not data.name=synthetic"),
        (["data.randaugment=rand-m9-mstd0.5-inc1"], CUDA_HOST, "data.randaugment runs on PIL images"),
    ],
)
def test_gpu_decoding_is_refused_where_it_cannot_run(folder, extra, hardware, message):
    config = make_config("data.name=imagefolder", f"data.root={folder}", "data.decode=gpu", *extra)
    with pytest.raises(ConfigError, match=message):
        resolve(config, DATA, hardware, model_facts)
