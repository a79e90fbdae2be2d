"""Shared fixtures: tiny datasets written in the real on-disk formats."""

from __future__ import annotations

import copy
import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitrain.config import MOVED_KEYS, Config, build_config
from vitrain.config.resolve import fsdp_tp_runs_on
from vitrain.parallel.slurm import torchrun_options
from vitrain.train.step import TrainStep

FORWARDING_TORCHRUN = pytest.mark.skipif(
    "--signals-to-handle" not in torchrun_options(),
    reason="this torch's torchrun cannot forward SIGUSR1, so vitrain slurm refuses the torchrun launcher here "
    "(test_a_torchrun_that_cannot_forward_sigusr1_is_refused_and_srun_named)",
)

FSDP_TP_RUNS = pytest.mark.skipif(
    not fsdp_tp_runs_on(torch.__version__),
    reason=f"torch {torch.__version__} cannot step fsdp+tp's optimizer, so vitrain refuses parallel.strategy=fsdp+tp "
    "here (test_fsdp_tp_is_refused_on_a_torch_that_cannot_step_it)",
)


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array as a gzipped IDX file (the Fashion-MNIST format)."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as handle:
        handle.write(header + array.astype(np.uint8).tobytes())


def striped_images(labels: np.ndarray, side: int = 28, seed: int = 0) -> np.ndarray:
    """Learnable images: class c lights up a horizontal band at rows 2c..2c+3, plus noise."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 60, size=(len(labels), side, side))
    for index, label in enumerate(labels):
        images[index, 2 * label : 2 * label + 4, :] = 230
    return images.astype(np.uint8)


@pytest.fixture(scope="session")
def tiny_fmnist(tmp_path_factory) -> Path:
    """A Fashion-MNIST root with 512 train / 128 test learnable 28x28 images."""
    root = tmp_path_factory.mktemp("fmnist")
    rng = np.random.default_rng(0)
    for prefix, count in (("train", 512), ("t10k", 128)):
        labels = rng.integers(0, 10, size=count).astype(np.uint8)
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", striped_images(labels, seed=count))
        write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return root


@pytest.fixture(scope="session")
def tiny_imagefolder(tmp_path_factory) -> Path:
    """An ImageNet-layout root: 3 classes, JPEG/PNG files of odd sizes and modes."""
    root = tmp_path_factory.mktemp("imagefolder")
    rng = np.random.default_rng(0)
    classes = ["n02", "n01", "n03"]  # unsorted on purpose: indices come from sorted names
    for split, per_class in (("train", 6), ("val", 2)):
        for _class_index, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for image_index in range(per_class):
                height, width = rng.integers(20, 60, size=2)
                pixels = rng.integers(0, 255, size=(height, width, 3)).astype(np.uint8)
                image = Image.fromarray(pixels)
                if image_index % 3 == 1:
                    image = image.convert("L")  # grayscale must come out RGB
                suffix = ".png" if image_index % 2 else ".JPEG"
                image.save(folder / f"{name}_{image_index}{suffix}")
    (root / "train" / "n01" / "notes.txt").write_text("not an image")
    return root


@pytest.fixture(autouse=True)
def amx_tiles_restored():
    """Every in-process training run sets whether the process may use the AMX tile kernels (its plan's
    ``runtime.amx_tiles``): each test starts from the environment's answer (``VITRAIN_AMX``) and leaves it
    so, whatever a test or a module's fixture (a run trained once for a module) set before."""
    from vitrain.kernels import build

    build.use_amx_tiles(None)
    yield
    build.use_amx_tiles(None)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A cache of measured choices of this test's own, on a machine counted as quiet: what other work the
    host runs meanwhile never keeps an answer out of it (tests/unit/test_choices.py tests that rule)."""
    from vitrain.train import choices

    monkeypatch.setenv("VITRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(choices, "other_processes_cpu_s", lambda: 0.0)
    return tmp_path / "cache"


@pytest.fixture
def one_thread():
    """One intra-op thread for tiny runs: the suite shares two cores with other work, where several
    threads wait on each other (measured 5x slower per step under load)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_config(*overrides: str, base: Config | None = None) -> Config:
    return build_config(base or Config(), [], list(overrides))


def pinned_bf16_o2() -> list[str]:
    """bf16 O2 with the fused CPU kernels where they build here, else PyTorch's ops, pinned: two runs compared
    bit for bit must compute alike, and ``performance.cpu_kernels=auto`` measures and may choose either for each."""
    from vitrain import kernels

    return ["precision=bf16", "precision_mode=o2", f"performance.cpu_kernels={'fused' if kernels.load() else 'native'}"]


SMALL_SYNTHETIC_RUN = [
    "precision=fp32",
    "model.name=vit_tiny6_patch7",
    "data.name=synthetic",
    "data.image_size=14",
    "data.synthetic_num_train=96",
    "data.synthetic_num_eval=32",
    "train.batch_size=16",
    "train.progress=off",
    "optim.lr=0.2",  # 3.2e-3 after scaling to batch 16
    "data.scale=[0.5, 1.0]",
    "schedule.warmup_epochs=1",
]
"""A tiny, fast, fp32 synthetic run, its length and folder left to the test."""


@pytest.fixture
def small_synthetic_overrides(tmp_path) -> list[str]:
    """A tiny, fast, fp32 synthetic run of 3 epochs in the test's folder (used by loop and resume tests)."""
    return [*SMALL_SYNTHETIC_RUN, "train.epochs=3", "train.log_every_steps=2", f"train.out_dir={tmp_path / 'run'}"]


def assert_same_training_state(ours_path: Path, reference_path: Path) -> None:
    """Two checkpoints hold bitwise the same training state: weights, optimizer state, loss scaler
    and loop counters (times aside)."""
    import torch

    from vitrain.checkpoint import load_checkpoint

    ours, reference = load_checkpoint(ours_path), load_checkpoint(reference_path)
    for key, tensor in reference["model"].items():
        assert torch.equal(ours["model"][key], tensor), key
    ours_optimizer, reference_optimizer = ours["optimizer"]["state"], reference["optimizer"]["state"]
    assert ours_optimizer.keys() == reference_optimizer.keys()
    for index, values in reference_optimizer.items():
        for name, value in values.items():
            assert torch.equal(torch.as_tensor(ours_optimizer[index][name]), torch.as_tensor(value)), (index, name)
    assert ours["scaler"] == reference["scaler"]
    counters = ("step", "images_seen", "epoch", "epoch_images", "skipped_steps", "skip_streak")
    assert {key: ours["state"][key] for key in counters} == {key: reference["state"][key] for key in counters}


class StepClock:
    """A fake clock that moves only when a training step runs (``seconds_per_step`` each) or when a
    test advances it: training time is then exact and independent of the machine."""

    def __init__(self, seconds_per_step: float = 1.0):
        self.now, self.seconds_per_step = 0.0, seconds_per_step
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def step_clock(monkeypatch) -> StepClock:
    clock = StepClock()
    original = TrainStep.__call__

    def timed_step(self, images, labels):
        clock.shapes.append(tuple(images.shape))
        outputs = original(self, images, labels)
        clock.now += clock.seconds_per_step
        return outputs

    monkeypatch.setattr(TrainStep, "__call__", timed_step)
    return clock


def old_flat_layout(saved: dict) -> dict:
    """A config dump (``Config.model_dump``) in the flat layout older versions saved: the keys of the ema,
    distill, token_labels and performance sections back where :data:`vitrain.config.MOVED_KEYS` says they were."""
    flat = copy.deepcopy(saved)
    for old, new in reversed(MOVED_KEYS.items()):  # train.distill's kind last: it replaces the emptied section
        section, key = old.split(".")
        new_section, *middle, new_key = new.split(".")
        holder = flat.get(new_section, {})
        for part in middle:
            holder = holder.get(part, {})
        if new_key in holder:
            flat.setdefault(section, {})[key] = holder.pop(new_key)
    for newer in ("amx", "fp8_scaling"):  # newer than the flat layout
        flat.get("performance", {}).pop(newer, None)
    for empty in ("performance", "token_labels"):
        assert flat.pop(empty, {}) == {}
    assert flat.get("train", {}).pop("ema", {}) == {}
    return flat
