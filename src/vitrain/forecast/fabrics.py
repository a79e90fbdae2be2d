"""The network between devices: named presets for common fabrics (each with its source) or figures
measured with ``vitrain bench --comm`` (one fit per collective), and the time of a ring collective over it.

Bandwidths are per direction, in GB/s (1e9 bytes). ``intra_gbs`` is what one device can send inside its
node; ``inter_gbs`` is what one node can send to the others, all its network ports together. A ring that
spans nodes enters and leaves each node once per channel, and NCCL runs one channel per port, so its bus
bandwidth is the smaller of the two (the per-GPU traffic of a ring collective is the same on every link).
Preset bandwidths are line rates from datasheets, an upper bound: real collectives reach 70-90 % of them,
which ``bench --comm`` on the real fabric measures. Preset latencies are the order of NCCL's per-hop
time, assumed, not measured; they matter only for small messages or very many devices.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Fabric:
    name: str
    devices_per_node: int
    intra_gbs: float
    inter_gbs: float
    intra_latency_us: float
    inter_latency_us: float
    source: str
    measured: tuple[tuple[str, float, float], ...] = ()
    """Per collective ``(op, bus GB/s, µs per hop)`` from ``bench --comm`` (gloo's all-gather and
    reduce-scatter run at a third of its all-reduce's rate); a preset has none: one figure for all."""

    def link(self, op: str, span_nodes: bool) -> tuple[float, float]:
        """(bytes/s, seconds per hop) of a ring ``op``, inside a node or across nodes."""
        for name, gbs, latency_us in self.measured:
            if name == op:
                return 1e9 * gbs, 1e-6 * latency_us
        if span_nodes:
            return 1e9 * min(self.intra_gbs, self.inter_gbs), 1e-6 * self.inter_latency_us
        return 1e9 * self.intra_gbs, 1e-6 * self.intra_latency_us


_ASSUMED_LATENCY = "latency assumed (the order of NCCL's per-hop time)"

FABRICS: dict[str, Fabric] = {
    fabric.name: fabric
    for fabric in (
        Fabric(
            "dgx-h100",
            8,
            450.0,
            400.0,
            3.0,
            5.0,
            "NVIDIA DGX H100 datasheet: NVLink 4 at 900 GB/s per GPU (both directions), 8x ConnectX-7 "
            f"400 Gb/s InfiniBand per node; {_ASSUMED_LATENCY}",
        ),
        Fabric(
            "hgx-h200",
            8,
            450.0,
            400.0,
            3.0,
            5.0,
            "NVIDIA H200 datasheet: NVLink 4 at 900 GB/s per GPU (both directions), HGX H200 with 8x 400 Gb/s "
            f"InfiniBand per node (as DGX H200); {_ASSUMED_LATENCY}",
        ),
        Fabric(
            "dgx-a100",
            8,
            300.0,
            200.0,
            3.0,
            5.0,
            "NVIDIA DGX A100 datasheet: NVLink 3 at 600 GB/s per GPU (both directions), 8x 200 Gb/s HDR "
            f"InfiniBand per node; {_ASSUMED_LATENCY}",
        ),
        Fabric(
            "aws-p5",
            8,
            450.0,
            400.0,
            3.0,
            15.0,
            "AWS p5.48xlarge: 8 H100 with NVLink 4 (900 GB/s per GPU, both directions), 3200 Gb/s EFA per "
            f"instance; {_ASSUMED_LATENCY}, EFA's higher",
        ),
        Fabric(
            "aws-p4d",
            8,
            300.0,
            50.0,
            3.0,
            15.0,
            "AWS p4d.24xlarge: 8 A100 with NVLink 3 (600 GB/s per GPU, both directions), 400 Gb/s EFA per "
            f"instance; {_ASSUMED_LATENCY}, EFA's higher",
        ),
        Fabric(
            "ac922-v100-edr",
            4,
            32.0,
            12.5,
            5.0,
            5.0,
            "IBM Power System AC922 (4 V100 SXM2): NVLink 2 pairs per socket, the sockets joined by a 64 GB/s "
            "X-Bus (both directions), the slowest link of a 4-GPU ring; one EDR InfiniBand port (100 Gb/s) per "
            f"node assumed; {_ASSUMED_LATENCY}",
        ),
        Fabric(
            "pcie4-100gbe",
            8,
            25.0,
            12.5,
            10.0,
            20.0,
            "8 GPUs on PCIe 4.0 x16 (32 GB/s per direction, about 25 through a switch), one 100 Gb/s Ethernet "
            f"port per node; {_ASSUMED_LATENCY}",
        ),
    )
}


def fabric_from_comm_bench(path: Path, devices_per_node: int | None = None) -> Fabric:
    """A :class:`Fabric` from ``vitrain bench --comm --json``: the bus bandwidth and per-hop latency fitted
    to its all-reduce times, for both intra- and inter-node (one machine measured: the same figures)."""
    try:
        record = json.loads(Path(path).read_text())
        fits = record["fit"]
        measured = tuple((op, float(fits[op]["bus_gbs"]), float(fits[op]["latency_us"])) for op in COLLECTIVES)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--network {path}: not a `vitrain bench --comm --json` record ({error})") from None
    per_node = devices_per_node or int(record.get("world_size", 1))
    source = f"measured by vitrain bench --comm ({record.get('backend', '?')}, {record.get('world_size')} processes)"
    _, gbs, latency_us = measured[0]
    return Fabric(f"measured:{Path(path).name}", per_node, gbs, gbs, latency_us, latency_us, source, measured)


def resolve_fabric(text: str, devices_per_node: int | None = None) -> Fabric:
    """A preset's name or a ``bench --comm`` JSON path; ``devices_per_node`` replaces the preset's."""
    if text in FABRICS:
        fabric = FABRICS[text]
        return dataclasses.replace(fabric, devices_per_node=devices_per_node) if devices_per_node else fabric
    if text.endswith(".json"):
        return fabric_from_comm_bench(Path(text), devices_per_node)
    raise ValueError(f"--network {text!r}: give a preset ({', '.join(FABRICS)}) or a `vitrain bench --comm` JSON")


# --- ring collectives ---------------------------------------------------------------------------------

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def wire_bytes(op: str, size: float, ranks: int) -> float:
    """Bytes each rank sends for a ring ``op`` over ``size`` bytes (the whole tensor: all-gather's output,
    reduce-scatter's input)."""
    if ranks <= 1:
        return 0.0
    share = (ranks - 1) / ranks * size
    return 2 * share if op == "all_reduce" else share


def ring_seconds(op: str, size: float, ranks: int, fabric: Fabric, span_nodes: bool) -> float:
    """Time of a ring ``op`` of ``size`` bytes: bytes sent over the bus bandwidth, plus a latency per hop."""
    if ranks <= 1 or size <= 0:
        return 0.0
    bandwidth, hop = fabric.link(op, span_nodes)
    return wire_bytes(op, size, ranks) / bandwidth + hops(op, ranks) * hop


def hops(op: str, ranks: int) -> int:
    return (2 if op == "all_reduce" else 1) * (ranks - 1)


def fit_alpha_beta(op: str, points: list[tuple[int, int, float]]) -> dict[str, Any]:
    """Least-squares ``t = hops * latency + wire_bytes / bandwidth`` over the times of ring ``op`` at
    ``(ranks, bytes, seconds)``; returns bus GB/s and µs per hop, with the fit's largest relative error."""
    rows = [(hops(op, ranks), wire_bytes(op, size, ranks), seconds) for ranks, size, seconds in points]
    # weights 1/t: relative errors count, not the large messages' absolute ones
    sxx = sum((h / t) ** 2 for h, _, t in rows)
    syy = sum((b / t) ** 2 for _, b, t in rows)
    sxy = sum(h * b / t**2 for h, b, t in rows)
    sx1 = sum(h / t for h, _, t in rows)
    sy1 = sum(b / t for _, b, t in rows)
    det = sxx * syy - sxy * sxy
    if det <= 0:
        raise ValueError(f"the {op} times do not determine a latency and a bandwidth")
    latency = (sx1 * syy - sy1 * sxy) / det
    inverse_bw = (sxx * sy1 - sxy * sx1) / det
    if inverse_bw <= 0:
        raise ValueError(f"the {op} times did not grow with the message size")
    latency = max(latency, 0.0)
    worst = max(abs(h * latency + b * inverse_bw - t) / t for h, b, t in rows)
    return {"bus_gbs": 1 / inverse_bw / 1e9, "latency_us": 1e6 * latency, "max_relative_error": worst}


def nodes_spanned(ranks: int, devices_per_node: int) -> int:
    return max(1, math.ceil(ranks / devices_per_node))
