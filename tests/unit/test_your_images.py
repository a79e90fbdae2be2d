"""Training on your own images: --data layouts (class folders, train/ alone or with val/, a CSV list), the held-out
evaluation split, the plain flags, the recipe chosen for a budget, and the whole run from one command."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from vitrain.cli import build_parser, main
from vitrain.cli.common import RUN_FLAGS, load_config
from vitrain.config import Config, ConfigError, DataConfig
from vitrain.data.sources import hold_out, image_folder_root, image_folder_samples, read_csv_samples
from vitrain.recipes import get_recipe
from vitrain.recipes.images import AUGMENT_FROM_EPOCHS, LADDER, images_recipe
from vitrain.train.budget_choice import MIN_EPOCHS, choose_for_data

CLASSES = ("apple", "bear", "car")


def write_class_folders(root: Path, per_class: int, side: int = 16, classes=CLASSES) -> Path:
    """JPEGs in one folder per class whose colour and stripes follow the class (learnable)."""
    rng = np.random.default_rng(0)
    for index, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for number in range(per_class):
            y, x = np.mgrid[0:side, 0:side]
            colour = np.array([np.cos(index), np.sin(index), np.cos(2 * index)]) * 80 + 128
            stripes = np.sin((x * np.cos(index) + y * np.sin(index)) / 2.0)[..., None] * 40
            pixels = np.clip(colour + stripes + rng.normal(0, 20, (side, side, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{number:03d}.jpg", quality=90)
    return root


def splits(root: Path, fraction: float = 0.25) -> tuple[list, list, list[str]]:
    train, classes = image_folder_samples(root, "train", fraction)
    evaluation, _ = image_folder_samples(root, "eval", fraction)
    return train, evaluation, classes


def test_a_folder_of_class_folders_holds_out_a_stable_share_of_each_class(tmp_path):
    root = write_class_folders(tmp_path / "images", per_class=8)
    train, evaluation, classes = splits(root)
    assert classes == list(CLASSES)
    assert len(train) == 18 and len(evaluation) == 6  # 2 of 8 in each class
    assert sorted(label for _, label in evaluation) == [0, 0, 1, 1, 2, 2]
    assert not {path for path, _ in train} & {path for path, _ in evaluation}
    moved = tmp_path / "elsewhere" / "images"
    shutil.copytree(root, moved)
    relative = sorted(str(Path(path).relative_to(moved)) for path, _ in splits(moved)[1])
    assert relative == sorted(str(Path(path).relative_to(root)) for path, _ in evaluation)  # by path, not place
    reversed_order = hold_out(list(reversed(train + evaluation)), root, 0.25)[1]
    assert sorted(reversed_order) == sorted(evaluation)  # and not by the order of the files


def test_train_alone_holds_out_and_train_with_val_uses_val(tmp_path):
    alone = write_class_folders(tmp_path / "alone" / "train", per_class=4).parent
    train, evaluation, _ = splits(alone)
    assert (len(train), len(evaluation)) == (9, 3)
    both = tmp_path / "both"
    write_class_folders(both / "train", per_class=4)
    write_class_folders(both / "val", per_class=2)
    train, evaluation, _ = splits(both)
    assert (len(train), len(evaluation)) == (12, 6) and all("/val/" in path for path, _ in evaluation)


def test_a_csv_lists_images_with_labels_and_optionally_their_split(tmp_path):
    root = write_class_folders(tmp_path / "pics", per_class=4)
    rows = [f"pics/{name}/{number:03d}.jpg,{index + 8}" for index, name in enumerate(CLASSES) for number in range(4)]
    listing = tmp_path / "list.csv"
    listing.write_text("path,label\n" + "\n".join(rows) + "\n")
    samples, classes, split = read_csv_samples(listing)
    assert classes == ["8", "9", "10"] and split is None  # numbers in numeric order, not as text
    assert samples[0] == (str(root / "apple" / "000.jpg"), 0)
    train, evaluation, _ = splits(listing)
    assert (len(train), len(evaluation)) == (9, 3)
    listing.write_text("\n".join(f"{row},{'val' if row.endswith('3.jpg,9') else 'train'}" for row in rows))
    train, evaluation, _ = splits(listing)
    assert (len(train), len(evaluation)) == (11, 1)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: (p / "notes.txt").write_text("x") and p / "notes.txt", "is a file but not a .csv"),
        (lambda p: (p / "flat").mkdir() or p / "flat", "has no class folders"),
        (lambda p: (p / "bad.csv").write_text("a.jpg\n") and p / "bad.csv", "row 1 has no path,label"),
    ],
)
def test_bad_data_roots_are_named_with_the_fix(tmp_path, make, message, capsys):
    root = make(tmp_path)
    with pytest.raises(ConfigError, match=message):
        image_folder_root(DataConfig(name="imagefolder", root=root))
        read_csv_samples(root)
    assert (
        main(["show-config", "--raw", "--recipe", "fmnist", "--data", str(root), "--set", "data.name=imagefolder"]) == 0
    )
    code = main(["train", "--data", str(root), "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and message in err[-1] and err[-1].startswith("vitrain: error:")


FLAG_VALUES = {
    "data": "some/folder",
    "val_fraction": "0.1",
    "budget": "90s",
    "epochs": "3",
    "batch_size": "64",
    "lr": "0.002",
    "model": "vit_tiny6_patch7",
    "image_size": "28",
    "precision": "fp32",
    "device": "cpu",
    "out": "runs/mine",
}


@pytest.mark.parametrize("name", list(RUN_FLAGS))
def test_each_plain_flag_is_its_set_key(name):
    """The same config as --set of the key (same checks, same errors)."""
    assert sorted(FLAG_VALUES) == sorted(RUN_FLAGS)
    flag, key, value = f"--{name.replace('_', '-')}", RUN_FLAGS[name][1], FLAG_VALUES[name]
    by_flag = load_config(get_recipe("fmnist"), build_parser().parse_args(["train", flag, value]))
    sets = [f"{key}={value}"] + {"data": ["data.name=imagefolder"], "lr": ["optim.reference_batch=256"]}.get(name, [])
    by_set = load_config(get_recipe("fmnist"), build_parser().parse_args(["train", *[f"--set={s}" for s in sets]]))
    assert by_flag == by_set and by_flag != get_recipe("fmnist")


def test_flags_are_checked_as_their_keys_and_set_wins(capsys):
    assert main(["show-config", "--raw", "--epochs", "-1"]) == 2
    assert "train.epochs" in capsys.readouterr().err
    assert main(["show-config", "--raw", "--epochs", "5", "--set", "train.epochs=2"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["epochs"] == 2
    assert main(["show-config", "--raw", "--lr", "0.001", "--batch-size", "64"]) == 0
    optim = yaml.safe_load(capsys.readouterr().out)["optim"]
    assert (optim["lr"], optim["reference_batch"]) == (0.001, 64)  # the LR as given at this batch


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("vitrain 0.")


def _fake_timer(rates: dict[tuple[str, int], float], timed: list):
    def timer(candidate: Config) -> float:
        timed.append((candidate.model.name, candidate.data.image_size))
        return rates[timed[-1]]

    return timer


def test_the_budget_takes_the_costliest_rung_with_enough_epochs(tmp_path):
    root = write_class_folders(tmp_path / "images", per_class=34, side=120)
    num_train = len(image_folder_samples(root, "train", 0.05)[0])  # 96: 2 of each 34 held out
    config = load_config(get_recipe("images"), build_parser().parse_args(["train", "--data", str(root)]))
    config.train.budget, config.train.epochs = "100s", None
    rates = {(rung.model, rung.image_size): num_train / 2**index for index, rung in enumerate(LADDER)}
    timed = []
    choice = choose_for_data(config, lambda base: base, _fake_timer(rates, timed))
    # epochs in 100 s: 100, 50, 25, 12.5, 6.25 -> the fourth rung; the fifth is timed, then the climb stops
    assert choice.rung == LADDER[3] and choice.epochs == pytest.approx(12.5)
    assert timed == [(rung.model, rung.image_size) for rung in LADDER[:5]]
    assert choice.config.data.randaugment is None and choice.config.data.hflip == 0.5  # 12.5: crops and flips
    assert any("chosen: localvit_tiny_patch16 at 224 px" in reason for reason in choice.reasons)
    timed.clear()
    slow = {key: rate / 100 for key, rate in rates.items()}  # nothing reaches MIN_EPOCHS: the cheapest
    choice = choose_for_data(config, lambda base: base, _fake_timer(slow, timed))
    assert choice.rung == LADDER[0] and len(timed) == 1 and choice.epochs < MIN_EPOCHS
    assert choice.config.data.hflip == 0.0 and choice.config.data.scale == (1.0, 1.0)  # 1 epoch: no crops, flips


def test_small_images_are_not_scaled_far_up_and_the_user_s_settings_win(tmp_path):
    root = write_class_folders(tmp_path / "images", per_class=34, side=20)  # 20 px: rungs up to 40 px
    args = build_parser().parse_args(["train", "--data", str(root), "--budget", "1h", "--model", "vit_tiny6_patch7"])
    config = load_config(get_recipe("images"), args)
    timed = []
    rates = {("vit_tiny6_patch7", rung.image_size): 1000.0 for rung in LADDER}
    choice = choose_for_data(config, lambda base: load_config(base, args), _fake_timer(rates, timed))
    assert timed == [("vit_tiny6_patch7", 32)] and choice.config.model.name == "vit_tiny6_patch7"
    assert choice.epochs >= AUGMENT_FROM_EPOCHS and choice.config.data.randaugment is not None
    assert choice.config.train.budget == "1h" and choice.config.train.epochs is None


def test_without_a_budget_the_rung_follows_the_number_of_images(tmp_path):
    root = write_class_folders(tmp_path / "images", per_class=34, side=120)
    args = build_parser().parse_args(["train", "--data", str(root), "--epochs", "7"])
    config = load_config(get_recipe("images"), args)
    choice = choose_for_data(config, lambda base: load_config(base, args), _fake_timer({}, []))
    assert choice.rung == LADDER[0] and choice.config.train.epochs == 7  # under 2,000 images
    assert images_recipe(LADDER[2], 30, 100_000).train.batch_size == LADDER[2].batch_size
    assert images_recipe(LADDER[0], 30, 1000).train.batch_size == 64  # eight steps an epoch at least...
    assert images_recipe(LADDER[0], 30, 100).train.batch_size == 32  # ... but not below 32


def test_data_takes_the_source_kind_from_the_path(tmp_path):
    from vitrain.cli.common import data_source_name

    shards = tmp_path / "shards"
    shards.mkdir()
    assert data_source_name(str(shards)) == "imagefolder"  # empty: an image folder, which resolve() checks
    (shards / "train-000000.tar").write_bytes(b"")
    assert data_source_name(str(shards)) == "webdataset"
    indexed = tmp_path / "indexed"
    indexed.mkdir()
    (indexed / "index.json").write_text("{}")
    assert data_source_name(str(indexed)) == "webdataset"
    assert data_source_name(str(tmp_path / "list.csv")) == "imagefolder"  # CSV lists are read as image folders
