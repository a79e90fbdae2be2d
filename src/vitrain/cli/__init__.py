"""Command line: parse, resolve a config, call the library, map errors to exit codes.

Exit codes: 0 success; 1 unexpected failure, or training diverged (too many non-finite steps in a
row); 2 bad input (config, paths, checkpoints: unsafe, unreadable, unwritable or a full disk; more
undecodable images than data.max_bad_fraction allows); 3 preempted (SIGTERM or SIGUSR1: the step
finished, a checkpoint was saved; continue with ``--resume auto``); 130 interrupted (Ctrl-C, no
checkpoint); check-data: 1 when it found bad files; doctor: 1 when a check failed; predict: 1 when no
image could be classified.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from vitrain import __version__
from vitrain.cli import bench, catalog, checkpoints, data, doctor, forecast, report, train
from vitrain.cli.common import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_PREEMPTED
from vitrain.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    """Every command, in the order ``vitrain --help`` lists them; each module adds its own."""
    parser = argparse.ArgumentParser(prog="vitrain", description="Train vision transformers from scratch, fast.")
    parser.add_argument("--version", action="version", version=f"vitrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    train._add_train_parsers(commands)
    checkpoints._add_checkpoint_parsers(commands)
    checkpoints._add_predict_parser(commands)
    catalog._add_show_config_parser(commands)
    data._add_download_parser(commands)
    catalog._add_list_parsers(commands)
    bench._add_bench_parser(commands)
    bench._add_bench_data_parser(commands)
    forecast._add_forecast_parser(commands)
    train._add_slurm_parser(commands)
    report._add_plot_parser(commands)
    data._add_check_data_parser(commands)
    data._add_shard_parser(commands)
    doctor._add_doctor_parser(commands)
    data._add_label_parser(commands)
    return parser


COMMANDS = {
    "train": train.command_train,
    "eval": checkpoints.command_eval,
    "export": checkpoints.command_export,
    "predict": checkpoints.command_predict,
    "show-config": catalog.command_show_config,
    "download-fashion-mnist": data.command_download_fashion_mnist,
    "finetune": train.command_finetune,
    "list-recipes": catalog.command_list_recipes,
    "list-models": catalog.command_list_models,
    "bench": bench.command_bench,
    "bench-data": bench.command_bench_data,
    "forecast": forecast.command_forecast,
    "slurm": train.command_slurm,
    "check-data": data.command_check_data,
    "shard": data.command_shard,
    "doctor": doctor.command_doctor,
    "label": data.command_label,
    "plot": report.command_plot,
}


def _discard_stdout() -> None:
    """Point stdout at /dev/null: the reader of the pipe is gone, and Python's flush at exit would
    otherwise print a BrokenPipeError of its own."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _loaded(module: str, name: str) -> tuple[type[BaseException], ...]:
    """The exception class ``module.name`` when a command has imported that module, else none: an
    exception of a module never imported cannot have been raised, and ``vitrain --help`` need not import
    the modules (and torch) to map them to exit codes."""
    error = getattr(sys.modules.get(module), name, None)
    return () if error is None else (error,)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    from tqdm.contrib.logging import logging_redirect_tqdm

    redirect = logging_redirect_tqdm() if args.command in ("train", "finetune", "label") else contextlib.nullcontext()
    try:
        with redirect:
            code = COMMANDS[args.command](args)
        sys.stdout.flush()  # a reader that left early (`| head`, `| grep -q`) shows here, not at exit
        return code
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except (ConfigError, *_loaded("vitrain.io", "CheckpointError")) as error:
        print(f"vitrain: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (
        *_loaded("vitrain.train.loop", "TrainingDiverged"),
        *_loaded("vitrain.parallel.heartbeat", "PeerLost"),
    ) as error:
        print(f"vitrain: error: {error}", file=sys.stderr)
        return 1
    except _loaded("vitrain.train.signals", "Preempted") as stop:
        print(f"vitrain: {stop}", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print("vitrain: interrupted", file=sys.stderr)
        return 130
