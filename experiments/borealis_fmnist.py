"""The Borealis benchmark (Irandoust et al. 2022: Table 1 and the Figure 2 ablations) at this machine's scale:
Fashion-MNIST, one wall-clock training budget, four variants of the same 6-block, 192-wide model,
several seeds. Writes each run under ``--out`` (config, metrics.jsonl, summary.json; a rerun with
the same ``--out`` skips the runs already finished), a
``results.json`` with mean and std per variant, and ``accuracy_vs_time.png`` (test top-1 after each
epoch against training seconds) when matplotlib is installed.

    python experiments/borealis_fmnist.py --budget 10m --seeds 0 1 2 --out records/borealis-fmnist-10m-<date>

Variants: a DeiT-style ViT (plain FFN), LocalViT (BatchNorm + SE depthwise FFN), the locality ViT
without curriculum, and the locality ViT with an image-size curriculum
(14 -> 21 -> 28 px over the first 40 % of the budget, the paper's linear rule as fractions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from vitrain.config import build_config
from vitrain.metrics import read_jsonl
from vitrain.recipes import get_recipe
from vitrain.report import pyplot
from vitrain.train import make_plan, train

# The paper's models use the patchify stem at 28 px, patch 7 (the default recipe's is a conv stem at 32 px).
PATCH7 = ["data.image_size=28"]
VARIANTS = {
    "deit_style_vit": [*PATCH7, "model.name=vit_tiny6_patch7"],
    "localvit": [*PATCH7, "model.name=localvit_tiny6_patch7"],
    "locality_vit": [*PATCH7, "model.name=locality_vit_tiny6_patch7"],
    "locality_vit_curriculum": [
        *PATCH7,
        "model.name=locality_vit_tiny6_patch7",
        "curriculum.stages=[{until: 0.2, image_size: 14}, {until: 0.4, image_size: 21}]",
    ],
}


def run_variant(name: str, seed: int, budget: str, out: Path, extra: list[str]) -> dict:
    """Train one variant, or read its results back when an earlier invocation finished it."""
    run_dir = out / f"{name}-seed{seed}"
    if (run_dir / "summary.json").exists():
        return _result(name, seed, json.loads((run_dir / "summary.json").read_text()), run_dir)
    overrides = [
        *VARIANTS[name],
        f"train.seed={seed}",
        f"train.budget={budget}",
        f"train.out_dir={run_dir}",
        "train.progress=off",
        *extra,
    ]
    plan = make_plan(build_config(get_recipe("fmnist"), [], overrides))
    return _result(name, seed, train(plan), run_dir)


def _result(name: str, seed: int, summary: dict, run_dir: Path) -> dict:
    evals = [record for record in read_jsonl(run_dir / "metrics.jsonl") if record["event"] == "eval"]
    return {
        "variant": name,
        "seed": seed,
        "final_top1": summary["final_top1"],
        "train_s": summary["train_s"],
        "epochs": summary["epochs"],
        "mean_img_s": summary["mean_img_s"],
        "curve": [(record["train_s"], record["top1"]) for record in evals],
    }


def summarize(runs: list[dict]) -> dict[str, dict]:
    table = {}
    for name in VARIANTS:
        scores = [run["final_top1"] for run in runs if run["variant"] == name]
        if scores:
            table[name] = {
                "mean": statistics.mean(scores),
                "std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
                "seeds": len(scores),
                "epochs": statistics.mean(run["epochs"] for run in runs if run["variant"] == name),
            }
    return table


def plot(runs: list[dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    figure, axes = plt.subplots(figsize=(7, 4.5))
    colors = dict(zip(VARIANTS, ("tab:gray", "tab:orange", "tab:blue", "tab:green"), strict=True))
    for run in runs:
        seconds, top1 = zip(*run["curve"], strict=True)
        label = run["variant"] if run["seed"] == min(r["seed"] for r in runs) else None
        axes.plot(seconds, top1, marker="o", color=colors[run["variant"]], label=label, alpha=0.8)
    axes.set_xlabel("training seconds (evaluation excluded)")
    axes.set_ylabel("Fashion-MNIST test top-1 (%)")
    axes.set_ylim(bottom=75)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="10m", help="training budget per run (default 10m)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, required=True, help="folder for the runs and results")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="extra override for every run")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in args.seeds:
        for name in args.variants:
            runs.append(run_variant(name, seed, args.budget, args.out, args.extra))
            print(json.dumps({key: value for key, value in runs[-1].items() if key != "curve"}), flush=True)
            table = summarize(runs)  # written after every run: an interrupted sweep keeps what it measured
            results = {"budget": args.budget, "table": table, "runs": runs}
            (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print("| variant | test top-1 (mean ± std) | seeds | epochs in budget |\n|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['mean']:.2f} ± {row['std']:.2f} | {row['seeds']} | {row['epochs']:.2f} |")
    if not plot(runs, args.out / "accuracy_vs_time.png"):
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
