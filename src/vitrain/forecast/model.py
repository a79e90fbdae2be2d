"""The forecast: one device's measured step, the model's sizes, the parallel layout, the network and the data
in; for each device count, the step's time (compute, then the communication the overlap leaves exposed),
img/s, memory per device, bytes on the wire, what storage must serve, and the first limit reached.

Compute. The measured single-device step time at the measured batch, scaled linearly to the per-device
micro-batch; forward one third of it, backward two thirds, each spread over the FSDP units by their FLOPs.
Tensor parallelism divides the FLOPs of the layers it splits by its degree. Processes that share one
machine's cores (``shared_host``: the local CPU check) share its compute: N of them take N times as long,
and their collectives run on the same cores, so nothing overlaps.

Communication (ring collectives over :class:`~vitrain.forecast.fabrics.Fabric`; a group that spans nodes
runs at the slower of NVLink and the node's network):

- DDP all-reduces the gradients in buckets (1 MiB, then 25 MiB) as the backward produces them (last unit first), once per
  optimizer step (``no_sync`` for the other micro-steps); the exposed time is what runs past the backward.
- FSDP2 all-gathers each unit's parameters before its forward (the next one prefetched while one computes),
  again before its backward when resharded after the forward, and reduce-scatters its gradients after its
  backward, every micro-step; one comm stream, in the order FSDP2 issues them.
- Tensor parallelism all-reduces each block's output after its two row-parallel layers, in the forward and
  again in the backward, inside the node, not overlapped.
- Muon under sharding gathers every matrix's update (fp32) to orthogonalize it whole, after the backward.

Memory: the measured peak minus the model's states (parameters, gradients, optimizer states, O2's copy: the
bytes per parameter of the precision mode) is the activations, scaled with the micro-batch; FSDP divides the
states by the data-parallel degree and adds the two largest units gathered (and the root, kept gathered);
tensor parallelism divides the states and the split layers' activations by its degree.

Data: every image is read once per epoch: storage GB/s is img/s times the mean file size; IOPS one file
open-and-read per image (a shard read in 1 MiB requests for shards).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from vitrain.forecast.fabrics import Fabric, nodes_spanned, ring_seconds, wire_bytes
from vitrain.forecast.sizes import ModelSizes

DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20
"""DistributedDataParallel's defaults: the first bucket (the last layers' gradients) holds 1 MiB, so the
all-reduce starts early in the backward; the others 25 MiB."""
SHARD_READ_BYTES = 2**20
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "lamb": 8, "lars": 4, "sgd": 4, "muon": 4}
"""Optimizer state per parameter (fp32): AdamW's two moments, SGD's and Muon's momentum."""


@dataclasses.dataclass(frozen=True)
class Measured:
    """One device's training step, as a benchmark measured it (or as a publication states it)."""

    step_s: float
    batch: int
    precision: str
    precision_mode: str
    optimizer: str
    memory_bytes: int | None
    device_name: str
    source: str

    def state_bytes_per_param(self) -> float:
        """Parameters + gradients + optimizer states (+ O2's low-precision copy and its gradients) per
        parameter."""
        optimizer = OPTIMIZER_STATE_BYTES.get(self.optimizer, 8)
        if self.precision in ("bf16", "fp16", "fp8") and self.precision_mode == "o2":
            return 4 + 4 + optimizer + 2 + 2
        if self.precision in ("bf16", "fp16", "fp8") and self.precision_mode == "full":
            return 2 + 2 + optimizer / 2
        return 4 + 4 + optimizer

    def low_precision_weights(self) -> bool:
        return self.precision in ("bf16", "fp16", "fp8") and self.precision_mode in ("o2", "full")


@dataclasses.dataclass(frozen=True)
class Layout:
    strategy: str  # "ddp" or "fsdp"
    batch_per_device: int
    tensor_parallel: int = 1
    accumulation: int = 1
    reshard_after_forward: bool = True
    shared_host: bool = False
    device_memory_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class Data:
    images: int
    mean_file_bytes: float
    shards: bool = False
    storage_gbs: float | None = None
    """What the storage serves to all nodes together (a limit when given)."""
    decode_img_s_per_core: float | None = None
    """What one CPU core decodes and augments (bench-data); a limit with ``cores_per_node``."""
    cores_per_node: int | None = None
    source: str = ""


def _ddp_backward(sizes: ModelSizes, backward_s: float, grad_bytes: int, ranks: int, fabric: Fabric, span: bool):
    """(wire bytes, comm seconds, exposed seconds) of DDP's bucketed all-reduce during one backward."""
    clock = comm_free = 0.0
    bucket = wire = busy = 0.0
    for unit in reversed(sizes.units):
        clock += backward_s * unit.flops / sizes.flops
        bucket += unit.params * grad_bytes
        if bucket >= (DDP_BUCKET_BYTES if wire else DDP_FIRST_BUCKET_BYTES) or unit is sizes.units[0]:
            seconds = ring_seconds("all_reduce", bucket, ranks, fabric, span)
            comm_free = max(clock, comm_free) + seconds
            wire += wire_bytes("all_reduce", bucket, ranks)
            busy += seconds
            bucket = 0.0
    return wire, busy, max(0.0, comm_free - clock)


def _fsdp_step(
    sizes: ModelSizes,
    forward_s: float,
    backward_s: float,
    gather_bytes: int,
    reduce_bytes: int,
    reshard: bool,
    ranks: int,
    fabric: Fabric,
    span: bool,
):
    """(wire bytes, comm seconds, exposed seconds) of FSDP2's gathers and reduce-scatters in one micro-step."""
    units, share = sizes.units, [unit.flops / sizes.flops for unit in sizes.units]
    wire = busy = 0.0
    comm_free = compute = 0.0

    def issue(op: str, size: float, ready: float) -> float:
        nonlocal comm_free, wire, busy
        seconds = ring_seconds(op, size, ranks, fabric, span)
        comm_free = max(comm_free, ready) + seconds
        wire += wire_bytes(op, size, ranks)
        busy += seconds
        return comm_free

    gathered = {0: issue("all_gather", units[0].params * gather_bytes, 0.0)}
    for index in range(len(units)):  # forward: root, then the blocks
        start = max(compute, gathered[index])
        if index + 1 < len(units):
            gathered[index + 1] = issue("all_gather", units[index + 1].params * gather_bytes, start)
        compute = start + forward_s * share[index]
    order = list(range(len(units) - 1, 0, -1)) + [0]  # backward: the last block first, the root last
    ready = {order[0]: issue("all_gather", units[order[0]].params * gather_bytes, compute) if reshard else compute}
    ready[0] = 0.0  # the root stays gathered
    for position, index in enumerate(order):
        start = max(compute, ready[index])
        following = order[position + 1] if position + 1 < len(order) else None
        if following:
            ready[following] = issue("all_gather", units[following].params * gather_bytes, start) if reshard else 0.0
        compute = start + backward_s * share[index]
        issue("reduce_scatter", units[index].params * reduce_bytes, compute)
    return wire, busy, max(0.0, max(comm_free, compute) - (forward_s + backward_s))


def _compute_s(devices: int, sizes: ModelSizes, measured: Measured, layout: Layout) -> float:
    """One micro-step's compute on one device: the measured step at the micro-batch, tensor parallelism's
    split layers divided by its degree, times the processes sharing one machine's cores."""
    compute = measured.step_s * layout.batch_per_device / measured.batch
    if layout.tensor_parallel > 1:
        split = sum(unit.tp_flops for unit in sizes.units) / sizes.flops
        compute *= 1 - split + split / layout.tensor_parallel
    return compute * devices if layout.shared_host else compute


def _communication(
    devices: int, compute: float, sizes: ModelSizes, measured: Measured, layout: Layout, fabric: Fabric
) -> tuple[float, float, float]:
    """(wire bytes, comm seconds, exposed seconds) of one optimizer step: data parallelism's collectives
    (overlapped as DDP or FSDP2 overlap them), tensor parallelism's and Muon's (not overlapped)."""
    tp, accumulation = layout.tensor_parallel, layout.accumulation
    dp, span = devices // tp, nodes_spanned(devices, fabric.devices_per_node) > 1
    low = measured.low_precision_weights()
    wire = busy = exposed = 0.0
    if dp > 1 and layout.strategy == "ddp":
        wire, busy, exposed = _ddp_backward(sizes, 2 * compute / 3, 2 if low else 4, dp, fabric, span)
    elif dp > 1 and layout.strategy == "fsdp":
        reduce_bytes = 2 if measured.precision_mode == "full" and low else 4
        wire, busy, exposed = (
            value * accumulation
            for value in _fsdp_step(
                sizes,
                compute / 3,
                2 * compute / 3,
                2 if low else 4,
                reduce_bytes,
                layout.reshard_after_forward,
                dp,
                fabric,
                span,
            )  # fmt: skip
        )
    if layout.shared_host:  # the collectives run on the cores that compute: nothing overlaps
        exposed = busy
    if tp > 1:
        activation = (
            layout.batch_per_device * sizes.block_output_numel * (2 if low or measured.precision != "fp32" else 4)
        )
        calls = 4 * (len(sizes.units) - 1) * accumulation  # two row-parallel layers per block, forward and backward
        tp_s = calls * ring_seconds("all_reduce", activation, tp, fabric, False)
        wire += calls * wire_bytes("all_reduce", activation, tp)
        busy += tp_s
        exposed += tp_s
    if measured.optimizer == "muon" and devices > 1 and (layout.strategy == "fsdp" or tp > 1):
        size = sizes.matrix_params * 4
        muon_s = ring_seconds("all_gather", size, devices, fabric, span)
        wire += wire_bytes("all_gather", size, devices)
        busy += muon_s
        exposed += muon_s
    return wire, busy, exposed


def forecast_row(
    devices: int, sizes: ModelSizes, measured: Measured, layout: Layout, fabric: Fabric, data: Data | None
) -> dict[str, Any]:
    """The forecast at ``devices`` devices (a multiple of the tensor-parallel degree)."""
    dp = devices // layout.tensor_parallel
    nodes = nodes_spanned(devices, fabric.devices_per_node)
    compute = _compute_s(devices, sizes, measured, layout)
    wire, busy, exposed = _communication(devices, compute, sizes, measured, layout, fabric)
    step_s = compute * layout.accumulation + exposed
    global_batch = layout.batch_per_device * dp * layout.accumulation
    memory = _memory(sizes, measured, layout, dp)
    row = {
        "devices": devices,
        "nodes": nodes,
        "data_parallel": dp,
        "tensor_parallel": layout.tensor_parallel,
        "global_batch": global_batch,
        "compute_s": compute * layout.accumulation,
        "comm_s": busy,
        "exposed_comm_s": exposed,
        "wire_bytes_per_step": wire,
        "memory_bytes": memory,
        "fits": _fits(memory, layout, devices),
    }
    limits = {"compute": global_batch / step_s}
    if data is not None:
        if data.storage_gbs:
            limits["storage"] = data.storage_gbs * 1e9 / data.mean_file_bytes
        if data.decode_img_s_per_core and data.cores_per_node:
            limits["decode"] = data.decode_img_s_per_core * data.cores_per_node * nodes
    bound = min(limits, key=limits.__getitem__)
    row["img_s"] = limits[bound]
    row["img_s_per_device"] = row["img_s"] / devices
    row["step_s"] = global_batch / row["img_s"]  # the devices wait for data when it is the limit
    if bound == "compute" and exposed > 0.1 * step_s:
        bound = "network"
    row["limit"] = "memory" if row["fits"] is False else bound
    if data is not None:
        row["storage_gbs"] = row["img_s"] * data.mean_file_bytes / 1e9
        per_image_io = data.mean_file_bytes / SHARD_READ_BYTES if data.shards else 1.0
        row["iops"] = row["img_s"] * per_image_io
        row["epoch_s"] = data.images / row["img_s"]
    return row


def _fits(memory: int | None, layout: Layout, devices: int) -> bool | None:
    if memory is None or not layout.device_memory_bytes:
        return None
    return memory * (devices if layout.shared_host else 1) <= layout.device_memory_bytes


def _memory(sizes: ModelSizes, measured: Measured, layout: Layout, dp: int) -> int | None:
    if measured.memory_bytes is None:
        return None
    tp = layout.tensor_parallel
    states = sizes.params * measured.state_bytes_per_param()
    activations = max(measured.memory_bytes - states, 0) * layout.batch_per_device / measured.batch
    if tp > 1:
        activations *= 1 - sizes.tp_activation_share + sizes.tp_activation_share / tp
    per_device_states = states / tp
    gather = 2 if measured.low_precision_weights() else 4
    if layout.strategy == "fsdp" and dp > 1:
        working = (2 * sizes.largest_unit_params + sizes.units[0].params) * gather / tp
        total = per_device_states / dp + working + activations
    else:
        buckets = sizes.params / tp * gather if dp > 1 else 0  # DDP's gradient buckets
        total = per_device_states + buckets + activations
    return int(total)


def device_counts(text: str) -> list[int]:
    """``1-64`` (doubling), ``2,4,64`` or one count."""
    try:
        if "-" in text:
            low, high = (int(part) for part in text.split("-", 1))
            if low < 1:
                raise ValueError
            counts = [2**k for k in range(int(math.log2(max(low, 1))), int(math.log2(max(high, 1))) + 1)]
            counts = [count for count in counts if low <= count <= high]
        else:
            counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise ValueError(f"--devices {text!r}: give a range like 1-1024 (doubling) or counts like 2,4,64")
    return counts


def forecast(
    sizes: ModelSizes, measured: Measured, layout: Layout, fabric: Fabric, counts: list[int], data: Data | None
) -> list[dict[str, Any]]:
    """One row per device count (those the tensor-parallel degree divides), with the scaling efficiency:
    img/s per device against the smallest layout's (processes sharing one machine: the speed-up, ideal 1)."""
    usable = [count for count in counts if count % layout.tensor_parallel == 0]
    if not usable:
        raise ValueError(f"no device count in {counts} is a multiple of --tensor-parallel {layout.tensor_parallel}")
    rows = [forecast_row(count, sizes, measured, layout, fabric, data) for count in usable]
    base = forecast_row(layout.tensor_parallel, sizes, measured, layout, fabric, data)
    for row in rows:
        if layout.shared_host:  # the same cores: the speed-up is the figure (ideal 1.0)
            row["efficiency"] = row["img_s"] / base["img_s"]
        else:
            row["efficiency"] = row["img_s_per_device"] / (base["img_s"] / base["devices"])
    return rows
