"""`vitrain predict`: image files and folders classified with a trained checkpoint, without its data."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import old_flat_layout
from tests.unit.test_bad_images import BAD_FILES, LIMIT, ODD_FILES
from vitrain.checkpoint import find_latest_checkpoint
from vitrain.checkpoint.sharded import read_checkpoint_model
from vitrain.cli import main
from vitrain.config import Config, model_overrides
from vitrain.data import Normalize
from vitrain.data.decode import decode_image
from vitrain.data.loader import draft_size
from vitrain.data.sources import (
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
)
from vitrain.data.transforms import build_eval_transform
from vitrain.models import build_model, model_spec
from vitrain.predict import collect_image_paths
from vitrain.weights.inference import known_class_names

TINY_RUN = [
    "precision=fp32",
    "model.name=vit_tiny6_patch7",
    "data.image_size=14",
    "data.num_workers=0",
    "train.progress=off",
    "optim.lr=0.5",
    "train.batch_size=32",
    "train.epochs=1",
]


def _set(*overrides: str) -> list[str]:
    return [item for override in overrides for item in ("--set", override)]


def _train(out_dir: Path, *overrides: str) -> Path:
    assert main(["train", *_set(*TINY_RUN, f"train.out_dir={out_dir}", *overrides)]) == 0
    return out_dir


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory, tiny_imagefolder) -> Path:
    """A one-epoch image-folder run (classes n01, n02, n03) with a weight EMA."""
    out_dir = tmp_path_factory.mktemp("predict") / "run"
    extra = ("data.name=imagefolder", f"data.root={tiny_imagefolder}", "train.batch_size=6", "train.ema.decay=0.5")
    return _train(out_dir, *extra)


GOOD_COPIES = 4  # val images copied into the folder to classify


@pytest.fixture(scope="module")
def images(tmp_path_factory, tiny_imagefolder) -> Path:
    """Plain, odd (CMYK, grayscale, EXIF-rotated, transparent, palette, 16-bit) and bad files, in subfolders,
    with a text file that is no image by its name."""
    folder = tmp_path_factory.mktemp("to_classify")
    (folder / "odd").mkdir()
    (folder / "bad").mkdir()
    plain = [path for path in sorted((tiny_imagefolder / "val").rglob("*")) if path.is_file()]
    for index, path in enumerate(plain[:GOOD_COPIES]):
        shutil.copy(path, folder / f"plain{index}{path.suffix}")
    for name, (write, _) in ODD_FILES.items():
        write(folder / "odd" / name)
    for name, (write, _) in BAD_FILES.items():
        write(folder / "bad" / name)
    (folder / "bad" / "readme.txt").write_text("not an image, not listed")
    return folder


def _good_files(folder: Path) -> list[Path]:
    bad = {folder / "bad" / name for name in BAD_FILES}
    return [path for path in collect_image_paths([folder]) if path not in bad]


def _predict(capsys, run: Path, *arguments: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr; the bomb of BAD_FILES exceeds the pixel limit set here."""
    code = main(["predict", "--checkpoint", str(run), *arguments, *_set(f"data.max_image_pixels={LIMIT}")])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_folders_are_searched_for_image_extensions_and_files_taken_as_given(images):
    found = collect_image_paths([images, images / "bad" / "readme.txt", images / "odd"])
    assert images / "bad" / "readme.txt" == found[-1]  # named: taken, whatever its extension
    assert len(found) == len(set(found)) == len(_good_files(images)) + len(BAD_FILES) + 1
    assert all(path.suffix.lower() != ".txt" for path in found[:-1])


def test_a_folder_with_odd_and_bad_images_gives_a_row_per_good_image(folder_run, images, capsys):
    code, out, err = _predict(capsys, folder_run, str(images), "--topk", "2")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["path", "top-1", "(prob)", "top-2", "(prob)"]
    assert [row.split()[0] for row in rows] == [str(path) for path in _good_files(images)]
    assert all(len(row.split()) == 5 for row in rows)
    reported = [line for line in err.splitlines() if "not classified" in line]
    assert len(reported) == len(BAD_FILES)
    for name, (_, reason) in BAD_FILES.items():
        assert any(str(images / "bad" / name) in line and f": {reason} (" in line for line in reported)


def _reference(run: Path, paths: list[Path], weights: str = "live") -> torch.Tensor:
    """Class probabilities computed from the checkpoint's weights as evaluation decodes and transforms."""
    state, info = read_checkpoint_model(find_latest_checkpoint(run), weights)
    config = Config.model_validate(info["config"])
    grayscale = config.data.name == "fashion-mnist"
    options = model_overrides(config.model, model_spec(config.model.name).args)
    sizes = {"img_size": 14, "in_chans": 1 if grayscale else 3, "num_classes": len(state["head.bias"])}
    model = build_model(config.model.name, **sizes, **options)
    model.load_state_dict(state)
    transform = build_eval_transform(config.data)
    side = draft_size(config.data, 14, train=False)
    pictures = [decode_image(path, side).image for path in paths]
    batch = torch.stack([transform(picture.convert("L") if grayscale else picture) for picture in pictures])
    normalization = {
        "fashion-mnist": (FASHION_MNIST_MEAN, FASHION_MNIST_STD),
        "imagefolder": (IMAGENET_MEAN, IMAGENET_STD),
        "synthetic": ((0.5,) * 3, (0.25,) * 3),  # the synthetic source's
    }
    mean, std = normalization[config.data.name]
    with torch.no_grad():
        return model.eval()(Normalize(mean, std, "cpu")(batch)).softmax(dim=1)


@pytest.mark.parametrize("weights", ["live", "ema"])
def test_json_lines_have_sorted_topk_and_equal_the_models_own_prediction(folder_run, images, capsys, weights):
    code, out, _ = _predict(
        capsys, folder_run, str(images), "--json", "--topk", "2", "--batch", "3", "--weights", weights
    )
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    good = [record for record in records if "top" in record]
    errors = {Path(record["path"]).name: record["error"] for record in records if "error" in record}
    assert errors == {name: reason for name, (_, reason) in BAD_FILES.items()}
    for record in good:
        probabilities = [entry["prob"] for entry in record["top"]]
        assert len(probabilities) == 2 and probabilities == sorted(probabilities, reverse=True)
        assert sum(probabilities) <= 1 + 1e-5
    reference = _reference(folder_run, [Path(record["path"]) for record in good], weights)
    assert [record["top"][0]["index"] for record in good] == reference.argmax(dim=1).tolist()
    ours = torch.tensor([[entry["prob"] for entry in record["top"]] for record in good])
    assert torch.allclose(ours, reference.topk(2, dim=1).values, atol=1e-5)


def test_csv_has_a_row_per_image_and_rank_and_folder_class_names(folder_run, images, capsys):
    code, out, _ = _predict(capsys, folder_run, str(images / "odd"), str(images / "plain0.JPEG"), "--csv")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == ["path", "rank", "class", "index", "prob"]
    assert len(rows) == (len(ODD_FILES) + 1) * 3  # 3 classes: top-5 shows the 3
    for start in range(0, len(rows), 3):
        group = rows[start : start + 3]
        assert [row["rank"] for row in group] == ["1", "2", "3"] and len({row["path"] for row in group}) == 1
        assert sorted(row["class"] for row in group) == ["n01", "n02", "n03"]  # the class folders, sorted
        assert {(row["class"], row["index"]) for row in group} == {("n01", "0"), ("n02", "1"), ("n03", "2")}
        assert sum(float(row["prob"]) for row in group) == pytest.approx(1.0, abs=1e-5)


def test_class_names_come_from_the_record_else_the_data_else_class_n(folder_run, tiny_imagefolder, tmp_path, caplog):
    state, info = read_checkpoint_model(find_latest_checkpoint(folder_run))
    config = Config.model_validate(info["config"])
    assert info["plan"]["class_names"] == ["n01", "n02", "n03"]
    assert info["inference"]["class_names"] == ["n01", "n02", "n03"]
    old = {key: value for key, value in info.items() if key != "inference"}  # as checkpoints before the record
    old["plan"] = {key: value for key, value in info["plan"].items() if key != "class_names"}
    assert known_class_names(config.data, old, 3) == ["n01", "n02", "n03"]  # read from data.root
    gone = config.data.model_copy(update={"root": tmp_path / "moved"})
    assert known_class_names(gone, info, 3) == ["n01", "n02", "n03"]  # recorded: no data needed
    assert known_class_names(gone, old, 3) is None and "class names unknown" in caplog.text
    assert known_class_names(config.data, old, 4) is None  # a count that does not fit the model


def test_predict_needs_no_training_data_and_takes_a_checkpoint_file(folder_run, images, tmp_path, capsys):
    checkpoint = find_latest_checkpoint(folder_run)
    moved = tmp_path / "moved"
    code, out, _ = _predict(capsys, checkpoint, str(images / "plain0.JPEG"), "--json", "--set", f"data.root={moved}")
    assert code == 0 and json.loads(out)["top"][0]["class"] in ("n01", "n02", "n03")


def test_a_one_channel_fashion_mnist_model_names_its_classes(tiny_fmnist, tmp_path, capsys):
    run = _train(tmp_path / "fmnist", f"data.root={tiny_fmnist}", "data.limit_train=64")
    capsys.readouterr()  # the training summary
    picture = tmp_path / "shirt.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 30, 3), dtype=np.uint8)).save(picture)
    code, out, _ = _predict(capsys, run, str(picture), "--json", "--topk", "10")
    assert code == 0
    top = json.loads(out)["top"]
    assert sorted(entry["class"] for entry in top) == sorted(FASHION_MNIST_CLASSES)
    assert all(FASHION_MNIST_CLASSES[entry["index"]] == entry["class"] for entry in top)
    reference = _reference(run, [picture])[0]
    assert top[0]["index"] == int(reference.argmax()) and top[0]["prob"] == pytest.approx(
        float(reference.max()), abs=1e-5
    )


def test_exit_1_when_no_image_is_classified(folder_run, images, capsys):
    code, out, err = _predict(capsys, folder_run, str(images / "bad"))
    assert code == 1 and len(out.splitlines()) == 1  # the header alone
    assert "no image classified" in err


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["missing.png"], "does not exist"),
        (["IMAGES", "--topk", "0"], "--topk 0"),
        (["IMAGES", "--batch", "0"], "--batch 0"),
        (["IMAGES", "--set", "model.nonsense=1"], "model.nonsense"),
    ],
)
def test_bad_arguments_exit_2(folder_run, images, capsys, arguments, message):
    arguments = [str(images) if argument == "IMAGES" else argument for argument in arguments]
    code, _, err = _predict(capsys, folder_run, *arguments)
    assert code == 2 and message in err


def test_a_checkpoint_that_cannot_be_read_exits_2(images, tmp_path, capsys):
    (tmp_path / "step-000000001.pt").write_text("not a checkpoint")
    code, _, err = _predict(capsys, tmp_path / "step-000000001.pt", str(images))
    assert code == 2 and "step-000000001.pt" in err and "vitrain: error: checkpoint" in err
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    code, _, err = _predict(capsys, tmp_path / "empty_run", str(images))
    assert code == 2 and "no complete checkpoint" in err
    code, _, err = _predict(capsys, images, str(images))
    assert code == 2 and "neither a checkpoint nor a run folder" in err


def test_a_sharded_synthetic_checkpoint_names_classes_class_n(tmp_path, capsys):
    run = _train(
        tmp_path / "run",
        "data.name=synthetic",
        "data.synthetic_num_train=64",
        "checkpoint.format=sharded",
    )
    capsys.readouterr()
    checkpoint = find_latest_checkpoint(run)
    assert checkpoint.is_dir() and checkpoint.name.startswith("step-")
    picture = tmp_path / "picture.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(picture)
    code, out, _ = _predict(capsys, checkpoint, str(picture), "--json", "--topk", "10")
    assert code == 0
    top = json.loads(out)["top"]
    assert len(top) == 10 and all(entry["class"] == f"class_{entry['index']}" for entry in top)


def test_a_model_with_a_token_labeling_head_predicts_with_it(tmp_path, capsys):
    run = _train(tmp_path / "run", "data.name=synthetic", "data.synthetic_num_train=64", "model.aux_head=true")
    capsys.readouterr()
    picture = tmp_path / "picture.png"
    Image.fromarray(np.random.default_rng(2).integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(picture)
    code, out, _ = _predict(capsys, run, str(picture), "--json", "--topk", "10")
    assert code == 0
    state, _ = read_checkpoint_model(find_latest_checkpoint(run))
    assert "aux_head.weight" in state
    ours = torch.tensor([entry["prob"] for entry in sorted(json.loads(out)["top"], key=lambda entry: entry["index"])])
    assert torch.allclose(ours, _reference(run, [picture])[0], atol=1e-5)  # the forward: class + 0.5 x aux max


def _refuse_resolution(monkeypatch) -> None:
    """Every name bound to ``resolve()`` or ``make_plan()`` raises."""
    import sys

    from vitrain.config import resolve
    from vitrain.train import make_plan

    def refuse(*args, **kwargs):
        raise AssertionError("a training plan was resolved")

    for module in list(sys.modules.values()):
        for name, value in list(vars(module).items()) if module is not None else ():
            if value is resolve or value is make_plan:
                monkeypatch.setattr(module, name, refuse)


def _without_inference_record(checkpoint: Path, out: Path) -> Path:
    """A copy of ``checkpoint`` as checkpoints were written before they recorded what inference needs, with
    the config in the flat layout of that time."""
    payload = torch.load(checkpoint, weights_only=True)
    out.parent.mkdir(parents=True)
    payload["config"] = old_flat_layout(payload["config"])
    torch.save({key: value for key, value in payload.items() if key != "inference"}, out)
    return out


def test_predict_and_export_build_the_model_without_resolving_a_plan(folder_run, images, tmp_path, capsys, monkeypatch):
    """The checkpoint's inference record alone: predict and every export format with resolve() refused, and
    the same from a checkpoint without the record (its saved config and weights)."""
    pytest.importorskip("onnxruntime", reason="the ONNX export is checked with onnxruntime ([onnx] extra)")
    one_step = ("data.name=synthetic", "data.synthetic_num_train=32", "data.synthetic_num_eval=8")
    timm_run = _train(tmp_path / "timm-run", *one_step, "model.name=vit_tiny_patch16", "data.image_size=16")
    capsys.readouterr()
    runs = {"folder": folder_run, "timm": timm_run}
    for name, run in list(runs.items()):
        runs[f"{name}-old"] = _without_inference_record(
            find_latest_checkpoint(run), tmp_path / "old" / name / "step.pt"
        )
    _refuse_resolution(monkeypatch)
    expected = {}
    for name, source in runs.items():
        code, out, _ = _predict(capsys, source, str(images / "plain0.JPEG"), "--json")
        assert code == 0
        top = json.loads(out)["top"]
        assert top == expected.setdefault(name.removesuffix("-old"), top)  # the record and the old form agree
        formats = ("timm", "safetensors") if name.startswith("timm") else ("safetensors", "onnx")
        for form in formats:
            target = tmp_path / "exports" / name / form
            assert main(["export", "--checkpoint", str(source), "--out", str(target), "--format", form]) == 0
            assert json.loads(capsys.readouterr().out.splitlines()[-1])["format"] == form
    hub = json.loads((tmp_path / "exports" / "timm-old" / "timm" / "config.json").read_text())
    assert hub == json.loads((tmp_path / "exports" / "timm" / "timm" / "config.json").read_text())
    assert hub["label_names"] == [f"class_{index}" for index in range(hub["num_classes"])]
