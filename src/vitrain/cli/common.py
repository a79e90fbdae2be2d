"""What the command modules share: the config arguments and their loading, the run's processes, the
exit codes and the JSON result files."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from pathlib import Path

from vitrain.config import Config, World, build_config
from vitrain.recipes import DEFAULT_RECIPE

log = logging.getLogger("vitrain")
EXIT_BAD_INPUT = 2
EXIT_PREEMPTED = 3
EXIT_BROKEN_PIPE = 141  # what a shell reports for a program ended by SIGPIPE (128 + 13)


def _add_config_arguments(parser: argparse.ArgumentParser, with_recipe: bool = True) -> None:
    if with_recipe:
        parser.add_argument(
            "--recipe", default=DEFAULT_RECIPE, help=f"named recipe (default {DEFAULT_RECIPE}; see list-recipes)"
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


def load_config(base: Config, args: argparse.Namespace) -> Config:
    return build_config(base, args.config, args.overrides)


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
