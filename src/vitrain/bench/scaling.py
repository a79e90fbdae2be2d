"""``vitrain bench --nproc 1,2,4``: the same training step at several world sizes on this node (weak
scaling: a fixed batch per process, as in the seeds' throughput-vs-GPUs charts), each world size a
``torchrun`` of ``vitrain bench``; reports global and per-process img/s and scaling efficiency
(img/s at N processes over N x img/s at the smallest) and speed-up (img/s at N over img/s at the
smallest), with a PNG plot.

On a CPU the processes share the machine's cores (each gets cores / N threads), so the figure shows
what DDP's communication and the shared cores cost, not how more chips would scale: there the
speed-up (ideal 1.0, the same cores) is the meaningful figure, not the efficiency.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from vitrain.report import pyplot

log = logging.getLogger("vitrain")


def parse_nproc(text: str) -> list[int]:
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise ValueError(f"--nproc {text!r}: give process counts like 1,2,4")
    return counts


def run_scaling(bench_args: list[str], per_process_batch: int, counts: list[int], on_cpu: bool) -> dict[str, Any]:
    """Run ``vitrain bench <bench_args> --batch per_process_batch*N`` under torchrun for each N."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="vitrain-scaling-") as folder:
        for count in counts:
            record_path = Path(folder) / f"nproc{count}.json"
            env = dict(os.environ)
            if on_cpu:
                env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // count))
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={count}"]
            command += ["-m", "vitrain", "bench", *bench_args, "--batch", str(per_process_batch * count)]
            command += ["--json", str(record_path)]
            log.info("scaling: %d process%s", count, "es" if count > 1 else "")
            result = subprocess.run(command, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"bench at {count} processes failed:\n{result.stderr[-2000:]}")
            runs.append(json.loads(record_path.read_text()))
    base = runs[0]["img_s_median"] / counts[0]
    rows = [
        {
            "processes": count,
            "global_batch": run["batch"],
            "img_s": run["img_s_median"],
            "img_s_per_process": run["img_s_median"] / count,
            "efficiency": run["img_s_median"] / (count * base),
            "speedup": run["img_s_median"] / runs[0]["img_s_median"],
            "threads_per_process": run["threads"],
        }
        for count, run in zip(counts, runs, strict=True)
    ]
    return {"per_process_batch": per_process_batch, "rows": rows, "runs": runs}


def format_scaling(result: dict[str, Any]) -> str:
    lines = ["| processes | global batch | img/s | img/s per process | speed-up | scaling efficiency | threads each |"]
    lines.append("|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        lines.append(
            f"| {row['processes']} | {row['global_batch']} | {row['img_s']:.1f} | {row['img_s_per_process']:.1f} "
            f"| {row['speedup']:.2f}x | {100 * row['efficiency']:.0f} % | {row['threads_per_process']} |"
        )
    return "\n".join(lines)


def plot_scaling(result: dict[str, Any], path: Path, title: str) -> bool:
    """Global img/s against processes, with the ideal line; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    rows = result["rows"]
    counts = [row["processes"] for row in rows]
    ideal = [rows[0]["img_s_per_process"] * count for count in counts]
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(counts, ideal, linestyle="--", color="gray", label="ideal (linear)")
    axes.plot(counts, [row["img_s"] for row in rows], marker="o", label="measured")
    for row in rows:
        axes.annotate(
            f"{100 * row['efficiency']:.0f} %",
            (row["processes"], row["img_s"]),
            textcoords="offset points",
            xytext=(4, -12),
        )
    axes.set_xlabel("processes")
    axes.set_ylabel("training img/s (all processes)")
    axes.set_xticks(counts)
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return True
