"""Test top-1 against training seconds for several runs, read from their metrics.jsonl (EMA weights dashed).

python experiments/plot_top1.py runs/a runs/b --labels plain mixup --out top1.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vitrain.metrics import read_jsonl
from vitrain.report import pyplot


def eval_curves(run: Path) -> dict[str, tuple[list[float], list[float]]]:
    """(training seconds, top-1) of the live weights and, where recorded, of the EMA weights."""
    evals = [record for record in read_jsonl(run / "metrics.jsonl") if record["event"] == "eval"]
    curves = {"live": ([r["train_s"] for r in evals], [r["top1"] for r in evals])}
    if evals and "ema_top1" in evals[0]:
        curves["ema"] = ([r["train_s"] for r in evals], [r["ema_top1"] for r in evals])
    return curves


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (each with metrics.jsonl)")
    parser.add_argument("--labels", nargs="*", help="one name per run (default: the folder names)")
    parser.add_argument("--out", type=Path, required=True, help="PNG path")
    parser.add_argument("--ymin", type=float, default=86.0)
    args = parser.parse_args(argv)
    plt = pyplot()
    if plt is None:
        parser.error("matplotlib is not installed (pip install -e '.[plot]')")
    labels = args.labels or [run.name for run in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"{len(args.runs)} runs but {len(labels)} labels")
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for run, label in zip(args.runs, labels, strict=True):
        for kind, (seconds, top1) in eval_curves(run).items():
            name = label if kind == "live" else f"{label} (EMA weights)"
            axes.plot(seconds, top1, marker="o", markersize=3, linestyle="-" if kind == "live" else "--", label=name)
    axes.set(xlabel="training seconds", ylabel="test top-1 (%)", ylim=(args.ymin, None))
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
