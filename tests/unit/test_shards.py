"""WebDataset shards: `vitrain shard` (layout, index, resume) and data.name=webdataset (training, evaluation,
rank and worker split, exact resume within an epoch, bad input)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import assert_same_training_state, make_config
from vitrain.checkpoint import find_latest_checkpoint
from vitrain.checkpoint.sharded import read_checkpoint_model
from vitrain.cli import main
from vitrain.config import ConfigError, World
from vitrain.data import build_loaders, describe_source
from vitrain.data import shards as shards_module
from vitrain.data.loader import TooManyBadImages
from vitrain.data.shards import read_shard, shard_folder, worker_batches
from vitrain.train import make_plan

pytest.importorskip("webdataset", reason="the webdataset extra is not installed (pip install 'vitrain[webdataset]')")

CLASSES = ("cat", "dog")
PER_CLASS = {"train": 10, "val": 3}
NUM_TRAIN = 2 * PER_CLASS["train"] + 1  # and one grayscale PNG; the broken file is left out
NUM_VAL = 2 * PER_CLASS["val"]


def _noise(side: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (side, side + 3, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def image_root(tmp_path_factory) -> Path:
    """train/ and val/ of two classes: JPEGs and PNGs, a grayscale PNG (odd: kept) and a broken JPEG (left out)."""
    root = tmp_path_factory.mktemp("images")
    for split, count in PER_CLASS.items():
        for class_index, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for index in range(count):
                suffix = ".png" if index % 3 == 0 else ".JPEG"
                _noise(16 + index, 100 * class_index + index).save(folder / f"{name}_{index}{suffix}")
    _noise(20, 7).convert("L").save(root / "train" / "cat" / "gray.png")
    (root / "train" / "dog" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 40)
    return root


@pytest.fixture(scope="module")
def sharded(image_root, tmp_path_factory) -> Path:
    """The image root as small shards (several per split)."""
    out = tmp_path_factory.mktemp("shards")
    shard_folder(image_root, out, shard_bytes=4000, workers=0)
    return out


def _read_back(out: Path, prefix: str) -> list[tuple[str, dict]]:
    return [item for path in sorted(out.glob(f"{prefix}-*.tar")) for item in read_shard(str(path))]


@pytest.mark.parametrize("shard_bytes", [4000, 10**9])
def test_shards_hold_every_decodable_image_as_its_bytes_with_label_and_path(image_root, tmp_path, shard_bytes):
    index = shard_folder(image_root, tmp_path, shard_bytes=shard_bytes, workers=0)
    train, val = index["splits"]["train"], index["splits"]["val"]
    assert (train["samples"], val["samples"]) == (NUM_TRAIN, NUM_VAL)
    assert train["bad"] == {"unreadable": 1} and train["bad_files"][0][0] == "train/dog/broken.jpg"
    assert index["classes"] == list(CLASSES) and sorted(train["image_keys"]) == ["jpg", "png"]
    assert (len(train["shards"]) > 2) == (shard_bytes == 4000)
    assert index["total_bytes"] == sum(path.stat().st_size for path in tmp_path.glob("*.tar"))
    assert json.loads((tmp_path / "index.json").read_text()) == index
    for prefix, split in (("train", train), ("val", val)):
        samples = _read_back(tmp_path, prefix)
        assert [s["samples"] for s in split["shards"]] == [
            len(read_back) for read_back in (list(read_shard(str(tmp_path / s["name"]))) for s in split["shards"])
        ]
        assert len({sample["__key__"] for _, sample in samples}) == split["samples"]
        for _, sample in samples:
            record = json.loads(sample["json"])
            extension = "png" if record["path"].endswith(".png") else "jpg"
            assert sample[extension] == (image_root / record["path"]).read_bytes()  # not re-encoded
            assert int(sample["cls"]) == CLASSES.index(record["class"]) == CLASSES.index(record["path"].split("/")[1])
    first_shard = [json.loads(sample["json"])["class"] for _, sample in _read_back(tmp_path, "train")[:8]]
    assert len(set(first_shard)) == 2  # shuffled across shards: not one class after the other


def test_a_half_written_sharding_resumes_without_rewriting_finished_shards(image_root, tmp_path, monkeypatch):
    reference = shard_folder(image_root, tmp_path / "whole", shard_bytes=4000, workers=0)
    out = tmp_path / "resumed"
    shard_folder(image_root, out, shard_bytes=4000, workers=0)
    progress = json.loads((out / "progress.json").read_text())
    unfinished = sorted(progress["shards"])[-2:]
    for name in unfinished:  # as if killed while these two were written
        del progress["shards"][name]
        (out / name).unlink()
    (out / f"{unfinished[0]}.partial").write_bytes(b"half a tar")
    (out / "progress.json").write_text(json.dumps(progress))
    written = []
    original = shards_module.write_shard
    monkeypatch.setattr(
        shards_module, "write_shard", lambda task, **kw: written.append(task.name) or original(task, **kw)
    )
    assert shard_folder(image_root, out, shard_bytes=4000, workers=0) == reference
    assert sorted(written) == unfinished
    with pytest.raises(ConfigError, match="another sharding"):
        shard_folder(image_root, out, shard_bytes=8000, workers=0)


def test_shard_command_writes_shards_in_worker_processes_and_rejects_a_bad_size(image_root, tmp_path, capsys, caplog):
    argv = ["shard", str(image_root), "--out", str(tmp_path / "out"), "--shard-size", "4KB", "--workers", "2"]
    with caplog.at_level("WARNING", logger="vitrain"):
        assert main(argv) == 0
    detail = json.loads((tmp_path / "out" / "index.json").read_text())["splits"]["train"]["bad_files"][0][2]
    assert [message for message in caplog.messages if "left out" in message] == [
        f"bad image left out of the shards: {image_root / 'train/dog/broken.jpg'} (unreadable: {detail})"
    ]
    assert f'"samples": {NUM_TRAIN}' in capsys.readouterr().out
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["splits"]["val"]["samples"] == NUM_VAL and len(index["splits"]["train"]["shards"]) > 2
    assert main(["shard", str(image_root), "--out", str(tmp_path / "x"), "--shard-size", "lots"]) == 2
    assert "--shard-size 'lots'" in capsys.readouterr().err
    # an image above --max-image-pixels is left out as a decompression bomb, the rest kept
    assert main(["shard", str(image_root), "--out", str(tmp_path / "small"), "--max-image-pixels", "600"]) == 0
    small = json.loads((tmp_path / "small" / "index.json").read_text())["splits"]["train"]
    too_large = [path for path, reason, _ in small["bad_files"] if reason == "decompression_bomb"]
    assert too_large and small["samples"] == NUM_TRAIN - len(too_large)
    assert main(["shard", str(image_root), "--out", str(tmp_path / "y"), "--max-image-pixels", "0"]) == 2


def _overrides(root, *extra: str) -> list[str]:
    return [
        "data.name=webdataset",
        f"data.root={root}",
        "data.image_size=14",
        "data.num_workers=0",
        "data.scale=[0.5, 1.0]",
        "data.wds_shuffle_buffer=4",
        "model.name=vit_tiny6_patch7",
        "precision=fp32",
        "train.batch_size=4",
        "train.progress=off",
        *extra,
    ]


def test_training_and_evaluation_from_shards(sharded, tmp_path, one_thread):
    info = describe_source(make_config(*_overrides(sharded)).data)
    assert (info.num_train, info.num_eval, info.num_classes, info.channels) == (NUM_TRAIN, NUM_VAL, 2, 3)
    out_dir = tmp_path / "run"
    argv = [
        "train",
        *[item for o in _overrides(sharded, "train.epochs=2", f"train.out_dir={out_dir}") for item in ("--set", o)],
    ]
    assert main(argv) == 0
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["images_seen"] == 2 * (NUM_TRAIN // 4) * 4
    assert summary["mean_read_mb_s"] > 0 and summary["mean_files_s"] > 0  # the image entries decoded
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["num_samples"] for record in records if record["event"] == "eval"][-1] == NUM_VAL
    info = read_checkpoint_model(find_latest_checkpoint(out_dir))[1]
    assert info["plan"]["class_names"] == list(CLASSES)  # from index.json, for vitrain predict


def _names_per_rank(root: Path, workers: int, *extra: str) -> tuple[list[list[str]], list[list[str]]]:
    """Sample names each of 2 ranks takes in epoch 0 of training and in evaluation (``workers`` per rank)."""
    train, evaluation = [], []
    for rank in range(2):
        plan = make_plan(make_config(*_overrides(root, "train.batch_size=4", *extra)), World(rank=rank, size=2))
        for loader, taken in zip(build_loaders(plan.data), (train, evaluation), strict=True):
            spec = loader.stream_spec()
            batches = [batch for worker in range(workers) for batch in worker_batches(spec, worker, workers)]
            taken.append([name for _, _, _, names, _ in batches for name in names])
            if loader.train:
                assert all(len(labels) == 2 for _, labels, *_ in batches) and len(batches) == len(loader)
    return train, evaluation


@pytest.mark.parametrize("many_shards", [True, False])
def test_two_ranks_take_disjoint_samples_and_evaluate_each_sample_once(sharded, image_root, tmp_path, many_shards):
    root = sharded
    if not many_shards:  # one shard per split: fewer shards than streams, so the streams split samples
        root = tmp_path / "one"
        shard_folder(image_root, root, shard_bytes=10**9, workers=0)
    train, evaluation = _names_per_rank(root, 2)
    assert len(train[0]) == len(train[1]) == (NUM_TRAIN // 4) * 2  # each rank its half of every global batch
    assert not set(train[0]) & set(train[1])
    assert len(set(train[0]) | set(train[1])) == (NUM_TRAIN // 4) * 4  # no sample twice
    assert not set(evaluation[0]) & set(evaluation[1])
    assert len(evaluation[0] + evaluation[1]) == len(set(evaluation[0]) | set(evaluation[1])) == NUM_VAL


def test_a_resumed_epoch_continues_with_the_same_batches(sharded, one_thread):
    plan = make_plan(make_config(*_overrides(sharded, "data.num_workers=2", "train.batch_size=2")))
    loader = build_loaders(plan.data)[0]
    loader.start_epoch(1)
    whole = list(loader)
    assert len(whole) == len(loader) == NUM_TRAIN // 2
    for taken in (3, 6):  # within the epoch; resumed at an odd batch, the workers take their turns renumbered
        loader.start_epoch(1, taken * 2)
        rest = list(loader)
        assert len(rest) == len(whole) - taken
        for (images, labels), (expected_images, expected_labels) in zip(rest, whole[taken:], strict=True):
            assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
    loader.start_epoch(2)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(list(loader), whole, strict=True))  # another epoch


def _write_shard(path: Path, samples: list[dict]) -> None:
    import webdataset

    with webdataset.TarWriter(str(path)) as writer:
        for sample in samples:
            writer.write(sample)


def _png(seed: int) -> bytes:
    import io

    buffer = io.BytesIO()
    _noise(12, seed).save(buffer, format="PNG")
    return buffer.getvalue()


def test_samples_without_label_or_decodable_image_are_skipped_and_counted(tmp_path, caplog):
    good = [{"__key__": f"{i:04d}", "png": _png(i), "cls": i % 2} for i in range(10)]
    _write_shard(tmp_path / "train-0.tar", [*good[:5], {"__key__": "nolabel", "png": _png(50)}, *good[5:]])
    _write_shard(
        tmp_path / "val-0.tar",
        [*good[:3], {"__key__": "garbage", "png": b"plain text", "cls": 1}, {"__key__": "x", "json": {"a": 1}}],
    )
    config = make_config(*_overrides(f"{tmp_path}/train-{{0..0}}.tar", "data.max_bad_fraction=0.5"))
    info = describe_source(config.data)
    assert (info.num_train, info.num_eval, info.num_classes) == (11, 5, 2)  # counted: there is no index
    train, evaluation = build_loaders(make_plan(config).data)
    assert sum(len(labels) for _, labels in train) == 8
    assert train.bad_images.counts() == {"no_label": 1}
    assert "nolabel" in next(iter(train.bad_images.bad))
    assert sum(len(labels) for _, labels in evaluation) == 3
    assert evaluation.bad_images.counts() == {"no_image": 1, "not_an_image": 1}


def test_a_shard_truncated_during_the_run_is_counted_and_the_rest_trains(sharded, tmp_path):
    config = make_config(*_overrides(sharded, "data.max_bad_fraction=0.5"))
    train = build_loaders(make_plan(config).data)[0]
    urls = list(train.shards.urls)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(Path(urls[0]).read_bytes()[:1500])
    train.shards = shards_module.ShardSet(tuple([str(cut), *urls[1:]]), train.shards.counts)
    assert sum(len(labels) for _, labels in train) == (NUM_TRAIN // 4) * 4  # the streams start over to fill the epoch
    assert train.bad_images.counts() == {"unreadable_shard": 1}


def test_bad_shard_input_stops_before_training_with_the_file_and_a_fix(
    sharded, image_root, tmp_path, capsys, monkeypatch
):
    def run(root, *extra: str) -> str:
        overrides = _overrides(root, f"train.out_dir={tmp_path / 'run'}", "train.steps=1", *extra)
        assert main(["train", *[item for o in overrides for item in ("--set", o)]]) == 2
        return capsys.readouterr().err

    assert "matches no file" in run(f"{tmp_path}/nothing-{{000..009}}.tar")
    assert "data.repeated_aug=3 needs indexed samples" in run(sharded, "data.repeated_aug=3")
    label = ["label", "--teacher", str(tmp_path / "teacher.safetensors"), "--out", str(tmp_path / "maps")]
    assert main([*label, *[item for o in _overrides(sharded) for item in ("--set", o)]]) == 2
    assert "vitrain label needs indexed samples" in capsys.readouterr().err
    assert "data.wds_image_keys='jpg;png'" in run(sharded, "data.wds_image_keys=jpg")  # the index lists png too
    (tmp_path / "part-0.tar").write_bytes((sharded / "train-000000.tar").read_bytes())
    assert "set data.wds_eval_shards" in run(f"{tmp_path}/part-{{0..0}}.tar")  # no 'train' to make 'val' of
    copy = tmp_path / "copy"
    shard_folder(image_root, copy, shard_bytes=10**9, workers=0)
    shard = copy / "train-000000.tar"
    shard.write_bytes(shard.read_bytes()[:3000])
    assert "train-000000.tar has 3000 bytes, index.json says" in run(copy)
    (copy / "index.json").unlink()  # without an index the shards are read to count them
    assert "train-000000.tar cannot be read" in run(f"{copy}/train-{{000000..000000}}.tar")
    shards_module._cached_source.cache_clear()
    monkeypatch.setitem(sys.modules, "webdataset", None)
    assert "pip install 'vitrain[webdataset]'" in run(sharded)


def test_pipe_commands_read_shards_and_a_split_without_decodable_images_stops(sharded, tmp_path):
    last = {prefix: len(list(sharded.glob(f"{prefix}-*.tar"))) - 1 for prefix in ("train", "val")}
    train_pattern = f"pipe:cat {sharded}/train-{{000000..{last['train']:06d}}}.tar"
    eval_pattern = f"pipe:cat {sharded}/val-{{000000..{last['val']:06d}}}.tar"
    config = make_config(*_overrides(train_pattern, f"data.wds_eval_shards={eval_pattern}", "data.max_bad_fraction=1"))
    assert isinstance(config.data.root, str)  # kept as text, not folded into a path
    assert describe_source(config.data).num_eval == NUM_VAL
    train, evaluation = build_loaders(make_plan(config).data)
    assert sum(len(labels) for _, labels in evaluation) == NUM_VAL
    assert sum(len(labels) for _, labels in train) == (NUM_TRAIN // 4) * 4
    train.data.source.wds_image_keys = "gif"  # no sample has an image the loader looks for
    with pytest.raises(TooManyBadImages, match="none of the 21 training images decodes"):
        list(train)
    assert train.bad_images.counts() == {"no_image": NUM_TRAIN}


def test_training_resumed_within_an_epoch_ends_bitwise_equal(sharded, tmp_path, one_thread):
    from vitrain.train import train

    overrides = _overrides(sharded, "data.num_workers=2", "train.epochs=2", "train.log_every_steps=5")
    straight = make_plan(
        make_config(
            *overrides, "checkpoint.every_steps=1", "checkpoint.keep_last=100", f"train.out_dir={tmp_path / 'a'}"
        )
    )
    train(straight)
    final = find_latest_checkpoint(straight.out_dir)
    for step in (3, 7):  # mid-epoch, each at an odd batch of the two workers
        folder = tmp_path / f"from-{step}"
        (folder / "checkpoints").mkdir(parents=True)
        shutil.copy(straight.out_dir / "checkpoints" / f"step-{step:09d}.pt", folder / "checkpoints")
        train(make_plan(make_config(*overrides, f"train.out_dir={folder}")), resume="auto")
        resumed = find_latest_checkpoint(folder)
        assert resumed.name == final.name
        assert_same_training_state(resumed, final)


def test_doctor_checks_the_shards_of_the_config(sharded, tmp_path):
    from types import SimpleNamespace

    from vitrain.doctor.environment import check_data

    def check(root) -> tuple[str, str]:
        (result,) = check_data(SimpleNamespace(config=make_config(*_overrides(root))))
        return result.status, result.value

    assert check(sharded) == ("PASS", f"webdataset at {sharded} (recipe custom)")
    status, value = check(f"{tmp_path}/train-{{0..3}}.tar")
    assert status == "FAIL" and "matches no file" in value
