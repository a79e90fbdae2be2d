"""data.backend=dali on the CPU: DALI's pipelines against the Pillow path on the same images (order, classes,
pixel statistics), the rank split, resume, bad files and shards, training end to end, and bad input."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import make_config
from vitrain.cli import main
from vitrain.config import ConfigError, World
from vitrain.data import build_loaders
from vitrain.data.dali import DaliFileLoader, DaliShardLoader, require_dali
from vitrain.data.loader import FileLoader
from vitrain.data.shards import ShardLoader, shard_folder
from vitrain.train import make_plan

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed (pip install 'vitrain[dali]')")

CLASSES = ("ant", "bee", "cow")
PER_CLASS = {"train": 8, "val": 3}


def _smooth(seed: int, height: int, width: int) -> Image.Image:
    """A smooth colour image (a random low-frequency field): resize filters agree on it within a few levels."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 255, (4, 5, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.BICUBIC)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dali_images")
    for split, count in PER_CLASS.items():
        for class_index, name in enumerate(CLASSES):
            (root / split / name).mkdir(parents=True)
            for index in range(count):
                seed = 100 * class_index + index + (0 if split == "train" else 50)
                _smooth(seed, 40 + 3 * index, 52 - 2 * index).save(root / split / name / f"{index}.jpg", quality=95)
    return root


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dali_shards")
    shard_folder(folder, out, shard_bytes=3000, workers=0)
    return out


def _overrides(root, *extra: str, backend: str = "dali") -> list[str]:
    return [
        "data.name=imagefolder",
        f"data.root={root}",
        f"data.backend={backend}",
        "data.image_size=14",
        "data.num_workers=1",
        "data.scale=[0.5, 1.0]",
        "model.name=vit_tiny6_patch7",
        "precision=fp32",
        "train.batch_size=6",
        "train.progress=off",
        *extra,
    ]


def _loaders(root, *extra: str, backend: str = "dali", world: World | None = None):
    plan = make_plan(make_config(*_overrides(root, *extra, backend=backend)), world or World())
    return build_loaders(plan.data)


def test_evaluation_matches_the_pillow_path_in_order_classes_and_pixels(folder):
    dali_eval = _loaders(folder)[1]
    pillow_eval = _loaders(folder, backend="pillow")[1]
    assert isinstance(dali_eval, DaliFileLoader) and isinstance(pillow_eval, FileLoader)
    ours, theirs = list(dali_eval), list(pillow_eval)
    assert len(ours) == len(dali_eval) == len(theirs)
    assert torch.equal(torch.cat([labels for _, labels in ours]), torch.cat([labels for _, labels in theirs]))
    images, reference = torch.cat([i for i, _ in ours]).float(), torch.cat([i for i, _ in theirs]).float()
    assert images.shape == reference.shape == (9, 3, 14, 14) and images.dtype == torch.float32
    # the same centre crop of each image, resized by two antialiased filters that round the long side and the
    # crop offset differently (a pixel apart at most): each image's colour statistics agree
    assert torch.allclose(images.mean((2, 3)), reference.mean((2, 3)), atol=6.0)
    assert torch.allclose(images.std((2, 3)), reference.std((2, 3)), atol=6.0)
    assert not torch.allclose(images.mean((2, 3)), reference.flip(0).mean((2, 3)), atol=6.0)  # images do differ


def test_training_keeps_vitrains_sample_order_and_pixel_statistics(folder):
    dali_train = _loaders(folder)[0]
    pillow_train = _loaders(folder, backend="pillow")[0]
    for loader in (dali_train, pillow_train):
        loader.start_epoch(2)
    ours, theirs = list(dali_train), list(pillow_train)
    assert len(ours) == len(dali_train) == len(theirs) == 24 // 6
    for (images, labels), (_, reference_labels) in zip(ours, theirs, strict=True):
        assert images.dtype == torch.uint8 and images.shape == (6, 3, 14, 14)
        assert torch.equal(labels, reference_labels)  # the same images in the same order: the class statistics
    stack, reference = torch.cat([i for i, _ in ours]).float(), torch.cat([i for i, _ in theirs]).float()
    # different random crops of the same images: per-channel means and stds close
    assert torch.allclose(stack.mean((0, 2, 3)), reference.mean((0, 2, 3)), atol=6.0)
    assert torch.allclose(stack.std((0, 2, 3)), reference.std((0, 2, 3)), atol=6.0)


def test_two_ranks_take_the_halves_of_each_global_batch_and_a_resumed_epoch_its_rest(folder):
    whole = _loaders(folder)[0]
    whole.start_epoch(1)
    labels = [batch[1] for batch in whole]
    halves = []
    for rank in range(2):
        loader = _loaders(folder, world=World(rank=rank, size=2))[0]
        loader.start_epoch(1)
        halves.append([batch[1] for batch in loader])
        assert all(len(part) == 3 for part in halves[-1])
    joined = [torch.cat(pair) for pair in zip(*halves, strict=True)]
    assert all(torch.equal(a, b) for a, b in zip(joined, labels, strict=True))
    whole.start_epoch(1, 2 * 6)  # resumed after two batches
    rest = [batch[1] for batch in whole]
    assert len(rest) == len(labels) - 2 and all(torch.equal(a, b) for a, b in zip(rest, labels[2:], strict=True))


def test_batches_stay_valid_after_the_pipeline_runs_on(folder):
    loader = _loaders(folder)[0]
    batches = iter(loader)
    first, _ = next(batches)
    kept = first.clone()
    rest = list(batches)
    assert rest and torch.equal(first, kept)  # DLPack-shared outputs are not overwritten by later batches


def test_a_broken_file_is_replaced_in_training_and_left_out_of_evaluation(folder, tmp_path):
    root = tmp_path / "copy"
    for path in folder.rglob("*.jpg"):
        target = root / path.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    broken = root / "train" / "bee" / "3.jpg"
    broken.write_bytes(broken.read_bytes()[:200])
    (root / "val" / "cow" / "0.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 40)
    train, evaluation = _loaders(root, "data.max_bad_fraction=0.5")
    batches = list(train)
    assert len(batches) == len(train) == 4 and all(len(labels) == 6 for _, labels in batches)
    assert list(train.bad_images.bad) == [str(broken)]
    labels = torch.cat([labels for _, labels in evaluation])
    assert len(labels) == 8 and list(evaluation.bad_images.counts().values()) == [1]
    strict = _loaders(root, "data.max_bad_fraction=0")[0]
    with pytest.raises(ConfigError, match="cannot be decoded"):
        list(strict)


def test_shards_train_and_evaluate_through_dalis_webdataset_reader(shards, tmp_path):
    overrides = ["data.name=webdataset", f"data.root={shards}", "data.wds_shuffle_buffer=4"]
    train, evaluation = _loaders(shards, *overrides)
    assert isinstance(train, DaliShardLoader)
    batches = list(train)
    assert len(batches) == len(train) == 4 and all(images.shape == (6, 3, 14, 14) for images, _ in batches)
    assert sorted(torch.cat([labels for _, labels in batches]).tolist()) == sorted([0, 1, 2] * 8)
    evaluated = torch.cat([labels for _, labels in evaluation])
    assert sorted(evaluated.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    pillow = ShardLoader(train.source, train.data, train=False)
    assert sorted(torch.cat([labels for _, labels in pillow]).tolist()) == sorted(evaluated.tolist())
    per_rank = [
        torch.cat([labels for _, labels in _loaders(shards, *overrides, world=World(rank=rank, size=2))[1]])
        for rank in range(2)
    ]
    assert sorted(torch.cat(per_rank).tolist()) == sorted(evaluated.tolist())  # each sample evaluated once
    assert train.read_counts[1] == 24 and train.read_counts[0] > 24 * 100  # the image entries' bytes


def test_two_ranks_train_on_disjoint_halves_of_the_shards(tmp_path):
    """Each image one flat grey level, so a crop of it still names it: across two ranks every sample once."""
    for split, count in (("train", 12), ("val", 2)):
        for class_index, name in enumerate(("a", "b")):
            (tmp_path / "images" / split / name).mkdir(parents=True)
            for index in range(count):
                level = 8 * (index * 2 + class_index) + 20
                image = Image.new("RGB", (20, 24), (level, level, level))
                image.save(tmp_path / "images" / split / name / f"{index}.jpg", quality=100)
    shard_folder(tmp_path / "images", tmp_path / "shards", shard_bytes=1500, workers=0)
    overrides = ["data.name=webdataset", "data.wds_shuffle_buffer=3", "data.scale=[0.2, 1.0]"]
    taken = []
    for rank in range(2):
        loader = _loaders(tmp_path / "shards", *overrides, world=World(rank=rank, size=2))[0]
        loader.start_epoch(1)
        taken.append([int(images[i].float().mean().round()) for images, _ in loader for i in range(len(images))])
    assert len(taken[0]) == len(taken[1]) == 12  # 24 // 6 global batches of 3 images per rank
    assert not set(taken[0]) & set(taken[1])
    assert len(set(taken[0]) | set(taken[1])) == 24


@pytest.mark.parametrize("source", ["imagefolder", "webdataset"])
def test_training_end_to_end_with_erasing_and_translation(folder, shards, tmp_path, one_thread, source):
    root = shards if source == "webdataset" else folder
    out_dir = tmp_path / "run"
    extra = [f"data.name={source}", "data.random_erase=0.5", "data.translate=2", "train.epochs=2"]
    argv = ["train", *[i for o in _overrides(root, *extra, f"train.out_dir={out_dir}") for i in ("--set", o)]]
    assert main(argv) == 0
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["images_seen"] == 2 * 4 * 6 and summary["mean_files_s"] > 0 and summary["mean_read_mb_s"] > 0
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["num_samples"] for record in records if record["event"] == "eval"][-1] == 9


def test_a_sample_dali_cannot_read_stops_with_the_shards_and_a_fix(tmp_path):
    import tarfile

    shard = tmp_path / "train-000000.tar"
    with tarfile.open(shard, "w") as tar:
        for index, payload in enumerate([b"\xff\xd8\xff\xe0" + b"\x00" * 64] * 6):
            for suffix, data in ((".jpg", payload), (".cls", str(index % 2).encode())):
                info = tarfile.TarInfo(f"{index:06d}{suffix}")
                info.size = len(data)
                tar.addfile(info, __import__("io").BytesIO(data))
    pattern = f"{tmp_path}/train-{{000000..000000}}.tar"
    overrides = ["data.name=webdataset", f"data.wds_eval_shards={pattern}"]
    train = _loaders(pattern, *overrides)[0]
    with pytest.raises(ConfigError, match=r"train-000000\.tar.*vitrain shard.*data\.backend=pillow"):
        list(train)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["data.name=fashion-mnist", "data.root=null"], "data.name=fashion-mnist is decoded in memory"),
        (["data.randaugment=rand-m9-mstd0.5-inc1"], "data.randaugment needs the Pillow path"),
        (["data.three_augment=true", "data.color_jitter=0.3"], "data.three_augment, data.color_jitter needs"),
    ],
)
def test_what_dali_does_not_do_is_refused_before_work(folder, extra, message, capsys):
    argv = ["train", *[i for o in _overrides(folder, *extra) for i in ("--set", o)]]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_shards_dali_cannot_read_are_refused(shards):
    last = len(list(shards.glob("train-*.tar"))) - 1
    piped = [f"data.wds_eval_shards={shards}/val-{{000000..000000}}.tar", "data.name=webdataset"]
    with pytest.raises(ConfigError, match="pipe:/URL shards and JSON label fields need data.backend=pillow"):
        make_plan(make_config(*_overrides(f"pipe:cat {shards}/train-{{000000..{last:06d}}}.tar", *piped)))
    with pytest.raises(ConfigError, match="data.wds_label_key=cls"):
        make_plan(make_config(*_overrides(shards, "data.name=webdataset", "data.wds_label_key=json:label")))


def test_without_dali_the_backend_names_the_extra(folder, monkeypatch):
    real_import = builtins.__import__

    def no_dali(name, *args, **kwargs):
        if name.startswith("nvidia.dali"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_dali)
    with pytest.raises(ConfigError, match=r"pip install 'vitrain\[dali\]'.*data\.backend=pillow"):
        require_dali()
    with pytest.raises(ConfigError, match="vitrain\\[dali\\]"):
        _loaders(folder)
