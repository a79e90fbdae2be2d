"""How well ``vitrain forecast`` predicts: against processes on this machine (gloo, DDP and FSDP, two model
sizes), against the seeds' published ResNet-50 runs, and against the H200 records.

    python experiments/forecast_validation.py --out records/forecast-validation-<date>-<cpu kind>

Local: ``vitrain bench --comm --nproc 2,4`` measures the collectives; per model, one process benches the
step at the per-process batch (the forecast's compute input); ``vitrain bench --nproc 1,2,4`` measures
DDP and FSDP; ``vitrain forecast --shared-host`` predicts the same layouts from the single-process step and
the measured collectives. The published and H200 rows need no measurement. Writes ``validation.json`` and
``README.md`` (the tables) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IBM = {  # the seed's ResNet-50 benchmark: 4 V100 per node, batch 208 per GPU, fp16 O2, 90 epochs of ImageNet
    "images": 1_281_167,
    "epochs": 90,
    "seconds_2": 20 * 3600 + 36 * 60 + 51.11,
    "seconds_64": 1 * 3600 + 7 * 60 + 51.31,
    "storage_gbs_64": 3.30,
    "iops_64": 36_500,
    "mean_file_kib": 110,  # ImageNet train's JPEGs: 1.28 M files, about 140 GB
}


def vitrain(*args: str, capture: bool = True) -> str:
    command = [sys.executable, "-m", "vitrain", *args]
    print("+ vitrain", " ".join(args), flush=True)
    result = subprocess.run(command, cwd=ROOT, capture_output=capture, text=True)
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}\n{result.stderr[-3000:]}")
    return result.stdout


def forecast(*args: str, out: Path) -> list[dict]:
    vitrain("forecast", *args, "--json", str(out))
    return json.loads(out.read_text())["rows"]


def measure(path: Path, *args: str) -> None:
    """``vitrain bench ARGS --json path``, unless ``path`` holds a measurement already (a rerun's forecasts
    reuse it)."""
    if not path.is_file():
        vitrain("bench", *args, "--json", str(path))


def local_rows(out: Path, models: list[tuple[str, int]], batch: int) -> list[dict]:
    comm = out / "comm.json"
    measure(comm, "--comm", "--nproc", "2,4")
    rows = []
    for model, size in models:
        common = ["--model", model, "--image-size", str(size), "--precision", "fp32", "--set", "data.name=synthetic"]
        single = out / f"bench-{model}.json"
        measure(single, *common, "--batch", str(batch))
        for strategy in ("ddp", "fsdp"):
            measured = out / f"scaling-{model}-{strategy}.json"
            measure(
                measured, *common, "--batch", str(batch), "--nproc", "1,2,4", "--set", f"parallel.strategy={strategy}"
            )
            predicted = forecast(
                "--bench", str(single), "--shared-host", "--network", str(comm), "--strategy", strategy,
                "--devices", "1,2,4", "--num-classes", "10", out=out / f"forecast-{model}-{strategy}.json",
            )  # fmt: skip
            for run, row in zip(json.loads(measured.read_text())["rows"], predicted, strict=True):
                rows.append(
                    {
                        "model": model,
                        "image_size": size,
                        "strategy": strategy,
                        "processes": run["processes"],
                        "measured_img_s": run["img_s"],
                        "forecast_img_s": row["img_s"],
                        "error": row["img_s"] / run["img_s"] - 1,
                    }
                )
    return rows


def published_rows(out: Path) -> list[dict]:
    rate_2 = IBM["images"] * IBM["epochs"] / IBM["seconds_2"] / 2  # per GPU, with 2 GPUs in one node
    rows = forecast(
        "--img-s-per-device", f"{rate_2:.1f}", "--model", "resnet50", "--batch", "208", "--precision", "fp16",
        "--precision-mode", "o2", "--optimizer", "sgd", "--device-name", "Tesla V100-SXM2-16GB",
        "--network", "ac922-v100-edr", "--devices", "2-64", "--images", str(IBM["images"]),
        "--mean-file-kib", str(IBM["mean_file_kib"]), "--epochs", str(IBM["epochs"]),
        out=out / "forecast-ibm-resnet50.json",
    )  # fmt: skip
    at_64 = rows[-1]
    published_rate = IBM["images"] * IBM["epochs"] / IBM["seconds_64"]
    storage_at_published = published_rate * IBM["mean_file_kib"] * 1024 / 1e9
    return [
        {
            "what": "ResNet-50, 64 V100: time to 90 epochs (s)",
            "forecast": at_64["epoch_s"] * IBM["epochs"],
            "published": IBM["seconds_64"],
        },
        {
            "what": "ResNet-50, 64 V100: speed-up over 2",
            "forecast": at_64["img_s"] / rows[0]["img_s"],
            "published": IBM["seconds_2"] / IBM["seconds_64"],
        },  # fmt: skip
        {
            "what": "storage GB/s at the published 64-GPU rate",
            "forecast": storage_at_published,
            "published": IBM["storage_gbs_64"],
        },  # fmt: skip
        {"what": "IOPS at the published 64-GPU rate", "forecast": published_rate, "published": IBM["iops_64"]},
    ]


def h200_rows(out: Path) -> list[dict]:
    run = ROOT / "records/gpu-check-2026-11-26-h200/run2-c5f8001"
    b512 = json.loads((run / "bench-vit_b16-o2-compile-b512.json").read_text())
    rows = forecast(
        "--bench", str(run / "bench-vit_b16-o2-compile-b256.json"), "--batch-per-device", "512", "--devices", "1",
        "--num-classes", "10", out=out / "forecast-h200-b512.json",
    )  # fmt: skip
    return [
        {
            "what": "ViT-B/16 bf16 O2, 1 H200, batch 512 from 256: img/s",
            "forecast": rows[0]["img_s"],
            "published": b512["img_s_median"],
        },  # fmt: skip
        {
            "what": "the same: peak memory GiB",
            "forecast": rows[0]["memory_bytes"] / 2**30,
            "published": b512["peak_memory_bytes"] / 2**30,
        },  # fmt: skip
    ]


def markdown(local: list[dict], published: list[dict]) -> str:
    lines = ["| model | layout | processes | measured img/s | forecast img/s | error |", "|---|---|---|---|---|---|"]
    for row in local:
        lines.append(
            f"| {row['model']} {row['image_size']} px | {row['strategy']} | {row['processes']} | "
            f"{row['measured_img_s']:.1f} | {row['forecast_img_s']:.1f} | {100 * row['error']:+.0f} % |"
        )
    lines += ["", "| figure | forecast | published / measured | error |", "|---|---|---|---|"]
    for row in published:
        error = row["forecast"] / row["published"] - 1
        lines.append(f"| {row['what']} | {row['forecast']:.4g} | {row['published']:.4g} | {100 * error:+.0f} % |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=16, help="images per process (default 16)")
    parser.add_argument("--skip-local", action="store_true", help="only the published and H200 rows")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    models = [("vit_tiny_patch16", 112), ("vit_small_patch16", 112)]
    local = [] if args.skip_local else local_rows(args.out, models, args.batch)
    published = published_rows(args.out) + h200_rows(args.out)
    (args.out / "validation.json").write_text(json.dumps({"local": local, "published": published}, indent=1))
    table = markdown(local, published)
    (args.out / "tables.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
