"""What the command modules share: the config arguments and their loading, the run's processes, the
exit codes and the JSON result files."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from vitrain.config import Config, World, build_config
from vitrain.recipes import DEFAULT_RECIPE, get_recipe

IMAGES_RECIPE = "images"
"""The recipe --data starts from (``vitrain.recipes.images``)."""

log = logging.getLogger("vitrain")
EXIT_BAD_INPUT = 2
EXIT_PREEMPTED = 3
EXIT_BROKEN_PIPE = 141  # what a shell reports for a program ended by SIGPIPE (128 + 13)


def _add_config_arguments(parser: argparse.ArgumentParser, with_recipe: bool = True) -> None:
    if with_recipe:
        parser.add_argument(
            "--recipe",
            help=f"named recipe (default {DEFAULT_RECIPE}; with --data, one chosen for the data: see list-recipes)",
        )
    parser.add_argument(
        "--config", action="append", default=[], type=Path, help="YAML file layered over the recipe (repeatable)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one dotted key (repeatable)",
    )


RUN_FLAGS = {
    "data": (
        "PATH",
        "data.root",
        "your images: a folder with a subfolder per class (train/ and val/ inside, or "
        "not: then --val-fraction of them is held out), a folder of `vitrain shard` shards, or a CSV file of "
        "path,label rows (data.name follows from it)",
    ),
    "val_fraction": (
        "F",
        "data.val_fraction",
        "share of each class held out for evaluation when the data has no val/ (default 0.05)",
    ),
    "budget": ("TIME", "train.budget", "wall-clock training time: 90s, 10m, 1h, 1h30m, 24h"),
    "epochs": ("N", "train.epochs", "training length in epochs"),
    "batch_size": ("N", "train.batch_size", "global batch (all processes together)"),
    "lr": ("LR", "optim.lr", "learning rate at this run's batch (sets optim.reference_batch to the batch)"),
    "model": ("NAME", "model.name", "model variant (list-models)"),
    "image_size": ("PX", "data.image_size", "side of the square model input"),
    "precision": ("P", "precision", "auto (measured), fp32, bf16 or fp16"),
    "device": ("D", "train.device", "auto, cpu, cuda or cuda:N"),
    "out": ("DIR", "train.out_dir", "run folder"),
}
"""Plain flags of `vitrain train` (and show-config, slurm): metavar, the --set key each stands for, help."""

TEXT_KEYS = ("data.root", "train.budget", "model.name", "train.device", "train.out_dir")
"""Flags whose value is text, never read as YAML (a path named 1e3, a device named null)."""


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "run settings", "each the same as its --set key, before --set: --set train.epochs=3 beats --epochs 5"
    )
    for name, (metavar, key, text) in RUN_FLAGS.items():
        group.add_argument(f"--{name.replace('_', '-')}", metavar=metavar, help=f"{text} ({key})")
    parser.set_defaults(run_flags=True)  # other commands may have an --out or --data of their own


def data_source_name(path: str) -> str:
    """data.name of a --data path: a folder of tar shards is webdataset, anything else an image folder (or a
    CSV list, which data.name=imagefolder also reads); a path that does not exist is left to resolve()."""
    folder = Path(path)
    if folder.is_dir() and ((folder / "index.json").is_file() or any(folder.glob("*.tar"))):
        return "webdataset"
    return "imagefolder"


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides the plain flags given stand for, in :data:`RUN_FLAGS` order."""
    if not getattr(args, "run_flags", False):
        return []
    overrides = []
    for name, (_, key, _) in RUN_FLAGS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        overrides.append(f"{key}={json.dumps(value) if key in TEXT_KEYS else value}")
        if name == "data":
            overrides.append(f"data.name={data_source_name(value)}")
    return overrides


def base_recipe(args: argparse.Namespace) -> Config:
    """The recipe the command's config starts from: --recipe, else the default (``images`` with --data)."""
    if args.recipe is not None:
        return get_recipe(args.recipe)
    data = getattr(args, "run_flags", False) and args.data is not None
    return get_recipe(IMAGES_RECIPE if data else DEFAULT_RECIPE)


def run_config(args: argparse.Namespace) -> tuple[Config, Any]:
    """The config of the run the arguments describe, and the ``DataChoice`` made for --data without --recipe
    (the recipe timed for the data and budget on this machine; None otherwise)."""
    config = load_config(base_recipe(args), args)  # every flag and key checked before torch is imported
    if args.data is None or args.recipe is not None:
        return config, None
    from vitrain.train.budget_choice import choose_for_data

    choice = choose_for_data(config, lambda base: load_config(base, args))
    return choice.config, choice


def load_config(base: Config, args: argparse.Namespace) -> Config:
    """The recipe, then --config files, the plain flags and --set overrides, in that order."""
    flags = flag_overrides(args)
    config = build_config(base, args.config, [*flags, *args.overrides])
    if getattr(args, "run_flags", False) and args.lr is not None:  # the LR as given at this batch (timm's --lr)
        flags.append(f"optim.reference_batch={config.train.batch_size}")
        config = build_config(base, args.config, [*flags, *args.overrides])
    return config


@contextlib.contextmanager
def processes(config: Config):
    """The run's processes: under torchrun (WORLD_SIZE > 1) join the process group (NCCL on GPUs,
    gloo on CPUs) for the duration, rank 0 alone logging at INFO; yields this process's World."""
    from vitrain.hardware import detect_hardware
    from vitrain.parallel.distributed import close_distributed, init_distributed

    world = World.from_env()
    if world.size > 1:
        cuda = detect_hardware(config.train.device).cuda_available and config.train.device != "cpu"
        init_distributed(world, cuda, config.parallel.timeout_s)
        if not world.is_main:
            log.setLevel(logging.WARNING)
    try:
        yield world
    finally:
        close_distributed()


def _write_json(path: Path | None, result: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
