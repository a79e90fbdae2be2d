"""Knowledge distillation (DeiT, Touvron et al. 2021): the distillation token, the losses, the teacher
from each source, the training step and the configuration errors."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import SMALL_SYNTHETIC_RUN, make_config
from vitrain.checkpoint.sharded import read_checkpoint_model
from vitrain.config import ConfigError
from vitrain.export import export_model
from vitrain.models import build_model, load_weights
from vitrain.train import make_plan, train
from vitrain.train.build import build_run
from vitrain.train.losses import DistillationLoss, TrainingLoss
from vitrain.weights.teacher import TeacherError, load_teacher, teacher_source_kind

# --- the model ------------------------------------------------------------------------------


def _distilled(**overrides):
    torch.manual_seed(0)
    return build_model("deit_tiny_distilled_patch16", img_size=32, num_classes=5, depth=2, **overrides)


def test_distilled_model_returns_the_mean_of_its_two_heads():
    model = _distilled().eval()
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        cls_logits, dist_logits = model.forward_distill(images)
        logits = model(images)
    assert logits.shape == cls_logits.shape == dist_logits.shape == (3, 5)
    assert not torch.allclose(cls_logits, dist_logits)  # two heads on two tokens
    assert torch.allclose(logits, (cls_logits + dist_logits) / 2)
    model.train()
    assert isinstance(model(images), torch.Tensor)  # plain forward stays one tensor in training too
    model.set_distilled_training(True)
    assert isinstance(model(images), tuple)


def test_distilled_model_protocol_counts_the_second_token():
    model = _distilled()
    assert model.num_prefix_tokens == 2 and model.pos_embed.shape[1] == 2 + 4
    assert {"dist_token", "cls_token", "pos_embed"} <= model.no_weight_decay()
    assert model.layer_id("dist_token") == 0 and model.layer_id("head_dist.weight") == model.num_layers + 1
    with pytest.raises(ValueError, match="head='cls'"):
        _distilled(head="gap")
    with pytest.raises(ValueError, match="distill_token=True"):
        build_model("vit_tiny_patch16", img_size=32, depth=1).forward_distill(torch.zeros(1, 3, 32, 32))


def test_distilled_weights_load_at_another_resolution_keeping_both_prefix_embeddings():
    small = _distilled().eval()
    large = build_model("deit_tiny_distilled_patch16", img_size=64, num_classes=5, depth=2).eval()
    load_weights(large, small.state_dict())
    assert torch.equal(large.pos_embed[:, :2], small.pos_embed[:, :2])
    images = torch.randn(1, 3, 64, 64)
    with torch.no_grad():  # the small model resamples on the fly: the same function
        assert torch.allclose(large(images), small(images), atol=1e-5)


# --- the losses -----------------------------------------------------------------------------


def _logits(seed: int, rows: int = 6, classes: int = 7) -> torch.Tensor:
    return torch.randn(rows, classes, generator=torch.Generator().manual_seed(seed)) * 3


def _soft_by_formula(dist, teacher, tau):
    """KL(p_teacher || p_student) at temperature tau, summed, times tau^2, over the number of logits."""
    p_teacher = torch.softmax(teacher / tau, dim=1)
    log_ratio = torch.log_softmax(teacher / tau, dim=1) - torch.log_softmax(dist / tau, dim=1)
    return (p_teacher * log_ratio).sum() * tau * tau / dist.numel()


def _deit_soft(outputs_kd, teacher_outputs, tau):
    """facebookresearch/deit losses.py DistillationLoss, distillation_type == 'soft', as written there."""
    T = tau  # noqa: N806
    return (
        F.kl_div(
            F.log_softmax(outputs_kd / T, dim=1),
            F.log_softmax(teacher_outputs / T, dim=1),
            reduction="sum",
            log_target=True,
        )
        * (T * T)
        / outputs_kd.numel()
    )


@pytest.mark.parametrize(("alpha", "tau"), [(0.5, 1.0), (0.3, 3.0), (1.0, 0.5)])
def test_soft_distillation_equals_the_formula_and_deits(alpha, tau):
    cls_logits, dist_logits, teacher = _logits(0), _logits(1), _logits(2)
    labels = torch.tensor([0, 1, 2, 3, 4, 5])
    loss = DistillationLoss(TrainingLoss("ce", 0.1), "soft", alpha, tau)(cls_logits, dist_logits, labels, teacher)
    base = F.cross_entropy(cls_logits, labels, label_smoothing=0.1)
    expected = (1 - alpha) * base + alpha * _soft_by_formula(dist_logits, teacher, tau)
    deit = (1 - alpha) * base + alpha * _deit_soft(dist_logits, teacher, tau)
    assert torch.allclose(loss, expected, atol=1e-6) and torch.allclose(loss, deit, atol=1e-6)


def test_hard_distillation_is_cross_entropy_to_the_teachers_top_class_on_soft_targets_too():
    cls_logits, dist_logits, teacher = _logits(3), _logits(4), _logits(5)
    targets = torch.softmax(_logits(6), dim=1)  # a mixed batch's soft targets
    loss = DistillationLoss(TrainingLoss("ce", 0.0), "hard", 0.5, 1.0)(cls_logits, dist_logits, targets, teacher)
    base = -(targets * torch.log_softmax(cls_logits, dim=1)).sum(dim=1).mean()
    top = teacher.argmax(dim=1)
    hard = -torch.log_softmax(dist_logits, dim=1)[torch.arange(6), top].mean()
    assert torch.allclose(loss, 0.5 * base + 0.5 * hard, atol=1e-6)


@pytest.mark.parametrize("kind", ["soft", "hard"])
def test_distillation_gradient_reaches_the_student_only(kind):
    cls_logits, dist_logits = _logits(7).requires_grad_(), _logits(8).requires_grad_()
    teacher = _logits(9).requires_grad_()
    loss = DistillationLoss(TrainingLoss("ce", 0.0), kind, 0.5, 2.0)(
        cls_logits, dist_logits, torch.zeros(6).long(), teacher
    )
    loss.backward()
    assert teacher.grad is None
    assert cls_logits.grad.abs().sum() > 0 and dist_logits.grad.abs().sum() > 0


def test_alpha_weighs_label_loss_against_distillation():
    cls_logits, dist_logits, teacher = _logits(10), _logits(11), _logits(12)
    labels = torch.zeros(6).long()
    only = lambda alpha: DistillationLoss(TrainingLoss("bce", 0.0), "soft", alpha, 1.0)(  # noqa: E731
        cls_logits, dist_logits, labels, teacher
    )
    assert torch.allclose(only(0.0), TrainingLoss("bce", 0.0)(cls_logits, labels))
    assert torch.allclose(only(1.0), _soft_by_formula(dist_logits, teacher, 1.0), atol=1e-6)
    with pytest.raises(ValueError, match="soft or hard"):
        DistillationLoss(TrainingLoss("ce", 0.0), "none", 0.5, 1.0)


# --- the teacher from each source -----------------------------------------------------------

TEACHER_RUN = [*SMALL_SYNTHETIC_RUN, "train.steps=2", "data.synthetic_num_classes=10"]


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    """A 2-step 14 px run of vit_tiny6_patch7 on 10 classes: its folder and its model (eval)."""
    folder = tmp_path_factory.mktemp("teacher") / "run"
    plan = make_plan(make_config(*TEACHER_RUN, f"train.out_dir={folder}"))
    train(plan)
    checkpoint = sorted((folder / "checkpoints").glob("step-*.pt"))[-1]
    weights, _ = read_checkpoint_model(checkpoint)
    model = build_model("vit_tiny6_patch7", img_size=14, num_classes=10)
    model.load_state_dict(weights)
    return folder, checkpoint, model.eval()


def _assert_same_logits(teacher, reference, size=14):
    images = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(teacher(images), reference(images), atol=1e-6)
    assert not teacher.training and all(not param.requires_grad for param in teacher.parameters())


def test_teacher_from_a_run_folder_its_checkpoint_and_its_export(teacher_run, tmp_path):
    folder, checkpoint, reference = teacher_run
    exported = tmp_path / "teacher.safetensors"
    export_model(checkpoint, exported)
    assert [teacher_source_kind(s) for s in (folder, checkpoint, exported)] == ["run", "checkpoint", "safetensors"]
    for source in (folder, checkpoint, exported):
        _assert_same_logits(load_teacher(source, num_classes=10, image_sizes=[14, 28]), reference)


def test_teacher_from_bare_safetensors_needs_its_model_name(teacher_run, tmp_path):
    from safetensors.torch import save_file

    _, _, reference = teacher_run
    bare = tmp_path / "bare.safetensors"
    save_file({key: value.contiguous() for key, value in reference.state_dict().items()}, str(bare))
    with pytest.raises(TeacherError, match="train.distill.teacher_model"):
        load_teacher(bare, num_classes=10)
    _assert_same_logits(load_teacher(bare, model="vit_tiny6_patch7", num_classes=10), reference)


@pytest.fixture
def timm():
    return pytest.importorskip("timm", reason="timm is a test dependency ([dev] extra)")


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_teacher_from_a_timm_name_and_a_local_weights_file(timm, tmp_path, suffix):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    reference = timm.create_model("resnet18", pretrained=False, num_classes=10).eval()
    path = tmp_path / f"resnet18{suffix}"
    if suffix == ".safetensors":
        save_file(reference.state_dict(), str(path))
    else:
        torch.save({"model": reference.state_dict()}, path)  # DeiT's checkpoint layout
    _assert_same_logits(load_teacher("resnet18", weights=path, num_classes=10, image_sizes=[14]), reference)


def test_bad_teachers_are_clear_errors(timm, teacher_run, tmp_path):
    _, checkpoint, _ = teacher_run
    with pytest.raises(TeacherError, match="10 classes but the data has 5"):
        load_teacher(checkpoint, num_classes=5)
    with pytest.raises(TeacherError, match="does not exist"):
        load_teacher(tmp_path / "missing.pt", num_classes=10)
    with pytest.raises(TeacherError, match="neither a file nor a timm model name"):
        load_teacher("not_a_model_xyz", weights=checkpoint, num_classes=10)
    with pytest.raises(TeacherError, match="teacher_weights=PATH"):
        load_teacher("resnet18", num_classes=10)
    weights = tmp_path / "resnet18.safetensors"
    from safetensors.torch import save_file

    save_file(timm.create_model("resnet18", pretrained=False, num_classes=10).state_dict(), str(weights))
    with pytest.raises(TeacherError, match="10 classes but the data has 1000"):
        load_teacher("resnet18", weights=weights, num_classes=1000)


def test_a_fixed_size_teacher_refuses_other_image_sizes_naming_both(timm, tmp_path):
    from safetensors.torch import save_file

    weights = tmp_path / "deit.safetensors"
    save_file(timm.create_model("deit_tiny_patch16_224", pretrained=False, num_classes=3).state_dict(), str(weights))
    with pytest.raises(TeacherError, match="takes 224x224 images but the student trains on 32 px"):
        load_teacher("deit_tiny_patch16_224", weights=weights, num_classes=3, image_sizes=[224, 32])


# --- training with a teacher ----------------------------------------------------------------


def _student(folder, tmp_path, *extra):
    return make_config(
        *TEACHER_RUN,
        "model.distill_token=true",
        "train.distill.kind=hard",
        f"train.distill.teacher={folder}",
        f"train.out_dir={tmp_path / 'student'}",
        *extra,
    )


@pytest.mark.parametrize("kind", ["hard", "soft"])
@pytest.mark.parametrize("micro", [None, 6])
def test_the_step_loss_is_the_distillation_loss_and_both_heads_learn(teacher_run, tmp_path, kind, micro):
    folder, _, reference = teacher_run
    extra = [f"train.distill.kind={kind}", "train.distill.tau=2.0", "data.mixup=0.8"]
    run = build_run(make_plan(_student(folder, tmp_path, *extra, f"train.micro_batch_size={micro or 'null'}")))
    images = torch.randn(16, 3, 14, 14, generator=torch.Generator().manual_seed(0))
    targets = torch.softmax(torch.randn(16, 10, generator=torch.Generator().manual_seed(1)), dim=1)
    before = copy.deepcopy(run.model).train()
    with torch.no_grad():
        cls_logits, dist_logits = before.forward_distill(images)
        expected = DistillationLoss(TrainingLoss("ce", 0.1), kind, 0.5, 2.0)(
            cls_logits, dist_logits, targets, reference(images)
        )
    loss, _ = run.step_fn(images, targets)
    assert torch.isfinite(loss) and torch.allclose(loss, expected, atol=1e-5)
    assert run.model.head_dist.weight.grad.abs().sum() > 0 and run.model.dist_token.grad.abs().sum() > 0
    teacher = run.step_fn.objective.teacher
    assert all(param.grad is None and not param.requires_grad for param in teacher.parameters())
    optimized = {id(param) for group in run.optimizer.param_groups for param in group["params"]}
    assert not optimized & {id(param) for param in teacher.parameters()}
    assert not run.model.distilled_training  # set for the step's forward only


@pytest.mark.parametrize(
    "settings",
    [
        ["precision=fp32"],
        ["precision=bf16", "precision_mode=o2", "performance.cpu_kernels=native"],
        ["performance.compile=true", "performance.compile_backend=eager", "train.micro_batch_size=8"],
        ["model.distill_token=false", "train.distill.kind=soft"],  # the class head learns from both
    ],
    ids=["fp32", "bf16-o2", "compile", "no-token"],
)
def test_a_short_distilled_run_trains_and_evaluates(teacher_run, tmp_path, settings, one_thread):
    folder, _, _ = teacher_run
    summary = train(make_plan(_student(folder, tmp_path, "data.cutmix=1.0", *settings)))
    assert summary["steps"] == 2 and summary["skipped_steps"] == 0
    lines = [json.loads(line) for line in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()]
    losses = [line["loss"] for line in lines if "loss" in line and line.get("event") != "eval"]
    assert losses and all(torch.isfinite(torch.tensor(losses)))


# --- configuration errors -------------------------------------------------------------------


def test_distillation_config_mistakes_are_refused_in_resolve(teacher_run, tmp_path):
    folder, _, _ = teacher_run
    cases = {
        "needs a teacher": ["train.distill.kind=hard"],
        "no effect without distillation": [f"train.distill.teacher={folder}"],
        "--set train.distill.teacher_weights=PATH": ["train.distill.kind=hard", "train.distill.teacher=regnety_160"],
        "no such run folder or file": ["train.distill.kind=soft", f"train.distill.teacher={tmp_path / 'nowhere'}"],
        "remove train.distill.teacher_weights": [
            "train.distill.kind=soft",
            f"train.distill.teacher={folder}",
            f"train.distill.teacher_weights={folder / 'config.yaml'}",
        ],
        "not an option of resnet50": ["model.name=resnet50", "model.distill_token=true"],
        "model.head=gap": ["model.distill_token=true", "model.head=gap"],
        "train.distill.alpha": ["train.distill.alpha=1.5"],
        "train.distill.tau": ["train.distill.tau=0"],
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            make_plan(make_config(*TEACHER_RUN, *overrides))


def test_a_teacher_for_other_classes_fails_at_build_naming_both_counts(teacher_run, tmp_path):
    folder, _, _ = teacher_run
    plan = make_plan(_student(folder, tmp_path, "data.synthetic_num_classes=4"))
    with pytest.raises(ConfigError, match=r"train.distill.teacher=.*10 classes but the data has 4"):
        build_run(plan)


def test_a_distilled_student_exports_evaluates_by_the_mean_and_fine_tunes(teacher_run, tmp_path, one_thread):
    from vitrain.models import load_pretrained

    folder, _, _ = teacher_run
    train(make_plan(_student(folder, tmp_path)))
    checkpoint = sorted((tmp_path / "student" / "checkpoints").glob("step-*.pt"))[-1]
    exported = tmp_path / "student.safetensors"
    export_model(checkpoint, exported)
    student = load_teacher(exported, num_classes=10)  # the export's metadata rebuilds the distilled model
    assert student.args.distill_token
    weights, _ = read_checkpoint_model(checkpoint)
    images = torch.randn(2, 3, 14, 14)
    with torch.no_grad():
        cls_logits, dist_logits = student.forward_distill(images)
        assert torch.allclose(student(images), (cls_logits + dist_logits) / 2)
    assert torch.equal(student.head_dist.weight, weights["head_dist.weight"])
    finetuned = build_model("vit_tiny6_patch7", img_size=28, num_classes=3, distill_token=True)
    assert sorted(load_pretrained(finetuned, weights)) == [
        "head.bias",
        "head.weight",
        "head_dist.bias",
        "head_dist.weight",
    ]
    assert torch.equal(finetuned.dist_token, weights["dist_token"])
