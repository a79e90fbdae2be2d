"""Does token labeling pay off on Fashion-MNIST? Label maps from a vitrain teacher, then the same recipe with
and without token labels + MixToken, several seeds each, one run after another (a quiet machine: budgets are
wall-clock).

    .venv/bin/python experiments/token_labeling_fmnist.py --teacher runs/teacher-40m --out runs/tl \\
        --seeds 0 1 2 [--recipe fmnist_10m] [--set model.name=...]

Writes ``OUT/maps`` (with the labeling report), one run folder per (variant, seed) and ``OUT/results.json``:
final top-1 (the prediction), the class head alone for token-labeled runs, epochs, img/s, and per variant the
mean and standard deviation over seeds. Finished runs (with a summary.json) are kept, so an interrupted
sweep resumes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS = {
    "plain": [],
    "token-labels": ["model.aux_head=true", "token_labels.maps={maps}", "token_labels.mix_token=true"],
}


def _vitrain(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "vitrain", *args]
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, check=True, capture_output=True, text=True)


def label(teacher: Path, recipe: str, out: Path, settings: list[str]) -> dict:
    """The teacher's top-5 maps of the training images (kept when already complete)."""
    report_path = out / "label-report.json"
    if report_path.is_file():
        return json.loads(report_path.read_text())
    overrides = [arg for setting in settings for arg in ("--set", setting)]
    result = _vitrain("label", "--teacher", str(teacher), "--recipe", recipe, "--out", str(out / "maps"), *overrides)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def train(recipe: str, folder: Path, settings: list[str]) -> dict:
    """One run (skipped when its summary exists); its summary."""
    if not (folder / "summary.json").is_file():
        overrides = [arg for setting in [*settings, f"train.out_dir={folder}"] for arg in ("--set", setting)]
        _vitrain("train", "--recipe", recipe, "--set", "train.progress=off", *overrides)
    return json.loads((folder / "summary.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", type=Path, required=True, help="the teacher: a run folder or checkpoint")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipe", default="fmnist_10m")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", dest="settings", action="append", default=[], help="extra key=value for every run")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"labeling": label(args.teacher, args.recipe, args.out, args.settings), "runs": {}}
    for variant, extra in VARIANTS.items():
        for seed in args.seeds:
            settings = [*args.settings, f"train.seed={seed}", *(s.format(maps=args.out / "maps") for s in extra)]
            summary = train(args.recipe, args.out / f"{variant}-seed{seed}", settings)
            results["runs"][f"{variant}-seed{seed}"] = {
                key: summary.get(key) for key in ("final_top1", "final_cls_top1", "epochs", "mean_img_s")
            }
        finals = [results["runs"][f"{variant}-seed{seed}"]["final_top1"] for seed in args.seeds]
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        results[variant] = {"mean_top1": statistics.mean(finals), "std_top1": spread, "seeds": args.seeds}
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({variant: results[variant] for variant in VARIANTS}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
