"""``vitrain bench --comm``: all-reduce, all-gather and reduce-scatter timed at several message sizes over the
backend at hand (NCCL on GPUs, gloo on CPUs), at each process count of ``--nproc``; bus bandwidth per point
(nccl-tests' definition: the bytes each rank sends over the time) and a latency + bandwidth fit per
collective that ``vitrain forecast --network`` reads."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vitrain.config import World
from vitrain.forecast.fabrics import COLLECTIVES, fit_alpha_beta, wire_bytes
from vitrain.metrics.records import run_environment
from vitrain.parallel.distributed import close_distributed, init_distributed

log = logging.getLogger("vitrain")

SIZES = tuple(2**power for power in range(12, 27, 2))
"""4 KiB to 64 MiB, every factor of 4."""


def _collective(op: str, size: int, ranks: int, device: str):
    numel = max(size // 4 // ranks, 1) * ranks  # fp32, divisible among the ranks
    whole = torch.ones(numel, device=device)
    piece = torch.ones(numel // ranks, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(whole)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(whole, piece)
    return lambda: dist.reduce_scatter_tensor(piece, whole)


def measure_collectives(sizes: tuple[int, ...], repeats: int, device: str) -> list[dict[str, Any]]:
    """In a started process group: each collective at each size, the slowest rank's mean time of
    ``repeats`` calls after two untimed ones."""
    ranks = dist.get_world_size()
    rows = []
    for op in COLLECTIVES:
        for size in sizes:
            call = _collective(op, size, ranks, device)
            for _ in range(2):
                call()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            dist.barrier()
            started = time.perf_counter()
            for _ in range(repeats):
                call()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = torch.tensor([(time.perf_counter() - started) / repeats], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            wire = wire_bytes(op, size, ranks)
            rows.append(
                {
                    "op": op,
                    "ranks": ranks,
                    "bytes": size,
                    "seconds": float(seconds.item()),
                    "alg_gbs": size / float(seconds.item()) / 1e9,
                    "bus_gbs": wire / float(seconds.item()) / 1e9,
                }
            )
    return rows


def comm_worker(json_path: Path, sizes: tuple[int, ...], repeats: int, cpu: bool) -> None:
    """The body of one torchrun process of the sweep; rank 0 writes the rows."""
    world = World(
        rank=int(os.environ["RANK"]), size=int(os.environ["WORLD_SIZE"]), local_rank=int(os.environ["LOCAL_RANK"])
    )
    cuda = torch.cuda.is_available() and not cpu
    device = f"cuda:{world.local_rank}" if cuda else "cpu"
    init_distributed(world, cuda, timeout_s=300)
    try:
        rows = measure_collectives(sizes, repeats, device)
        if world.is_main:
            record = {"backend": dist.get_backend(), "rows": rows, **run_environment(device)}
            json_path.write_text(json.dumps(record))
    finally:
        close_distributed()


def run_comm(counts: list[int], repeats: int, cpu: bool, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """A torchrun of the worker per process count (above 1); every row, and the fit of the all-reduces."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="vitrain-comm-") as folder:
        for count in [count for count in counts if count > 1]:
            path = Path(folder) / f"comm{count}.json"
            env = dict(os.environ, OMP_NUM_THREADS="1")
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={count}"]
            command += ["-m", "vitrain", "bench", "--comm-worker", str(path), "--repeats", str(repeats)]
            command += ["--comm-sizes", ",".join(str(size) for size in sizes)] + (["--comm-cpu"] if cpu else [])
            log.info("comm: %d processes", count)
            result = subprocess.run(command, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"bench --comm at {count} processes failed:\n{result.stderr[-2000:]}")
            runs.append(json.loads(path.read_text()))
    if not runs:
        raise ValueError("--comm needs a process count above 1 in --nproc (e.g. --nproc 2,4)")
    rows = [row for run in runs for row in run["rows"]]
    fits = {
        op: fit_alpha_beta(op, [(row["ranks"], row["bytes"], row["seconds"]) for row in rows if row["op"] == op])
        for op in COLLECTIVES
    }
    environment = {key: value for key, value in runs[0].items() if key != "rows"}
    return {**environment, "world_size": max(counts), "rows": rows, "fit": fits}


def format_comm(result: dict[str, Any]) -> str:
    lines = ["| collective | processes | size | time | bus GB/s |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        size = row["bytes"]
        label = f"{size / 2**20:.0f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
        lines.append(
            f"| {row['op']} | {row['ranks']} | {label} | {1e6 * row['seconds']:.0f} µs | {row['bus_gbs']:.2f} |"
        )
    lines.append(f"\nfits ({result['backend']}): time = hops x latency + bytes sent / bus bandwidth")
    for op, fit in result["fit"].items():
        lines.append(
            f"- {op}: {fit['bus_gbs']:.2f} GB/s, {fit['latency_us']:.0f} µs per hop "
            f"(largest error {100 * fit['max_relative_error']:.0f} %)"
        )
    return "\n".join(lines)
