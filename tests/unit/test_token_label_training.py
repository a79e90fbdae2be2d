"""Training with token labels: the crop geometry the loaders record, the step's loss with MixToken, the
evaluation of both heads, the config and label-map mistakes, and whole runs (resume, curriculum, O2 + compile,
image folders with a bad file, `vitrain eval` without the maps)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import assert_same_training_state, make_config
from tests.unit.test_label_maps import SYNTHETIC
from vitrain.checkpoint import find_latest_checkpoint
from vitrain.cli import main
from vitrain.config import ConfigError, precision_policy
from vitrain.data import build_loaders
from vitrain.data.loader import epoch_order
from vitrain.metrics import read_jsonl
from vitrain.models import build_model
from vitrain.token_labeling import TokenBox, token_labeling_loss
from vitrain.train import make_plan, train
from vitrain.train.build import build_training_step
from vitrain.train.evaluate import evaluate


def _set(settings):
    return [arg for setting in settings for arg in ("--set", setting)]


def _save_teacher(path: Path, num_classes: int, seed: int = 3) -> Path:
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    teacher = build_model("vit_tiny6_patch7", img_size=14, num_classes=num_classes)
    metadata = {"format": "vitrain-model-v1", "config": json.dumps({"model": {"name": "vit_tiny6_patch7"}})}
    save_file(teacher.state_dict(), str(path), metadata=metadata)
    return path


@pytest.fixture(scope="module")
def maps(tmp_path_factory) -> Path:
    """Top-3 label maps (2x2 grid) of a 14 px ViT teacher over the 40 synthetic training images."""
    folder = tmp_path_factory.mktemp("token-labels")
    teacher = _save_teacher(folder / "teacher.safetensors", 10)
    argv = ["label", "--teacher", str(teacher), "--out", str(folder / "maps"), "--topk", "3", "--shard-size", "16"]
    assert main([*argv, *_set(SYNTHETIC)]) == 0
    return folder / "maps"


def _run_settings(maps: Path, *extra: str) -> list[str]:
    return [
        *SYNTHETIC,
        "model.aux_head=true",
        f"token_labels.maps={maps}",
        "data.scale=[0.3, 1.0]",
        "token_labels.mix_token=true",
        *extra,
    ]


# --- the config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["token_labels.maps=null"], "token_labels.mix_token=True has no effect without token labels"),
        (["data.mixup=0.8"], "data.mixup with token_labels.maps"),
        (["data.cutmix=1.0"], "data.cutmix with token_labels.maps"),
        (["data.translate=2"], "data.translate=2 with token_labels.maps"),
        (["model.aux_head=false"], "set model.aux_head=true"),
        (["train.loss=bce"], "set train.loss=ce"),
        (["token_labels.maps=/no/such/maps"], "token_labels.maps=/no/such/maps: no such folder"),
    ],
)
def test_config_mistakes_exit_2_naming_the_keys(maps, tmp_path, capsys, extra, message):
    settings = _run_settings(maps, f"train.out_dir={tmp_path / 'run'}", "train.epochs=1", *extra)
    assert main(["train", *_set(settings)]) == 2
    assert message in capsys.readouterr().err


def test_a_model_without_a_token_grid_is_refused(maps):
    settings = [setting for setting in _run_settings(maps) if not setting.startswith("model.")]
    with pytest.raises(ConfigError, match="resnet50 has no token grid to label"):
        make_plan(make_config(*settings, "model.name=resnet50"))


def test_distillation_with_token_labels_is_refused(maps, tmp_path, capsys):
    teacher = maps.parent / "teacher.safetensors"
    settings = _run_settings(maps, "train.distill.kind=soft", f"train.distill.teacher={teacher}", "train.epochs=1")
    assert main(["train", *_set(settings)]) == 2
    assert "use one teacher signal" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("classes", "10"),  # maps of 10 classes for a 5-class run
        ("count", "40"),  # maps of 40 images for 32
        ("shard", "shard-00001"),
        ("index", "index.json"),
    ],
)
def test_bad_label_map_folders_stop_with_exit_2_naming_the_file(maps, tmp_path, capsys, damage, message):
    folder = shutil.copytree(maps, tmp_path / "maps")
    extra = [f"token_labels.maps={folder}", f"train.out_dir={tmp_path / 'run'}", "train.epochs=1"]
    if damage == "classes":
        extra.append("data.synthetic_num_classes=5")
    elif damage == "count":
        extra.append("data.synthetic_num_train=32")
    elif damage == "shard":
        shutil.rmtree(folder / "shard-00001")
    else:
        (folder / "index.json").write_text("{not json")
    assert main(["train", *_set(_run_settings(maps, *extra))]) == 2
    error = capsys.readouterr().err
    assert message in error and str(folder) in error, error


# --- the geometry the loaders record -------------------------------------------------------------


def _ramp(height: int, width: int) -> np.ndarray:
    """Pixel value = 255 * x / (width - 1) on every row and channel."""
    row = np.round(np.linspace(0, 255, width)).astype(np.uint8)
    return np.broadcast_to(row, (height, width)).copy()


def _first_column_x(images: torch.Tensor, width: int) -> torch.Tensor:
    """The source x (pixels) that each crop's first output column shows, read off the ramp."""
    return images[:, 0, :, 0].float().mean(1) / 255 * (width - 1)


def _expected_first_column_x(geometry: torch.Tensor, width: int, size: int) -> torch.Tensor:
    x1, x2, flipped = geometry[:, 1] * width, geometry[:, 3] * width, geometry[:, 5] > 0.5
    step = (x2 - x1) / size
    left, right = x1 + step / 2 - 0.5, x2 - step / 2 - 0.5  # centres of the first and last output pixels
    return torch.where(flipped, right, left).float().clamp(0, width - 1)


def test_in_memory_batches_carry_index_box_and_flip_of_each_crop(maps):
    plan = make_plan(make_config(*_run_settings(maps, "data.hflip=0.5", "data.image_size=14")))
    assert plan.data.crop_geometry
    train_loader, eval_loader = build_loaders(plan.data)
    source = train_loader.dataset.images
    width = source.shape[-1]
    source[:] = torch.from_numpy(_ramp(*source.shape[-2:]))
    train_loader.start_epoch(1)
    batches = list(train_loader)
    assert all(len(batch) == 3 for batch in batches) and all(len(batch) == 2 for batch in eval_loader)
    geometry = torch.cat([batch[2] for batch in batches])
    assert geometry.dtype == torch.float64 and geometry.shape == (40, 6)
    assert torch.equal(geometry[:, 0].long(), epoch_order(40, plan.seed, 1))
    boxes = geometry[:, 1:5]
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2:] <= 1 + 1e-9).all() and (boxes[:, 2:] > boxes[:, :2]).all()
    assert 0 < geometry[:, 5].sum() < 40  # some flipped, some not
    images = torch.cat([batch[0] for batch in batches])
    seen, expected = _first_column_x(images, width), _expected_first_column_x(geometry, width, 14)
    assert torch.allclose(seen, expected, atol=0.6), (seen - expected).abs().max()


def _ramp_folder(root: Path) -> Path:
    for name in ("a", "b"):
        for split in ("train", "val"):
            (root / split / name).mkdir(parents=True)
        for number in range(4):
            Image.fromarray(_ramp(30, 40)).convert("RGB").save(root / "train" / name / f"{name}{number}.png")
        Image.fromarray(_ramp(30, 40)).convert("RGB").save(root / "val" / name / "v.png")
    (root / "train" / "a" / "a1.png").write_bytes(b"broken")
    return root


FOLDER = [
    "precision=fp32",
    "model.name=vit_tiny6_patch7",
    "data.name=imagefolder",
    "data.image_size=14",
    "data.num_workers=0",
    "data.max_bad_fraction=0.5",
    "train.batch_size=4",
    "train.progress=off",
]


@pytest.fixture(scope="module")
def folder_maps(tmp_path_factory) -> tuple[Path, Path]:
    """An image folder of ramps (one training file broken) and its label maps."""
    base = tmp_path_factory.mktemp("folder")
    root = _ramp_folder(base / "data")
    teacher = _save_teacher(base / "teacher.safetensors", 2)
    argv = ["label", "--teacher", str(teacher), "--out", str(base / "maps"), "--topk", "2", "--shard-size", "4"]
    assert main([*argv, *_set([*FOLDER, f"data.root={root}"])]) == 0
    return root, base / "maps"


def test_file_batches_carry_the_file_used_and_its_crop(folder_maps):
    root, maps = folder_maps
    settings = [*FOLDER, f"data.root={root}", "model.aux_head=true", f"token_labels.maps={maps}", "data.hflip=0.5"]
    plan = make_plan(make_config(*settings))
    train_loader, _ = build_loaders(plan.data)
    train_loader.start_epoch(0)
    batches = list(train_loader)
    geometry = torch.cat([batch[2] for batch in batches])
    labels = torch.cat([batch[1] for batch in batches])
    used = geometry[:, 0].long()
    assert 1 not in used.tolist()  # a/a1.png is broken: its slot took the next file, a/a2.png (index 2)
    assert torch.equal(labels, torch.tensor([train_loader.samples[index][1] for index in used]))
    images = torch.cat([batch[0] for batch in batches])
    seen, expected = _first_column_x(images, 40), _expected_first_column_x(geometry, 40, 14)
    assert torch.allclose(seen, expected, atol=1.0), (seen - expected).abs().max()


# --- the step and evaluation ---------------------------------------------------------------------


def test_the_step_loss_is_token_labeling_loss_of_the_mixed_forward(maps):
    plan = make_plan(make_config(*_run_settings(maps, "optim.name=sgd")))
    step = build_training_step(plan)
    model, hook = step.model, step.objective.mix_token
    torch.manual_seed(0)
    images = torch.randn(8, 3, 14, 14)
    targets = torch.rand(8, 10, 5).softmax(1)
    box, lam = TokenBox(0, 1, 0, 2), 0.5  # the top row of the 2x2 grid from the partner
    with torch.no_grad():
        for head in (model.head, model.aux_head):  # logits far from uniform: the loss tells forwards apart
            head.weight.mul_(30)
        model.set_aux_output(True)
        with hook.mixing(box, (2, 2)):
            cls_logits, aux_logits = model(images)
            aux_logits = hook.unmix(aux_logits)
        plain = model(images)
        model.set_aux_output(False)
    expected = token_labeling_loss(cls_logits, aux_logits, targets[:, :, 0], targets[:, :, 1:], lam, 0.5, 1.0)
    unmixed = token_labeling_loss(plain[0], plain[1], targets[:, :, 0], targets[:, :, 1:], 1.0, 0.5, 1.0)
    before = model.aux_head.weight.detach().clone()
    loss, _ = step(images, targets, token_box=(box, lam))
    assert torch.allclose(loss, expected, rtol=1e-5) and not torch.allclose(loss, unmixed, rtol=1e-3), (loss, unmixed)
    assert not torch.equal(model.aux_head.weight, before)  # the dense loss trains the auxiliary head
    assert hook.box is None and not model.aux_output  # nothing stays set after the step


def test_evaluation_scores_the_prediction_and_the_class_head_alone():
    torch.manual_seed(1)
    model = build_model("vit_tiny6_patch7", img_size=14, num_classes=4, aux_head=True)
    images, labels = torch.randn(12, 3, 14, 14), torch.randint(0, 4, (12,))
    result = evaluate(model, [(images, labels)], lambda x: x, precision_policy("fp32", "autocast", "cpu"))
    model.eval()
    with torch.no_grad():
        tokens = model.forward_features(images)
        cls_logits, aux_logits = model.forward_head_with_tokens(tokens)
    combined = cls_logits + 0.5 * aux_logits.amax(1)
    assert result["top1"] == pytest.approx(100 * (combined.argmax(1) == labels).float().mean().item())
    assert result["cls_top1"] == pytest.approx(100 * (cls_logits.argmax(1) == labels).float().mean().item())
    assert not model.aux_output


# --- whole runs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_run(maps, tmp_path_factory):
    """3 epochs with MixToken and a curriculum (grid 2x2 at 14 px, 4x4 at 28 px), a checkpoint per step."""
    out_dir = tmp_path_factory.mktemp("tl-run") / "run"
    overrides = _run_settings(
        maps,
        f"train.out_dir={out_dir}",
        "train.epochs=3",
        "train.log_every_steps=2",
        "token_labels.ground_truth=true",
        "data.image_size=28",
        "curriculum.stages=[{until: 0.5, image_size: 14}]",
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan = make_plan(make_config(*overrides, "checkpoint.every_steps=1", "checkpoint.keep_last=1000"))
        summary = train(plan)
    finally:
        torch.set_num_threads(threads)
    return plan, overrides, summary


def test_a_run_trains_through_the_curriculum_and_reports_both_heads(reference_run):
    plan, _, summary = reference_run
    records = read_jsonl(plan.out_dir / "metrics.jsonl")
    sizes = {record["image_size"] for record in records if record["event"] == "train"}
    assert sizes == {14, 28}
    losses = [record["loss"] for record in records if record["event"] == "train"]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    evals = [record for record in records if record["event"] == "eval"]
    assert all("cls_top1" in record for record in evals)
    assert summary["final_cls_top1"] == evals[-1]["cls_top1"]


def test_resume_mid_run_is_bitwise_equal_to_the_uninterrupted_run(reference_run, tmp_path, one_thread):
    plan, overrides, _ = reference_run
    final = find_latest_checkpoint(plan.out_dir)
    for step in (4, 11):  # mid-epoch in the first stage; in the second
        folder = tmp_path / f"from-{step}"
        (folder / "checkpoints").mkdir(parents=True)
        shutil.copy(plan.out_dir / "checkpoints" / f"step-{step:09d}.pt", folder / "checkpoints")
        train(make_plan(make_config(*overrides, f"train.out_dir={folder}")), resume="auto")
        assert_same_training_state(find_latest_checkpoint(folder), final)


def test_vitrain_eval_needs_no_label_maps_and_reports_both_heads(reference_run, tmp_path, capsys):
    plan, _, _ = reference_run
    checkpoint = tmp_path / "step.pt"
    shutil.copy(find_latest_checkpoint(plan.out_dir), checkpoint)
    config = json.loads(json.dumps(torch.load(checkpoint, weights_only=False)["config"]))
    maps = plan.step.token_labels.maps
    assert config["token_labels"]["maps"] == str(maps)  # the run's maps are named in the checkpoint...
    moved = maps.with_name("moved")
    maps.rename(moved)  # ...and are gone
    try:
        assert main(["eval", "--checkpoint", str(checkpoint)]) == 0
    finally:
        moved.rename(maps)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"top1", "cls_top1", "cls_top5"} <= result.keys()


@pytest.mark.parametrize(
    "extra",
    [
        ["precision=bf16", "precision_mode=o2"],
        ["performance.compile=true", "performance.compile_backend=eager", "train.micro_batch_size=4"],
        [
            "performance.activation_checkpointing=all",
            "model.name=volo_d1",
            "data.image_size=32",
            "model.aux_head=null",
            "model.head=null",
        ],
    ],
    ids=["bf16-o2", "compile", "volo-act-ckpt"],
)
def test_token_labels_train_with_other_precisions_compile_and_volo(maps, tmp_path, extra, one_thread):
    settings = _run_settings(maps, f"train.out_dir={tmp_path / 'run'}", "train.epochs=1", *extra)
    assert main(["train", *_set(settings)]) == 0
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(np.isfinite(record["loss"]) for record in records if record["event"] == "train")
    assert "cls_top1" in [record for record in records if record["event"] == "eval"][-1]


def test_an_image_folder_run_trains_on_the_maps_of_the_files_it_reads(folder_maps, tmp_path):
    root, maps = folder_maps
    settings = [*FOLDER, f"data.root={root}", "model.aux_head=true", f"token_labels.maps={maps}", "data.hflip=0.5"]
    settings += ["token_labels.mix_token=true", "train.epochs=2", f"train.out_dir={tmp_path / 'run'}"]
    assert main(["train", *_set(settings)]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert sum(summary["bad_images"].values()) == 1  # a/a1.png, replaced by the next file and its map
    assert summary["final_cls_top1"] is not None
