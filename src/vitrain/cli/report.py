"""``vitrain plot``: learning curves of finished or running runs."""

from __future__ import annotations

import argparse
from pathlib import Path


def _add_plot_parser(commands) -> None:
    plot = commands.add_parser(
        "plot",
        help="learning curves of one or several runs (top-1, loss, LR, img/s, MFU, data wait) as PNG, SVG or HTML",
    )
    plot.add_argument("runs", nargs="+", type=Path, help="run folders (train.out_dir, holding metrics.jsonl)")
    plot.add_argument("--out", required=True, type=Path, help="the .png, .svg or .html file to write")
    plot.add_argument("--names", nargs="+", help="one name per run in the legend (default: the folder names)")


def command_plot(args: argparse.Namespace) -> int:
    from vitrain.report.runs import plot_runs

    print(plot_runs(args.runs, args.out, args.names))
    return 0
