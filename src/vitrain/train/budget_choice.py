"""The recipe for your images (``vitrain train --data DIR``), chosen on this machine.

With a time budget, as Irandoust et al. (2022) choose for 24 hours on one GPU: each rung of the ladder
(:data:`vitrain.recipes.images.LADDER`: a model at an image size) is timed for a few training steps at a small
batch, which gives the epochs it would train in the budget; the costliest rung that still gets
:data:`MIN_EPOCHS` epochs is taken (none does: the cheapest), and the epochs decide the augmentation
(:func:`~vitrain.recipes.images.images_recipe`); no image-size curriculum, which cost accuracy in the
project's 10-minute comparison. Rungs larger than twice the images' own size are not tried.
Without a budget the rung follows the number of images. The user's own settings (flags, --config, --set) are
layered over every candidate, so they always win."""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable

from vitrain.config import Config, DatasetInfo, parse_duration_s
from vitrain.data.build import describe_source
from vitrain.data.sources import image_folder_root, image_folder_samples
from vitrain.recipes.images import (
    AUGMENT_FROM_EPOCHS,
    DEFAULT_EPOCHS,
    LADDER,
    PLAIN_BELOW_EPOCHS,
    Rung,
    images_recipe,
    rung_for_images,
)

log = logging.getLogger("vitrain")

MIN_EPOCHS = 10.0
"""The fewest epochs a rung must get in the budget to be taken over the cheaper rungs: below about ten epochs a
run is still in its fast early climb, where a cheaper step that sees the data more often gains more than a
larger model (the default Fashion-MNIST run's 8-13 epochs in 9 minutes sit at this edge)."""

PROBE_BATCH = 32
"""Images per timed step of each rung: small, so the costliest rungs take seconds, not minutes, on a CPU."""

SIZE_SAMPLE = 64
"""Training images whose size is read (headers only) to know how large the images are."""


@dataclasses.dataclass(frozen=True)
class RungTiming:
    rung: Rung
    img_s: float
    epochs: float


@dataclasses.dataclass(frozen=True)
class DataChoice:
    """The chosen config, and what it was chosen from and why (printed before training)."""

    config: Config
    rung: Rung
    epochs: float
    timings: tuple[RungTiming, ...]
    reasons: tuple[str, ...]


Layered = Callable[[Config], Config]
"""The user's flags, --config files and --set overrides applied over a candidate recipe."""


def image_side(config: Config) -> int | None:
    """The median shorter side of a sample of the training images (image folders and CSV lists; None for
    other sources or when none can be read)."""
    from PIL import Image

    if config.data.name != "imagefolder":
        return None
    samples = image_folder_samples(image_folder_root(config.data), "train", config.data.val_fraction)[0]
    step = max(1, len(samples) // SIZE_SAMPLE)
    sides = []
    for path, _ in samples[::step][:SIZE_SAMPLE]:
        try:
            with Image.open(path) as image:
                sides.append(min(image.size))
        except OSError:
            continue
    return int(statistics.median(sides)) if sides else None


def _rungs_for(side: int | None) -> list[Rung]:
    fitting = [rung for rung in LADDER if side is None or rung.image_size <= max(32, 2 * side)]
    return fitting or [LADDER[0]]


def _describe(info: DatasetInfo, side: int | None, config: Config) -> str:
    held = f", {info.num_eval} for evaluation" if info.num_eval else ""
    size = f"; images about {side} px" if side else ""
    return f"{info.num_train} training images in {info.num_classes} classes{held}{size} ({config.data.root})"


def time_rung(candidate: Config) -> float:
    """Training images a second of ``candidate``'s step at :data:`PROBE_BATCH`, in its unmeasured precision;
    cached per machine and shape (``vitrain.train.choices``), so a second run (or --dry-run, then the run)
    starts at once."""
    from vitrain.train.choices import device_key, measured_entry, model_key
    from vitrain.train.plan import make_plan
    from vitrain.train.precision_choice import probe_config, time_candidate

    plan = make_plan(probe_config(candidate, PROBE_BATCH), measure=False)
    model = plan.model
    key = (
        f"rung | {device_key(plan.device)} | {model_key(model)} | batch {PROBE_BATCH} | {plan.precision.name} {plan.precision.mode} | "
        f"{plan.optim.name} {plan.optim.implementation}"
    )
    entry, cached = measured_entry(key, lambda: {"img_s": time_candidate(plan)[0]})
    log.info("--data: %s at %d px: %.0f img/s%s", model.name, model.image_size, entry["img_s"], " (cached)" * cached)
    return float(entry["img_s"])


def choose_for_data(config: Config, layered: Layered, timer: Callable[[Config], float] = time_rung) -> DataChoice:
    """The recipe for ``config``'s data (``layered``: the user's settings over a candidate; ``timer``: img/s of a
    candidate's step)."""
    info, side = describe_source(config.data), image_side(config)
    reasons = [_describe(info, side, config)]
    rungs = _rungs_for(side)
    if config.train.budget is None:
        rung = rung_for_images(info.num_train)
        rung = rung if rung in rungs else rungs[-1]
        epochs = config.train.epochs if config.train.epochs is not None else DEFAULT_EPOCHS
        reasons.append(f"no budget: {rung.label} for {info.num_train} images, {epochs:g} epochs")
        return _finish(layered, rung, epochs, info, (), reasons)
    budget_s = parse_duration_s(config.train.budget)
    timings = []
    for rung in rungs:
        img_s = timer(layered(images_recipe(rung, MIN_EPOCHS, info.num_train)))
        timings.append(RungTiming(rung, img_s, img_s * budget_s / info.num_train))
        if timings[-1].epochs < MIN_EPOCHS:
            break
    reasons.append("timed: " + "; ".join(f"{t.rung.label} {t.img_s:.0f} img/s, {t.epochs:.1f} epochs" for t in timings))
    fit = [timing for timing in timings if timing.epochs >= MIN_EPOCHS]
    chosen = fit[-1] if fit else timings[0]
    why = f"the costliest with at least {MIN_EPOCHS:g} epochs" if fit else f"none gets {MIN_EPOCHS:g} epochs"
    reasons.append(f"chosen: {chosen.rung.label} ({why}), about {chosen.epochs:.1f} epochs in {config.train.budget}")
    return _finish(layered, chosen.rung, chosen.epochs, info, tuple(timings), reasons)


def _finish(
    layered: Layered, rung: Rung, epochs: float, info: DatasetInfo, timings: tuple, reasons: list[str]
) -> DataChoice:
    chosen = layered(images_recipe(rung, epochs, info.num_train))
    if epochs < PLAIN_BELOW_EPOCHS:
        augment = f"no crops, flips or augmentation (they cost accuracy below {PLAIN_BELOW_EPOCHS} epochs)"
    elif epochs < AUGMENT_FROM_EPOCHS:
        augment = f"crops and flips; RandAugment and erasing pay from {AUGMENT_FROM_EPOCHS} epochs"
    else:
        augment = f"crops, flips, RandAugment and random erasing (they pay from {AUGMENT_FROM_EPOCHS} epochs)"
    fixed = "one image size throughout (an image-size curriculum cost 1.1-1.7 pt at 10 minutes)"
    reasons.append(f"recipe: batch {chosen.train.batch_size}, {augment}; {fixed}: docs/results.md")
    return DataChoice(chosen, rung, epochs, timings, tuple(reasons))
