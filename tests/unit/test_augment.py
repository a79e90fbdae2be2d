"""The DeiT / DeiT III / VOLO data recipes: RandAugment, 3-Augment, color jitter, repeated
augmentation and eval crops with crop_pct above 1."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from timm.data.transforms_factory import transforms_imagenet_eval, transforms_imagenet_train
from torchvision.transforms import v2

from tests.conftest import make_config
from vitrain.cli import main
from vitrain.config import ConfigError
from vitrain.data import build_loaders
from vitrain.data.loader import SeededSampler, epoch_order, sample_seed
from vitrain.data.transforms import (
    batch_eval_resize,
    build_eval_transform,
    build_randaugment,
    build_three_augment,
    build_train_transform,
    draws_python_rngs,
    seeded_sample_rngs,
)
from vitrain.train import make_plan

IMAGENET_MEAN = (0.485, 0.456, 0.406)
SYNTHETIC = ["data.name=synthetic", "data.image_size=14", "model.name=vit_tiny6_patch7"]


def _rgb_image(height: int = 40, width: int = 30, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _collect(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(images.clone(), labels.clone()) for images, labels in loader]


@pytest.mark.parametrize(
    ("policy", "magnitude", "num_ops"),
    [
        ("rand-m9-mstd0.5-inc1", 9, 2),  # DeiT
        ("rand-m9-mstd0.5", 9, 2),
        ("rand-m7-n3-mstd0.5-inc1-p0.8", 7, 3),
        ("rand-mstd1-tweights", 10, 2),  # timm's defaults: magnitude 10, two ops
        ("rand-n1-m15-mmax20", 15, 1),
        ("rand", 10, 2),
    ],
)
def test_good_randaugment_policies_reach_timm(policy, magnitude, num_ops):
    config = make_config(f"data.randaugment={policy}").data
    transform = build_randaugment(config.randaugment, 32, IMAGENET_MEAN)
    assert transform.num_layers == num_ops
    assert {op.magnitude for op in transform.ops} == {magnitude}


@pytest.mark.parametrize(
    ("policy", "problem"),
    [
        ("rnd-m9", "does not start with 'rand'"),
        ("m9-mstd0.5", "does not start with 'rand'"),
        ("rand-m9.5", "-m takes an integer"),
        ("rand-x3", "unknown option 'x3'"),
        ("rand-m9-m7", "-m is given twice"),
        ("rand-inc2", "-inc2 is out of range"),
        ("rand-p1.5", "-p1.5 is out of range"),
        ("rand-n0", "-n0 is out of range"),
        ("rand-mstd0.5.1", "-mstd takes a number"),
        ("rand-m", "-m takes an integer"),
        ("rand--m9", "empty option"),
        ("rand-tsomething", "unknown op set"),
    ],
)
def test_bad_randaugment_policies_name_the_key_and_the_form(policy, problem):
    with pytest.raises(ConfigError) as error:
        make_config(f"data.randaugment={policy}")
    message = str(error.value)
    assert message.startswith("data.randaugment:") and problem in message
    assert "rand-m9-mstd0.5-inc1" in message and "-m<magnitude" in message and "-inc<0|1" in message
    assert "\n" not in message


def test_a_bad_randaugment_policy_exits_2_on_the_command_line(capsys):
    assert main(["train", "--set", "data.name=synthetic", "--set", "data.randaugment=rand-m9-q3"]) == 2
    error = capsys.readouterr().err.strip()
    assert "data.randaugment" in error and "rand-m9-mstd0.5-inc1" in error and len(error.splitlines()) == 1


def test_empty_randaugment_turns_it_off():
    assert make_config("data.randaugment=").data.randaugment is None
    assert make_config("data.randaugment=null").data.randaugment is None


@pytest.mark.parametrize("policy", ["rand-m9-mstd0.5-inc1", "rand-m6-n3-mstd101-p0.7", "rand-m9-tweights"])
def test_randaugment_equals_timm_create_transform_s(policy):
    """Our RandAugment and the one timm's training transform builds (bilinear, the normalization mean as
    fill, translations of 45 % of the size) give the same image under the same seeds."""
    size, image = 32, _rgb_image(32, 32)
    ours = build_randaugment(policy, size, IMAGENET_MEAN)
    _, timm_secondary, _ = transforms_imagenet_train(
        size, auto_augment=policy, interpolation="bilinear", mean=IMAGENET_MEAN, separate=True
    )
    compared = 0
    for seed in range(40):
        random.seed(seed), np.random.seed(seed)
        try:
            reference = timm_secondary(image)
        except ValueError:  # timm's posterize to 0 bits, which this Pillow refuses (the next test)
            continue
        random.seed(seed), np.random.seed(seed)
        assert np.array_equal(np.asarray(ours(image)), np.asarray(reference)), seed
        compared += 1
    assert compared >= 30


def test_posterize_to_zero_bits_gives_black_instead_of_failing():
    """PosterizeIncreasing at magnitude 10 keeps 0 bits; Pillow now refuses that, older Pillow made the
    image black, which is what timm's level mapping means."""
    transform = build_randaugment("rand-m10-inc1-p1", 16, IMAGENET_MEAN)
    (posterize,) = [op for op in transform.ops if op.name == "PosterizeIncreasing"]
    image = _rgb_image(16, 16)
    with seeded_sample_rngs(0):
        assert not np.asarray(posterize(image)).any()
    weaker = build_randaugment("rand-m5-inc1-p1", 16, IMAGENET_MEAN)
    (posterize,) = [op for op in weaker.ops if op.name == "PosterizeIncreasing"]
    assert np.array_equal(np.asarray(posterize(image)), np.asarray(image) & 0b11000000)  # 4 - 2 = 2 bits kept


def test_seeded_sample_rngs_repeat_draws_and_leave_the_caller_s_streams_alone():
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    before = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    draws = []
    for sample in (123, 123, 124):
        with seeded_sample_rngs(sample):
            draws.append((random.random(), np.random.rand(), torch.rand(1).item()))
    assert (random.random(), np.random.rand(), torch.rand(1)) == before
    random.seed(6), np.random.seed(6), torch.manual_seed(6)  # whatever the caller's streams hold
    with seeded_sample_rngs(123):
        draws.append((random.random(), np.random.rand(), torch.rand(1).item()))
    assert draws[0] == draws[1] == draws[3]
    assert all(first != other for first, other in zip(draws[0], draws[2], strict=True))


def test_only_randaugment_needs_the_python_and_numpy_generators_seeded():
    config = make_config("data.image_size=16", "data.three_augment=true", "data.color_jitter=0.3").data
    plain = build_train_transform(config, (0.5,) * 3)
    assert not draws_python_rngs(plain)
    with_ra = build_train_transform(config.model_copy(update={"randaugment": "rand-m9-mstd0.5-inc1"}), (0.5,) * 3)
    assert draws_python_rngs(with_ra)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 20, 3), dtype=np.uint8))
    outputs = []
    for everything in (True, False):  # the torch-only seeding gives a torch-only transform the same output
        random.seed(everything), np.random.seed(int(everything))
        with seeded_sample_rngs(77, python_and_numpy=everything):
            outputs.append(plain(image))
    assert torch.equal(*outputs)
    random.seed(1)
    with seeded_sample_rngs(77, python_and_numpy=False):
        assert random.random() == random.Random(1).random()  # Python's stream left as the caller's


def test_in_memory_randaugment_is_timm_s_on_each_image_with_its_sample_seed():
    """Without crop or flip, each training image is timm's RandAugment of the stored image, drawn
    under the seed of its position's sample and copy; two loaders give the same batches."""
    policy = "rand-m9-mstd0.5-inc1"
    overrides = [*SYNTHETIC, "data.synthetic_num_train=32", "train.batch_size=8", "data.scale=[1, 1]"]
    plan = make_plan(make_config(*overrides, "data.hflip=0", f"data.randaugment={policy}", "data.repeated_aug=2"))
    batches = []
    for _ in range(2):
        loader, _ = build_loaders(plan.data)
        loader.start_epoch(3)
        batches.append(_collect(loader))
    for (images, labels), (again, labels_again) in zip(*batches, strict=True):
        assert torch.equal(images, again) and torch.equal(labels, labels_again)
    reference = build_randaugment(policy, 14, plan.data.mean)
    order = epoch_order(32, plan.data.seed, 3, repeats=2)
    stored = loader.dataset.images
    images = torch.cat([images for images, _ in batches[0]])
    changed = 0
    for position, index in enumerate(order.tolist()):
        with seeded_sample_rngs(sample_seed(plan.data.seed, 3, index, position % 2)):
            expected = v2.functional.pil_to_tensor(reference(v2.functional.to_pil_image(stored[index])))
        assert torch.equal(images[position], expected), position
        changed += not torch.equal(images[position], stored[index])
    assert changed > 16


def test_epoch_order_repeats_each_image_and_keeps_the_epoch_length():
    count, repeats = 96, 3
    order = epoch_order(count, seed=7, epoch=2, repeats=repeats)
    assert len(order) == count
    counts = Counter(order.tolist())
    assert len(counts) == count // repeats and set(counts.values()) == {repeats}
    assert all(len(set(order[start : start + repeats].tolist())) == 1 for start in range(0, count, repeats))
    assert set(epoch_order(count, seed=7, epoch=3, repeats=repeats).tolist()) != set(counts)  # epochs differ
    uneven = Counter(epoch_order(100, seed=7, epoch=2, repeats=3).tolist())  # 34 images, the last one once
    assert sum(uneven.values()) == 100 and sorted(Counter(uneven.values()).items()) == [(1, 1), (3, 33)]
    assert torch.equal(epoch_order(count, 7, 2, repeats=1), epoch_order(count, 7, 2))


def test_repeated_sampler_seeds_each_copy_and_ranks_split_the_one_process_order():
    count, repeats, batch = 96, 3, 12

    def sampler(rank=0, world=1, start=0):
        sampler = SeededSampler(count, seed=1, shuffle=True, rank=rank, world_size=world, repeats=repeats)
        sampler.set_batch_size(batch, batch // world)
        sampler.set_position(epoch=4, start=start)
        return list(sampler)

    single = sampler()
    assert len(single) == count and len(set(single)) == count  # every copy of an image has its own seed
    assert set(Counter(index for index, _ in single).values()) == {repeats}
    halves = [sampler(rank, 2) for rank in range(2)]
    share = batch // 2
    joined = [
        item for step in range(count // batch) for half in halves for item in half[step * share : (step + 1) * share]
    ]
    assert joined == single
    assert sampler(start=5 * batch) == single[5 * batch :]  # resumed mid-epoch
    assert sampler(rank=1, world=2, start=5 * batch) == halves[1][5 * share :]


def test_in_memory_repeated_augmentation_resumes_mid_epoch():
    overrides = [*SYNTHETIC, "data.synthetic_num_train=48", "train.batch_size=8", "data.repeated_aug=3"]
    plan = make_plan(make_config(*overrides, "data.randaugment=rand-m9-mstd0.5-inc1", "data.three_augment=true"))
    loader, _ = build_loaders(plan.data)
    loader.start_epoch(1)
    full = _collect(loader)
    labels = torch.cat([labels for _, labels in full])
    assert torch.equal(labels, loader.dataset.labels[epoch_order(48, plan.data.seed, 1, 3)])
    loader.start_epoch(1, start_sample=3 * 8)
    tail = _collect(loader)
    assert len(tail) == len(full) - 3
    for (images, labels), (again, labels_again) in zip(full[3:], tail, strict=True):
        assert torch.equal(images, again) and torch.equal(labels, labels_again)


def test_three_augment_gives_each_of_its_three_and_keeps_shape_and_type():
    image = _rgb_image(20, 20)
    augment = build_three_augment(20, channels=3)
    seen = Counter()
    for seed in range(40):
        with seeded_sample_rngs(seed):
            out = augment(image)
        assert out.mode == "RGB" and out.size == (20, 20)
        pixels = np.asarray(out)
        if (pixels == pixels[..., :1]).all():
            seen["grayscale"] += 1
        elif np.array_equal(pixels, np.asarray(v2.functional.solarize(image, 128))):
            seen["solarize"] += 1
        else:
            # blurred (sigma 0.1 barely changes anything): the noise is smoothed, never sharpened
            assert np.diff(pixels.astype(int), axis=1).std() <= np.diff(np.asarray(image).astype(int), axis=1).std()
            seen["blur"] += 1
            seen["visible blur"] += not np.array_equal(pixels, np.asarray(image))
    assert set(seen) == {"grayscale", "solarize", "blur", "visible blur"} and min(seen.values()) >= 5
    one_channel = build_three_augment(14, channels=1)(Image.fromarray(np.asarray(image)[:14, :14, 0]))
    assert one_channel.mode == "L" and one_channel.size == (14, 14)


def test_train_transform_with_every_per_image_policy_gives_uint8_images():
    config = make_config(
        "data.randaugment=rand-m9-mstd0.5-inc1", "data.three_augment=true", "data.color_jitter=0.3"
    ).data
    transform = build_train_transform(config, IMAGENET_MEAN, image_size=16)
    outputs = []
    for seed in range(6):
        with seeded_sample_rngs(seed):
            outputs.append(transform(_rgb_image()))
        assert outputs[-1].dtype == torch.uint8 and outputs[-1].shape == (3, 16, 16)
    assert len({output.sum().item() for output in outputs}) == len(outputs)


@pytest.mark.parametrize(("size", "crop_pct"), [(24, 1.15), (23, 1.15), (32, 1.3), (24, 0.875)])
def test_eval_crop_matches_timm_above_and_below_crop_pct_one(size, crop_pct):
    """The per-sample eval transform equals timm's (resize to size / crop_pct, center crop padding
    with black); the in-memory batch path agrees up to resampling rounding, with the same black border."""
    config = make_config(f"data.crop_pct={crop_pct}").data
    image = _rgb_image(40, 30)
    ours = build_eval_transform(config, size)(image)
    reference = transforms_imagenet_eval(size, crop_pct=crop_pct, interpolation="bilinear", use_prefetcher=True)
    assert torch.equal(ours, reference(image))
    batch = batch_eval_resize(v2.functional.pil_to_tensor(image)[None], size, crop_pct)[0]
    assert batch.shape == ours.shape == (3, size, size)
    assert (batch.int() - ours.int()).abs().max() <= 2
    pad = max(size - int(size / crop_pct), 0)  # the width is the short side; the odd pixel goes right
    left, right = pad // 2, size - (pad + 1) // 2
    for output in (ours, batch):
        assert not output[:, :, :left].any() and not output[:, :, right:].any()
        assert output[:, :, left].any() and output[:, :, right - 1].any()


def test_crop_pct_above_two_is_refused():
    assert make_config("data.crop_pct=1.15").data.crop_pct == 1.15
    with pytest.raises(ConfigError, match="data.crop_pct"):
        make_config("data.crop_pct=2.5")


@pytest.mark.parametrize(
    ("override", "key"),
    [("data.repeated_aug=0", "data.repeated_aug"), ("data.color_jitter=-0.1", "data.color_jitter")],
)
def test_bad_recipe_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        make_config(override)


def test_show_config_lists_the_recipe_keys(capsys):
    settings = {"randaugment": "rand-m9-mstd0.5-inc1", "three_augment": True, "color_jitter": 0.3}
    settings |= {"repeated_aug": 3, "crop_pct": 1.15}
    assert main(["show-config", *[f"--set=data.{key}={value}" for key, value in settings.items()]]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)["data"]
    assert {key: shown[key] for key in settings} == settings
