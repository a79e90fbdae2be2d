"""Mixup/CutMix and the training losses: equal to timm's ``Mixup``, ``SoftTargetCrossEntropy`` and
``BinaryCrossEntropy`` on the same draws and inputs; refused settings; a run that mixes resumes bitwise."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import timm.data.mixup as timm_mixup
import torch
import torch.nn.functional as F
from timm.loss import BinaryCrossEntropy, SoftTargetCrossEntropy

from tests.conftest import assert_same_training_state, make_config
from vitrain.checkpoint import find_latest_checkpoint
from vitrain.config import ConfigError, DatasetInfo, Hardware, MixPlan, World, resolve
from vitrain.data.mixing import (
    BatchMixer,
    MixDraw,
    apply_mix_to_images,
    apply_mix_to_targets,
    cutmix_box,
    mixing_generator,
    smoothed_one_hot,
)
from vitrain.metrics import read_jsonl
from vitrain.models import model_facts
from vitrain.train import make_plan, train
from vitrain.train.losses import TrainingLoss
from vitrain.train.step import TrainStep

NUM_CLASSES = 10


class GeneratorAsLegacyRandom:
    """NumPy's legacy global-random calls that timm's mixup makes, answered by a seeded Generator with the
    calls vitrain's mixer makes: both then see the same numbers in the same order."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def rand(self, *shape):
        return self.rng.random(shape[0] if shape else None)

    def beta(self, a, b, size=None):
        return self.rng.beta(a, b, size)

    def randint(self, low, high=None, size=None):
        return self.rng.integers(low, high, size)


class NumpyWithRandom:
    """The numpy module as timm's mixup sees it, its ``random`` calls answered by a seeded Generator."""

    def __init__(self, rng: np.random.Generator):
        self.random = GeneratorAsLegacyRandom(rng)

    def __getattr__(self, name: str):
        return getattr(np, name)


def timm_with_generator(monkeypatch, rng: np.random.Generator) -> None:
    """Route timm.data.mixup's ``np.random`` calls to ``rng`` (the rest of NumPy unchanged)."""
    monkeypatch.setattr(timm_mixup, "np", NumpyWithRandom(rng))


def mix_plan(**changes) -> MixPlan:
    settings = dict(
        mixup_alpha=0.8,
        cutmix_alpha=1.0,
        cutmix_minmax=None,
        prob=1.0,
        switch_prob=0.5,
        mode="batch",
        label_smoothing=0.1,
        num_classes=NUM_CLASSES,
    )
    return MixPlan(**{**settings, **changes})


def timm_mixup_of(plan: MixPlan) -> timm_mixup.Mixup:
    return timm_mixup.Mixup(
        mixup_alpha=plan.mixup_alpha,
        cutmix_alpha=plan.cutmix_alpha,
        cutmix_minmax=plan.cutmix_minmax,
        prob=plan.prob,
        switch_prob=plan.switch_prob,
        mode=plan.mode,
        correct_lam=True,
        label_smoothing=plan.label_smoothing,
        num_classes=plan.num_classes,
    )


def normalized_batch(size: int = 8, side: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(size + side)
    images = torch.randn(size, 3, side, side + 2, generator=generator)  # not square: rows and columns differ
    return images, torch.randint(0, NUM_CLASSES, (size,), generator=generator)


SETTINGS = {
    "both": {},
    "mixup": {"cutmix_alpha": 0.0},
    "cutmix": {"mixup_alpha": 0.0},
    "minmax": {"cutmix_minmax": (0.2, 0.8), "mixup_alpha": 0.0},
    "half-mixed": {"prob": 0.5},
    "switch-always": {"switch_prob": 1.0},
}


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_mixed_images_and_targets_equal_timm_s_for_the_same_draws(monkeypatch, mode, setting):
    plan = mix_plan(mode=mode, **SETTINGS[setting])
    ours, theirs = BatchMixer(plan), timm_mixup_of(plan)
    mixed_any = pasted_any = False
    for seed in range(6):  # per batch: unmixed, Mixup and CutMix batches among the seeds
        images, labels = normalized_batch()
        mixed, targets = ours(images, labels, np.random.default_rng(seed))
        timm_with_generator(monkeypatch, np.random.default_rng(seed))
        timm_images, timm_targets = theirs(images.clone(), labels)
        assert torch.equal(mixed, timm_images), seed
        assert torch.equal(targets, timm_targets), seed
        mixed_any |= not torch.equal(mixed, images)
        pasted_any |= bool(((mixed == images.flip(0)) & (mixed != images)).any())
    assert mixed_any
    assert pasted_any == (plan.cutmix_alpha > 0)


def test_cutmix_lam_is_the_area_of_the_box_clipped_to_the_image(monkeypatch):
    """A box of side sqrt(1 - lam) centred on the top-left corner keeps a quarter: lam rises to match."""

    class Corner:
        def integers(self, low, high=None, size=None):
            return 0

    (top, bottom, left, right), lam = cutmix_box(20, 20, 0.36, None, Corner())  # sides 16, centre (0, 0)
    assert (top, bottom, left, right) == (0, 8, 0, 8)
    assert lam == pytest.approx(1 - 64 / 400)
    monkeypatch.setattr(timm_mixup.np.random, "randint", lambda *args, **kwargs: 0)
    assert timm_mixup.cutmix_bbox_and_lam((3, 20, 20), 0.36) == ((0, 8, 0, 8), lam)

    images, labels = normalized_batch(4, 20)
    images = images[..., :20]
    draw = MixDraw(np.full(4, lam), np.ones(4), np.tile([top, bottom, left, right], (4, 1)))
    mixed = apply_mix_to_images(images, draw)
    pasted = (mixed == images.flip(0)) & (mixed != images)
    assert pasted.sum().item() == 4 * 3 * 64
    assert torch.equal(mixed[..., :8, :8], images.flip(0)[..., :8, :8])
    assert torch.equal(mixed[..., 8:, :], images[..., 8:, :])
    targets = apply_mix_to_targets(smoothed_one_hot(labels, NUM_CLASSES, 0.0), draw)
    own = targets[torch.arange(4), labels]
    expected = torch.where(labels == labels.flip(0), 1.0, lam).float()
    assert torch.allclose(own, expected)


def test_mixing_draws_depend_on_seed_slice_epoch_and_step():
    draws = [mixing_generator(0, *position).random() for position in [(0, 0, 5), (1, 0, 5), (0, 1, 5), (0, 0, 6)]]
    assert len(set(draws)) == 4
    assert mixing_generator(0, 1, 0, 5).random() == draws[1]


def soft_targets(count: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = normalized_batch(count)
    targets = BatchMixer(mix_plan(mode="elem", cutmix_alpha=0.0))(images, labels, np.random.default_rng(1))[1]
    logits = torch.randn(count, NUM_CLASSES, generator=torch.Generator().manual_seed(3)) * 3
    return logits, targets


def test_soft_target_cross_entropy_equals_timm_s():
    logits, targets = soft_targets()
    assert len(set(targets.max(1).values.tolist())) > 1  # really mixed rows
    assert torch.allclose(TrainingLoss("ce", 0.1)(logits, targets), SoftTargetCrossEntropy()(logits, targets))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_binary_cross_entropy_equals_timm_s_on_soft_targets_and_labels(smoothing):
    logits, targets = soft_targets()
    ours, theirs = TrainingLoss("bce", smoothing), BinaryCrossEntropy(smoothing=smoothing)
    assert torch.allclose(ours(logits, targets), theirs(logits, targets))
    labels = targets.argmax(1)
    assert torch.allclose(ours(logits, labels), theirs(logits, labels))
    assert not torch.allclose(ours(logits, labels), TrainingLoss("ce", smoothing)(logits, labels))


def test_mix_prob_zero_leaves_the_batch_and_gives_label_smoothed_cross_entropy():
    images, labels = normalized_batch()
    for mode in ("batch", "pair", "elem"):
        mixed, targets = BatchMixer(mix_plan(prob=0.0, mode=mode))(images, labels, np.random.default_rng(0))
        assert torch.equal(mixed, images)
        assert torch.equal(targets, smoothed_one_hot(labels, NUM_CLASSES, 0.1))
        logits = torch.randn(len(labels), NUM_CLASSES)
        plain = F.cross_entropy(logits, labels, label_smoothing=0.1)
        assert torch.allclose(TrainingLoss("ce", 0.1)(logits, targets), plain)
        assert torch.allclose(TrainingLoss("ce", 0.1)(logits, labels), plain)


DATA = DatasetInfo(num_train=60000, num_eval=10000, num_classes=10, channels=1, mean=(0.5,), std=(0.25,))
CPU_ONLY = Hardware(cuda_available=False, bf16_supported=False)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["data.mixup=-0.2"], "data.mixup"),
        (["data.cutmix=-1"], "data.cutmix"),
        (["data.mix_prob=1.5"], "data.mix_prob"),
        (["data.mix_switch_prob=-0.1"], "data.mix_switch_prob"),
        (["data.mix_mode=pairs"], "data.mix_mode"),
        (["data.cutmix_minmax=[0.6, 0.3]"], "data.cutmix_minmax"),
        (["data.cutmix_minmax=[0.0, 0.5]"], "data.cutmix_minmax"),
        (["data.cutmix_minmax=[0.5, 1.2]"], "data.cutmix_minmax"),
        (["train.loss=focal"], "train.loss"),
    ],
)
def test_bad_mixing_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        make_config(*overrides)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        # 2 processes share a batch of 6: 3 images each cannot pair
        (["data.mixup=0.8", "data.mix_mode=pair", "train.batch_size=6"], "data.mix_mode=pair"),
        (["data.cutmix=1", "data.mix_mode=elem", "train.batch_size=6"], "data.mix_mode=elem"),
        # a curriculum stage's batch counts too
        (
            [
                "data.mixup=0.8",
                "data.mix_mode=elem",
                "curriculum.stages=[{until: 0.5, image_size: 14, batch_size: 10}]",
            ],
            "data.mix_mode=elem",
        ),
        # at 14 px, 0.30 and 0.35 of a side are both 4 pixels
        (["data.cutmix_minmax=[0.3, 0.35]", "curriculum.stages=[{until: 0.5, image_size: 14}]"], "data.cutmix_minmax"),
    ],
)
def test_resolve_refuses_mixing_it_cannot_do(overrides, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        resolve(make_config(*overrides), DATA, CPU_ONLY, model_facts, world=World(0, 2))


def test_resolve_hands_the_loader_its_mixing_and_the_step_its_loss():
    plan = resolve(make_config("data.cutmix_minmax=[0.2, 0.8]", "train.loss=bce"), DATA, CPU_ONLY, model_facts)
    assert plan.data.mixing == mix_plan(mixup_alpha=0.0, cutmix_minmax=(0.2, 0.8), num_classes=DATA.num_classes)
    assert plan.step.loss == "bce"
    assert (
        resolve(make_config("data.mix_mode=elem", "train.batch_size=7"), DATA, CPU_ONLY, model_facts).data.mixing
        is None
    )
    # the batch mode flips the batch: an odd batch's middle image is its own partner (not mixed)
    odd = resolve(make_config("data.mixup=0.8", "train.batch_size=7"), DATA, CPU_ONLY, model_facts)
    assert odd.data.mixing.mode == "batch"


MIXING = [
    "data.mixup=0.8",
    "data.cutmix=1.0",
    "data.mix_mode=elem",
    "data.mix_prob=0.8",
    "train.micro_batch_size=8",  # mixed as one batch of 16, then stepped in halves
    "model.drop_path_rate=0.1",
    "train.epochs=2",
    "train.log_every_steps=3",
]


@pytest.fixture
def target_shapes(monkeypatch) -> list[tuple[int, ...]]:
    """The shape of the targets every training step receives."""
    shapes: list[tuple[int, ...]] = []
    original = TrainStep.__call__

    def recording_step(self, images, labels):
        shapes.append(tuple(labels.shape))
        return original(self, images, labels)

    monkeypatch.setattr(TrainStep, "__call__", recording_step)
    return shapes


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("loss", ["ce", "bce"])
def test_a_mixing_run_trains_and_resumes_bitwise(small_synthetic_overrides, tmp_path, target_shapes, loss):
    overrides = [*small_synthetic_overrides, *MIXING, f"train.loss={loss}"]
    straight = make_plan(make_config(*overrides, "checkpoint.every_steps=1", "checkpoint.keep_last=100"))
    summary = train(straight)
    assert target_shapes == [(16, 10)] * 12  # every step took soft targets
    losses = [record["loss"] for record in read_jsonl(straight.out_dir / "metrics.jsonl") if record["event"] == "train"]
    assert all(np.isfinite(losses)) and np.mean(losses[-3:]) < np.mean(losses[:3])  # one per step
    assert summary["final_top1"] is not None
    final = find_latest_checkpoint(straight.out_dir)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(straight.out_dir / "checkpoints" / "step-000000007.pt", resumed / "checkpoints")
    train(make_plan(make_config(*overrides, f"train.out_dir={resumed}")), resume="auto")
    assert_same_training_state(find_latest_checkpoint(resumed), final)
