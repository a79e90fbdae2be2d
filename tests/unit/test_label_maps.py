"""Token-labeling label maps: the teacher as a dense labeler, the sharded store (write, read, resume,
validation), the toolbox's published per-image files, and `vitrain label` (one process and torchrun)."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.conftest import make_config
from vitrain.cli import main
from vitrain.config import ConfigError
from vitrain.data.transforms import batch_eval_resize
from vitrain.models import build_model
from vitrain.models.volo import VOLOArgs
from vitrain.token_labeling import label as labeling
from vitrain.token_labeling.label import LabelSettings, dense_logits, label_training_set, top_k_maps
from vitrain.token_labeling.maps import (
    DatasetFingerprint,
    LabelMaps,
    LabelMapWriter,
    MapLayout,
    PublishedLabelMaps,
    in_memory_sample_keys,
    open_label_maps,
    published_map_name,
)
from vitrain.train import make_plan
from vitrain.weights.teacher import TeacherError


def _images(count=2, size=14, seed=0):
    return torch.randn(count, 3, size, size, generator=torch.Generator().manual_seed(seed))


# --- dense logits -------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{"head": "cls"}, {"head": "gap"}, {"head": "cls", "distill_token": True}])
def test_vit_dense_logits_are_the_head_on_each_patch_token(options):
    torch.manual_seed(0)
    teacher = build_model("vit_tiny6_patch7", img_size=21, num_classes=10, **options).eval()
    images = _images(size=21)
    with torch.no_grad():
        dense = dense_logits(teacher, images)
        tokens = teacher.forward_features(images)
        prefix = teacher.num_prefix_tokens
        assert dense.shape == (2, 10, 3, 3)
        for row in range(3):
            for column in range(3):
                token = teacher.fc_norm(tokens[:, prefix + row * 3 + column])
                expected = teacher.head(token)
                if teacher.head_dist is not None:
                    expected = (expected + teacher.head_dist(token)) / 2
                assert torch.allclose(dense[:, :, row, column], expected, atol=1e-5)


def _tiny_volo(aux: bool) -> nn.Module:
    from vitrain.models.volo import VOLO

    args = VOLOArgs(
        layers=(1, 1, 1, 1),
        embed_dims=(16, 32, 32, 32),
        num_heads=(2, 4, 4, 4),
        stem_hidden_dim=8,
        img_size=32,
        num_classes=7,
        use_aux_head=aux,
    )
    torch.manual_seed(0)
    return VOLO(args).eval()


@pytest.mark.parametrize("head", ["cls", "gap"])
def test_vit_dense_logits_of_a_teacher_with_an_aux_head_are_that_head(head):
    torch.manual_seed(0)
    teacher = build_model("vit_tiny6_patch7", img_size=21, num_classes=10, head=head, aux_head=True).eval()
    images = _images(size=21)
    with torch.no_grad():
        dense = dense_logits(teacher, images)
        patches = teacher.forward_features(images)[:, teacher.num_prefix_tokens :]
        by_hand = torch.stack([teacher.aux_head(teacher.fc_norm(patches[:, i])) for i in range(9)], dim=-1)
        assert dense.shape == (2, 10, 3, 3)
        assert torch.allclose(dense.flatten(2), by_hand, atol=1e-5)
        assert not torch.allclose(dense.flatten(2), teacher.head(teacher.fc_norm(patches)).transpose(1, 2), atol=1e-3)


@pytest.mark.parametrize("aux", [True, False])
def test_volo_dense_logits_are_the_aux_head_else_the_head_on_patch_tokens(aux):
    teacher = _tiny_volo(aux)
    images = _images(size=32)
    with torch.no_grad():
        dense = dense_logits(teacher, images)
        patches = teacher.forward_features(images)[:, 1:]
        side = 32 // teacher.args.total_stride
        assert dense.shape == (2, 7, side, side)
        head = teacher.aux_head if aux else teacher.head
        by_hand = torch.stack([head(patches[:, position]) for position in range(side * side)], dim=-1)
        assert torch.allclose(dense.flatten(2), by_hand, atol=1e-5)


def test_cnn_dense_logits_are_the_classifier_as_a_1x1_convolution():
    torch.manual_seed(0)
    teacher = build_model("resnet50", depth=18, num_classes=5, img_size=64).eval()
    images = _images(size=64)
    with torch.no_grad():
        dense = dense_logits(teacher, images)
        features = teacher.forward_features(images)
        assert dense.shape == (2, 5, 2, 2)
        for row in range(2):
            for column in range(2):
                by_hand = features[:, :, row, column] @ teacher.fc.weight.T + teacher.fc.bias
                assert torch.allclose(dense[:, :, row, column], by_hand, atol=1e-4)
        # the classifier is linear, so its mean over positions is the pooled model's logits
        assert torch.allclose(dense.mean(dim=(2, 3)), teacher(images), atol=1e-4)


def test_timm_teachers_label_with_their_head_norm_and_patch_tokens():
    timm = pytest.importorskip("timm", reason="timm is a test dependency ([dev] extra)")
    torch.manual_seed(0)
    convnext = timm.create_model("convnext_atto", pretrained=False, num_classes=4).eval()
    images = _images(size=64)
    with torch.no_grad():
        dense, features = dense_logits(convnext, images), convnext.forward_features(images)
        norm, fc = convnext.head.norm, convnext.head.fc
        at_one = F.layer_norm(features[:, :, 1, 0], (features.shape[1],), norm.weight, norm.bias, norm.eps)
        assert dense.shape == (2, 4, 2, 2) and torch.allclose(dense[:, :, 1, 0], fc(at_one), atol=1e-4)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4, img_size=32).eval()
    with torch.no_grad():
        dense, tokens = dense_logits(vit, images[:, :, :32, :32]), vit.forward_features(images[:, :, :32, :32])
        assert dense.shape == (2, 4, 2, 2)
        assert torch.allclose(dense[:, :, 0, 1], vit.head(tokens[:, vit.num_prefix_tokens + 1]), atol=1e-5)


def test_an_unsupported_teacher_is_a_clear_error_naming_its_type():
    class Blob(nn.Module):
        def forward(self, images):
            return images.mean(dim=(1, 2, 3))

    with pytest.raises(TeacherError, match="Blob cannot label tokens"):
        dense_logits(Blob(), _images())


def test_top_k_keeps_the_largest_logits_in_order_as_float16_and_int16():
    logits = torch.randn(2, 12, 3, 3)
    scores, indices = top_k_maps(logits, 4)
    assert scores.dtype == torch.float16 and indices.dtype == torch.int16 and scores.shape == (2, 4, 3, 3)
    assert torch.equal(logits.gather(1, indices.long()).half(), scores)
    assert (scores[:, :-1] >= scores[:, 1:]).all() and torch.equal(indices[:, 0].long(), logits.argmax(dim=1))


# --- the sharded store ------------------------------------------------------------------------------

KEYS = in_memory_sample_keys("synthetic", 25)
LAYOUT = MapLayout(count=25, num_classes=10, k=3, height=2, width=2, samples_per_shard=10)


def _random_maps(count=25, seed=0):
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(count, 3, 2, 2)).astype(np.float16)
    indices = rng.integers(0, 10, size=(count, 3, 2, 2)).astype(np.int16)
    return scores, indices


def _write_store(path: Path, missing=(), keys=KEYS, layout=LAYOUT) -> tuple[np.ndarray, np.ndarray]:
    scores, indices = _random_maps(layout.count)
    header = {"fingerprint": vars(DatasetFingerprint.of_keys(keys))}
    writer = LabelMapWriter(path, layout, header)
    writer.write_header()
    for shard in range(layout.num_shards):
        rows = layout.shard_range(shard)
        writer.write_shard(shard, scores[rows.start : rows.stop], indices[rows.start : rows.stop], [])
    writer.write_index()
    return scores, indices


def test_write_then_read_returns_the_maps_in_the_order_asked(tmp_path):
    scores, indices = _write_store(tmp_path / "maps")
    maps = LabelMaps(tmp_path / "maps")
    order = [24, 3, 10, 3, 0, 19]  # across all three shards, one twice, unsorted
    read = maps.read(torch.tensor(order))
    assert len(maps) == 25 and read.dtype == torch.float32 and read.shape == (6, 2, 3, 2, 2)
    assert torch.equal(read[:, 0], torch.from_numpy(scores[order]).float())
    assert torch.equal(read[:, 1], torch.from_numpy(indices[order]).float())
    assert sorted(path.name for path in (tmp_path / "maps").iterdir()) == [
        "index.json",
        "shard-00000",
        "shard-00001",
        "shard-00002",
    ]
    maps.check(num_classes=10, fingerprint=DatasetFingerprint.of_keys(KEYS))


class _MapsDataset(Dataset):
    def __init__(self, maps):
        self.maps = maps

    def __len__(self):
        return len(self.maps)

    def __getitem__(self, index):
        return self.maps.read([index])[0]


def test_reading_from_two_dataloader_workers_gives_the_same_maps(tmp_path):
    _write_store(tmp_path / "maps")
    maps = LabelMaps(tmp_path / "maps")
    direct = maps.read(range(25))  # opens the maps here first: the workers must open their own
    assert maps._arrays and not pickle.loads(pickle.dumps(maps))._arrays
    loader = DataLoader(_MapsDataset(maps), batch_size=4, num_workers=2, multiprocessing_context="fork")
    assert torch.equal(torch.cat(list(loader)), direct)


def test_bad_folders_are_config_errors_naming_the_file(tmp_path):
    _write_store(tmp_path / "maps")
    with pytest.raises(ConfigError, match="10 classes but the run has 1000"):
        open_label_maps(tmp_path / "maps", KEYS, num_classes=1000)
    with pytest.raises(ConfigError, match="label maps were made for 25 images, the training data has 24"):
        open_label_maps(tmp_path / "maps", KEYS[:24], num_classes=10)
    with pytest.raises(ConfigError, match="index.json: label maps were made for other training images"):
        open_label_maps(tmp_path / "maps", list(reversed(KEYS)), num_classes=10)
    assert isinstance(open_label_maps(tmp_path / "maps", KEYS, num_classes=10), LabelMaps)
    (tmp_path / "maps" / "shard-00001" / "indices.npy").unlink()
    with pytest.raises(ConfigError, match=r"shard-00001/indices.npy is missing"):
        LabelMaps(tmp_path / "maps").check()
    with pytest.raises(ConfigError, match=r"shard-00001/indices.npy is missing"):
        LabelMaps(tmp_path / "maps").read([12])
    index = json.loads((tmp_path / "maps" / "index.json").read_text())
    (tmp_path / "maps" / "index.json").write_text(json.dumps({**index, "complete": False}))
    with pytest.raises(ConfigError, match="index.json: the label maps are incomplete"):
        LabelMaps(tmp_path / "maps")
    with pytest.raises(ConfigError, match="does not exist; make label maps"):
        LabelMaps(tmp_path / "elsewhere")


def test_check_finds_out_of_range_indices_and_non_finite_scores(tmp_path):
    _write_store(tmp_path / "maps")
    shard = tmp_path / "maps" / "shard-00002"
    indices = np.load(shard / "indices.npy")
    indices[0, 0, 0, 0] = 10
    np.save(shard / "indices.npy", indices)
    with pytest.raises(ConfigError, match=r"shard-00002/indices.npy: class indices 0..10 outside \[0, 10\)"):
        LabelMaps(tmp_path / "maps").check()
    indices[0, 0, 0, 0] = 1
    np.save(shard / "indices.npy", indices)
    scores = np.load(shard / "scores.npy")
    scores[1, 0, 0, 0] = np.inf
    np.save(shard / "scores.npy", scores)
    with pytest.raises(ConfigError, match=r"shard-00002/scores.npy: non-finite"):
        LabelMaps(tmp_path / "maps").check()


def test_a_folder_of_other_maps_is_refused_before_writing(tmp_path):
    _write_store(tmp_path / "maps")
    other = MapLayout(count=25, num_classes=10, k=5, height=2, width=2, samples_per_shard=10)
    with pytest.raises(ConfigError, match=r"made differently \(k 3 -> 5\)"):
        LabelMapWriter(tmp_path / "maps", other, {"fingerprint": vars(DatasetFingerprint.of_keys(KEYS))})


# --- the published per-image layout -------------------------------------------------------------------


def test_published_maps_are_read_by_the_image_folders_relative_paths(tmp_path):
    keys = ["n01/n01_7.JPEG", "n01/n01_10.JPEG", "n02/n02_3.png"]
    assert published_map_name(keys[0]) == "n01/n01_7.pt"
    maps = {}
    for number, key in enumerate(keys):
        value = torch.stack([torch.randn(5, 3, 3), torch.randint(0, 4, (5, 3, 3)).float()]).half()
        path = tmp_path / published_map_name(key)
        path.parent.mkdir(exist_ok=True)
        torch.save(value, path)
        maps[number] = value
    opened = open_label_maps(tmp_path, keys, num_classes=4)
    assert isinstance(opened, PublishedLabelMaps) and len(opened) == 3
    read = opened.read([2, 0])
    assert read.dtype == torch.float32 and torch.equal(read, torch.stack([maps[2], maps[0]]).float())
    opened.check(num_classes=4)
    with pytest.raises(ConfigError, match=r"n01_7.pt: class indices .* outside \[0, 2\)"):
        open_label_maps(tmp_path, keys, num_classes=2)
    with pytest.raises(ConfigError, match=r"n03/n03_1.pt is missing"):
        open_label_maps(tmp_path, [*keys, "n03/n03_1.JPEG"], num_classes=4)
    (tmp_path / "n01" / "n01_10.pt").unlink()
    with pytest.raises(ConfigError, match=r"n01_10.pt is missing: the published label maps have no map"):
        opened.check(num_classes=4)


# --- generation -------------------------------------------------------------------------------------

SYNTHETIC = [
    "precision=fp32",
    "model.name=vit_tiny6_patch7",
    "data.name=synthetic",
    "data.image_size=14",
    "data.synthetic_num_train=40",
    "data.synthetic_num_eval=8",
    "data.synthetic_num_classes=10",
    "train.batch_size=8",
    "train.progress=off",
]


@pytest.fixture(scope="module")
def teacher_file(tmp_path_factory) -> Path:
    """A 14 px ViT teacher on 10 classes, exported as safetensors with vitrain metadata."""
    from safetensors.torch import save_file

    torch.manual_seed(3)
    teacher = build_model("vit_tiny6_patch7", img_size=14, num_classes=10)
    path = tmp_path_factory.mktemp("teacher") / "teacher.safetensors"
    metadata = {"format": "vitrain-model-v1", "config": json.dumps({"model": {"name": "vit_tiny6_patch7"}})}
    save_file(teacher.state_dict(), str(path), metadata=metadata)
    return path


def _label(teacher_file, out, **options):
    settings = LabelSettings(teacher=str(teacher_file), out=out, k=3, batch_size=6, shard_size=16, progress=False)
    return label_training_set(make_plan(make_config(*SYNTHETIC)), dataclasses.replace(settings, **options))


def _files(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*.npy"))}


def test_labeling_stores_the_teachers_top_k_of_each_image(teacher_file, tmp_path):
    report = _label(teacher_file, tmp_path / "maps")
    assert report["images"] == 40 and report["shards"] == 3 and report["missing"] == 0 and report["grid"] == [2, 2]
    maps = LabelMaps(tmp_path / "maps")
    plan = make_plan(make_config(*SYNTHETIC))
    teacher = labeling._load_labeling_teacher(plan, LabelSettings(teacher=str(teacher_file), out=tmp_path))
    images = labeling.TrainingImages(plan.data, 14).memory.images[[0, 17, 39]]
    images = batch_eval_resize(images, 14, plan.data.source.crop_pct)  # the evaluation transform
    normalize = labeling.Normalize(plan.data.mean, plan.data.std, "cpu")
    with torch.no_grad():
        scores, indices = top_k_maps(dense_logits(teacher, normalize(images)), 3)
    read = maps.read([0, 17, 39])
    assert torch.equal(read[:, 0], scores.float()) and torch.equal(read[:, 1], indices.float())
    assert report["bytes_per_image"] >= 3 * 2 * 2 * 4 and maps.index["teacher"]["source"] == str(teacher_file)


def test_an_interrupted_labeling_resumes_skipping_finished_shards(teacher_file, tmp_path, monkeypatch):
    _label(teacher_file, tmp_path / "straight")
    written = []
    original = LabelMapWriter.write_shard

    def write_then_fail(self, shard, *args):
        original(self, shard, *args)
        written.append(shard)
        if len(written) == 1:
            raise KeyboardInterrupt  # killed after the first shard

    monkeypatch.setattr(LabelMapWriter, "write_shard", write_then_fail)
    with pytest.raises(KeyboardInterrupt):
        _label(teacher_file, tmp_path / "resumed")
    with pytest.raises(ConfigError, match="incomplete"):
        LabelMaps(tmp_path / "resumed")
    (tmp_path / "resumed" / ".shard-00001.partial-99").mkdir()  # a shard a killed process left half written
    _label(teacher_file, tmp_path / "resumed")
    assert not list((tmp_path / "resumed").glob(".*partial*"))
    assert written == [0, 1, 2]  # shard 0 was not made again
    assert _files(tmp_path / "resumed") == _files(tmp_path / "straight")
    with pytest.raises(ConfigError, match=r"made differently \(k 3 -> 4\)"):
        _label(teacher_file, tmp_path / "resumed", k=4)


def _image_folder(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for name in ("cat", "dog", "fox"):
        (root / "train" / name).mkdir(parents=True)
        (root / "val" / name).mkdir(parents=True)
        for number in range(3):
            pixels = rng.integers(0, 255, size=(20 + number, 24, 3)).astype(np.uint8)
            Image.fromarray(pixels).save(root / "train" / name / f"{name}_{number}.JPEG")
        Image.fromarray(pixels).save(root / "val" / name / f"{name}_val.png")
    (root / "train" / "dog" / "dog_1.JPEG").write_bytes(b"not an image at all")
    return root


def test_vitrain_label_on_an_image_folder_records_bad_images_as_missing(tmp_path, capsys):
    from safetensors.torch import save_file

    root = _image_folder(tmp_path / "data")
    teacher = build_model("vit_tiny6_patch7", img_size=14, num_classes=3)
    metadata = {"format": "vitrain-model-v1", "config": json.dumps({"model": {"name": "vit_tiny6_patch7"}})}
    save_file(teacher.state_dict(), str(tmp_path / "teacher.safetensors"), metadata=metadata)
    argv = ["label", "--teacher", str(tmp_path / "teacher.safetensors"), "--out", str(tmp_path / "maps")]
    settings = ["data.name=imagefolder", f"data.root={root}", "data.max_bad_fraction=0.5", "data.num_workers=0"]
    common = [*SYNTHETIC[:2], "data.image_size=14", "train.batch_size=8", "train.progress=off"]
    overrides = [arg for setting in [*common, *settings] for arg in ("--set", setting)]
    assert main([*argv, "--topk", "2", "--shard-size", "4", "--batch", "3", *overrides]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["images"] == 9 and report["shards"] == 3 and report["missing"] == 1
    maps = LabelMaps(tmp_path / "maps")
    assert maps.index["missing"] == [4] and maps.read([4])[0, 1].eq(-1).all()  # dog_1, the fifth file
    keys = [f"{name}/{name}_{number}.JPEG" for name in ("cat", "dog", "fox") for number in range(3)]
    assert isinstance(open_label_maps(tmp_path / "maps", keys, num_classes=3), LabelMaps)
    assert main([*argv, "--topk", "0", *overrides]) == 2
    assert "--topk 0: must be >= 1" in capsys.readouterr().err
    assert main([*argv, "--topk", "4", *overrides]) == 2
    assert "has only 3 classes" in capsys.readouterr().err


def test_vitrain_label_under_torchrun_makes_the_maps_of_one_process(teacher_file, tmp_path, capsys):
    from tests.dist.test_ddp import torchrun

    argv = ["label", "--teacher", str(teacher_file), "--topk", "3", "--shard-size", "16", "--batch", "6"]
    overrides = [arg for setting in SYNTHETIC for arg in ("--set", setting)]
    assert main([*argv, "--out", str(tmp_path / "one"), *overrides]) == 0
    result = torchrun([*argv, "--out", str(tmp_path / "two"), *overrides], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["images"] == 40
    assert _files(tmp_path / "two") == _files(tmp_path / "one") and len(_files(tmp_path / "one")) == 6
    one, two = (json.loads((tmp_path / name / "index.json").read_text()) for name in ("one", "two"))
    assert one == two
