"""``vitrain doctor``: what this machine can do for vitrain."""

from __future__ import annotations

import argparse
from pathlib import Path

from vitrain.cli.common import _add_config_arguments, _write_json, base_recipe, load_config


def _add_doctor_parser(commands) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check what this machine can do for vitrain: CPU, GPUs, environment (exit 1 if a check fails)",
    )
    _add_config_arguments(doctor)
    doctor.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="the device you mean to train on: cuda makes a missing GPU a failure, cpu skips the GPU checks",
    )
    doctor.add_argument("--out", type=Path, help="folder runs will be written to (default: the recipe's run root)")
    doctor.add_argument("--json", type=Path, help="also write every check as JSON to this file")


def command_doctor(args: argparse.Namespace) -> int:
    config = load_config(base_recipe(args), args)
    from vitrain.doctor import format_report, run_doctor

    report = run_doctor(config, device=args.device, out=args.out)
    print(format_report(report))
    _write_json(args.json, report.to_dict())
    return report.exit_code
