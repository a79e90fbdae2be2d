"""Data sources, transforms and resumable loaders."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from tests.conftest import make_config, write_idx
from vitrain.cli import main
from vitrain.config import ConfigError
from vitrain.data import Normalize, build_loaders, describe_source
from vitrain.data.loader import FileLoader, InMemoryLoader
from vitrain.data.sources import build_synthetic, image_folder_samples, load_fashion_mnist, read_idx
from vitrain.data.transforms import (
    RandomErase,
    batch_eval_resize,
    batch_random_erase,
    batch_random_resized_crop,
    batch_random_translate,
    build_train_transform,
)
from vitrain.train import make_plan

PER_IMAGE_RECIPE = [
    "data.repeated_aug=3",
    "data.randaugment=rand-m9-mstd0.5-inc1",
    "data.three_augment=true",
    "data.color_jitter=0.3",
    "data.crop_pct=1.15",
    "data.limit_train=192",  # per-image work is slow: three global batches of Fashion-MNIST
]
"""DeiT III-style per-image augmentation with repeated augmentation, and a padded eval crop."""


def _collect(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(images.clone(), labels.clone()) for images, labels in loader]


def test_read_idx_round_trip_and_truncation(tmp_path):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.gz", array)
    assert torch.equal(read_idx(tmp_path / "a.gz"), torch.from_numpy(array))
    with gzip.open(tmp_path / "a.gz", "rb") as handle:
        data = handle.read()
    with gzip.open(tmp_path / "cut.gz", "wb") as handle:
        handle.write(data[:-5])
    with pytest.raises(ValueError, match="truncated"):
        read_idx(tmp_path / "cut.gz")


def test_fashion_mnist_source(tiny_fmnist):
    info = describe_source(make_config(f"data.root={tiny_fmnist}").data)
    assert (info.num_train, info.num_eval, info.num_classes, info.channels) == (512, 128, 10, 1)
    train = load_fashion_mnist(tiny_fmnist, "train")
    assert train.images.shape == (512, 1, 28, 28) and train.images.dtype == torch.uint8
    # the fixture's class c lights rows 2c..2c+3: labels must line up with images
    rows = train.images[:, 0].float().mean(dim=2)
    assert torch.all(rows[torch.arange(512), 2 * train.labels] > 200)
    limited = describe_source(make_config(f"data.root={tiny_fmnist}", "data.limit_train=100").data)
    assert limited.num_train == 100


def test_fashion_mnist_missing_says_how_to_install(tmp_path):
    with pytest.raises(ConfigError, match="apt-get install dataset-fashion-mnist"):
        describe_source(make_config(f"data.root={tmp_path}").data)


def test_imagefolder_classes_sorted_and_non_images_skipped(tiny_imagefolder):
    samples, classes = image_folder_samples(tiny_imagefolder, "train", 0.05)
    assert classes == ["n01", "n02", "n03"]
    assert len(samples) == 18
    assert all(path.split("/")[-2] == classes[label] for path, label in samples)
    info = describe_source(make_config("data.name=imagefolder", f"data.root={tiny_imagefolder}").data)
    assert (info.num_train, info.num_eval, info.num_classes, info.channels) == (18, 6, 3, 3)


@pytest.mark.parametrize("recipe", [[], PER_IMAGE_RECIPE], ids=["batch-augment", "per-image-augment"])
def test_imagefolder_loader_shapes_and_worker_determinism(tiny_imagefolder, recipe):
    overrides = [
        "data.name=imagefolder",
        f"data.root={tiny_imagefolder}",
        "data.image_size=16",
        "train.batch_size=4",
        "model.patch_size=4",
        *recipe,
    ]
    plans = [make_plan(make_config(*overrides, f"data.num_workers={workers}")) for workers in (0, 2)]
    batches = []
    for plan in plans:
        train_loader, eval_loader = build_loaders(plan.data)
        assert isinstance(train_loader, FileLoader)
        train_loader.start_epoch(1)
        batches.append(_collect(train_loader))
        images, labels = next(iter(eval_loader))
        assert images.shape == (6, 3, 16, 16) and images.dtype == torch.uint8  # all 6 val images, one batch
    assert len(batches[0]) == 18 // 4
    for (images_a, labels_a), (images_b, labels_b) in zip(*batches, strict=True):
        assert images_a.shape == (4, 3, 16, 16)
        assert torch.equal(images_a, images_b) and torch.equal(labels_a, labels_b)


def test_file_loader_resumes_mid_epoch(tiny_imagefolder):
    plan = make_plan(
        make_config(
            "data.name=imagefolder",
            f"data.root={tiny_imagefolder}",
            "data.image_size=16",
            "train.batch_size=4",
            "model.patch_size=4",
            "data.num_workers=0",
        )
    )
    loader, _ = build_loaders(plan.data)
    loader.start_epoch(2)
    full = _collect(loader)
    loader.start_epoch(2, start_sample=2 * 4)
    tail = _collect(loader)
    assert len(tail) == len(full) - 2
    for (a, la), (b, lb) in zip(full[2:], tail, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    loader.start_epoch(3)
    assert not torch.equal(_collect(loader)[0][0], full[0][0]), "epochs must differ in order/augmentation"


def test_in_memory_loader_resumes_mid_epoch(tiny_fmnist):
    plan = make_plan(make_config(f"data.root={tiny_fmnist}", "train.batch_size=64"))
    loader, eval_loader = build_loaders(plan.data)
    assert isinstance(loader, InMemoryLoader)
    loader.start_epoch(1)
    full = _collect(loader)
    loader.start_epoch(1, start_sample=3 * 64)
    tail = _collect(loader)
    for (a, la), (b, lb) in zip(full[3:], tail, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    evaluated = torch.cat([labels for _, labels in eval_loader])
    assert len(evaluated) == 128  # eval keeps the last partial batch


def test_synthetic_is_seeded_and_learnable_shaped():
    config = make_config("data.name=synthetic", "data.image_size=8", "data.synthetic_num_train=50").data
    first, second = build_synthetic(config, 3, "train"), build_synthetic(config, 3, "train")
    assert torch.equal(first.images, second.images) and torch.equal(first.labels, second.labels)
    assert first.images.shape == (50, 3, 8, 8)
    assert not torch.equal(build_synthetic(config, 3, "eval").images[:10], first.images[:10])


def test_batch_crop_identity_and_flip():
    images = torch.randint(0, 256, (5, 1, 12, 12), dtype=torch.uint8)
    generator = torch.Generator().manual_seed(0)
    same = batch_random_resized_crop(images, 12, (1.0, 1.0), (1.0, 1.0), 0.0, generator)
    assert torch.equal(same, images)
    flipped = batch_random_resized_crop(images, 12, (1.0, 1.0), (1.0, 1.0), 1.0, generator)
    assert torch.equal(flipped, images.flip(-1))


def test_batch_crop_boxes_vary_per_image():
    images = torch.arange(16 * 16, dtype=torch.float32).reshape(1, 1, 16, 16).expand(64, 1, 16, 16)
    images = (images / images.max() * 255).to(torch.uint8)
    out = batch_random_resized_crop(images, 8, (0.1, 0.5), (3 / 4, 4 / 3), 0.0, torch.Generator().manual_seed(1))
    assert out.shape == (64, 1, 8, 8)
    assert len({tuple(image.flatten().tolist()) for image in out}) > 50
    # a crop of at most half the area spans fewer intensity levels than the full ramp
    assert (out.float().amax((1, 2, 3)) - out.float().amin((1, 2, 3))).max() < 255


def _shift_of(original: torch.Tensor, shifted: torch.Tensor, max_shift: int) -> tuple[int, int] | None:
    """The (dy, dx) for which ``shifted`` is ``original`` moved with zero fill, or None."""
    padded = torch.nn.functional.pad(original, (max_shift,) * 4)
    height, width = original.shape[-2:]
    for top in range(2 * max_shift + 1):
        for left in range(2 * max_shift + 1):
            if torch.equal(padded[..., top : top + height, left : left + width], shifted):
                return max_shift - top, max_shift - left
    return None


def test_batch_translate_shifts_each_image_within_bounds():
    images = torch.randint(1, 256, (200, 2, 10, 12), dtype=torch.uint8)  # no zeros: the fill shows
    out = batch_random_translate(images, 3, torch.Generator().manual_seed(0))
    shifts = [_shift_of(image, moved, 3) for image, moved in zip(images, out, strict=True)]
    assert None not in shifts
    assert {dy for dy, _ in shifts} == {dx for _, dx in shifts} == set(range(-3, 4))  # every shift drawn
    assert torch.equal(batch_random_translate(images, 0, torch.Generator()), images)


def test_per_sample_translate_and_erase_follow_the_batch_rules():
    config = make_config("data.scale=[1,1]", "data.ratio=[1,1]", "data.hflip=0", "data.translate=2").data
    image = Image.fromarray(np.random.default_rng(0).integers(1, 256, (28, 28), dtype=np.uint8))
    original = v2.PILToTensor()(image)
    torch.manual_seed(0)
    assert all(
        _shift_of(original, build_train_transform(config, (0.5, 0.5, 0.5))(image), 2) is not None for _ in range(20)
    )
    erase = RandomErase(1.0)
    assert not torch.equal(erase(original), original)


def test_batch_random_erase_boxes():
    images = torch.zeros(400, 3, 20, 20, dtype=torch.uint8)
    assert torch.equal(batch_random_erase(images, 0.0, torch.Generator()), images)
    out = batch_random_erase(images, 0.5, torch.Generator().manual_seed(0))
    changed = out != 0  # noise is 0 with probability 1/256 per value, so a box shows in any channel
    erased = changed.flatten(1).any(1)
    assert 0.4 < erased.float().mean() < 0.6
    for mask in changed.any(1)[erased]:
        rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
        box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
        assert rows.max() - rows.min() + 1 == len(rows) and cols.max() - cols.min() + 1 == len(cols)  # one box
        assert 0.02 * 400 * 0.5 <= box <= 400 / 3 * 1.2  # timm's area range, with rounding
        assert mask.sum() >= 0.9 * box  # filled, not sprinkled


def test_batch_eval_resize_matches_torchvision():
    images = torch.randint(0, 256, (3, 3, 40, 30), dtype=torch.uint8)
    ours = batch_eval_resize(images, 24, 0.875)
    reference = v2.Compose([v2.Resize(27, antialias=True), v2.CenterCrop(24)])(images)
    assert ours.shape == reference.shape == (3, 3, 24, 24)
    assert (ours.int() - reference.int()).abs().max() <= 2


def test_normalize():
    normalize = Normalize((0.5,), (0.25,), "cpu")
    images = torch.tensor([0, 255], dtype=torch.uint8).view(2, 1, 1, 1)
    assert torch.allclose(normalize(images).flatten(), torch.tensor([-2.0, 2.0]))


def test_download_fashion_mnist_from_a_mirror(tiny_fmnist, tmp_path, capsys):
    target = tmp_path / "downloaded"
    assert main(["download-fashion-mnist", "--root", str(target), "--url", tiny_fmnist.as_uri() + "/"]) == 0
    assert "4 file(s)" in capsys.readouterr().out
    assert torch.equal(load_fashion_mnist(target, "train").labels, load_fashion_mnist(tiny_fmnist, "train").labels)
    assert not list(target.glob("*.part"))


def test_download_refuses_a_truncated_file(tiny_fmnist, tmp_path, capsys):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for path in tiny_fmnist.iterdir():
        (mirror / path.name).write_bytes(path.read_bytes()[:-10] if "train-images" in path.name else path.read_bytes())
    assert main(["download-fashion-mnist", "--root", str(tmp_path / "out"), "--url", mirror.as_uri() + "/"]) == 1
    assert "download failed" in capsys.readouterr().err
    assert not (tmp_path / "out" / "train-images-idx3-ubyte.gz").exists()


def test_jpeg_decodes_at_reduced_scale_for_small_outputs(tmp_path):
    """Pillow's draft picks the largest DCT reduction keeping the short side >= the stage's need."""
    from vitrain.data.loader import ImageFileDataset, draft_size

    config = make_config("data.scale=[0.08, 1.0]", "data.crop_pct=0.875").data
    assert draft_size(config, 16, train=True) == 57  # the smallest crop (8 % of the area) keeps 16 px
    assert draft_size(config, 16, train=False) == 18  # the eval resize
    path = tmp_path / "big.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (192, 256, 3), dtype=np.uint8)).save(path)
    decoded_size = lambda side: ImageFileDataset([(str(path), 0)], lambda image: image.size, side)[(0, 0)][0]  # noqa: E731
    assert decoded_size(40) == (64, 48)  # 1/4 scale: the short side 48 >= 40
    assert decoded_size(90) == (128, 96)  # 1/2 scale: 96 >= 90
    assert decoded_size(200) == (256, 192)  # no reduction when the output needs every pixel


@pytest.mark.parametrize("recipe", [[], PER_IMAGE_RECIPE], ids=["batch-augment", "per-image-augment"])
@pytest.mark.parametrize("source", ["memory", "files"])
def test_ranks_take_slices_of_the_same_global_batches(source, recipe, tiny_fmnist, tiny_imagefolder):
    """Two ranks' batches, put side by side, are the one-process batches (images and labels), and
    their eval shards cover the eval set once; also from a mid-epoch position."""
    from vitrain.config import World

    if source == "memory":
        overrides = [f"data.root={tiny_fmnist}", "train.batch_size=64", "train.eval_batch_size=50"]
    else:
        overrides = ["data.name=imagefolder", f"data.root={tiny_imagefolder}", "data.image_size=16"]
        overrides += ["train.batch_size=4", "train.eval_batch_size=4", "data.num_workers=0", "model.patch_size=4"]
    config = make_config(*overrides, "data.translate=2", "data.random_erase=0.5", *recipe)  # global draws too

    def batches(world, start=0):
        train, evaluation = build_loaders(make_plan(config, world).data)
        train.start_epoch(1, start)
        return _collect(train), _collect(evaluation)

    (single, single_eval), halves = batches(World()), [batches(World(rank, 2, rank)) for rank in range(2)]
    assert len(single) == len(halves[0][0]) == len(halves[1][0])
    for (images, labels), first, second in zip(single, halves[0][0], halves[1][0], strict=True):
        assert torch.equal(images, torch.cat([first[0], second[0]])) and torch.equal(
            labels, torch.cat([first[1], second[1]])
        )
    eval_labels = sorted(torch.cat([labels for _, labels in halves[0][1] + halves[1][1]]).tolist())
    assert eval_labels == sorted(torch.cat([labels for _, labels in single_eval]).tolist())
    (later, _), later_half = batches(World(), 4 * 2), batches(World(1, 2, 1), 4 * 2)[0]
    assert all(torch.equal(whole[0][-len(half[0]) :], half[0]) for whole, half in zip(later, later_half, strict=True))
