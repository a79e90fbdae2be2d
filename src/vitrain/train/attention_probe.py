"""``model.attn_impl=auto``: choose the attention path by measurement, per shape.

Which attention kernel is fastest depends on the device, the dtype, the sequence length and the batch (on
CPUs SDPA's flash backward is slow at short sequences, where explicit matmuls win; on GPUs flash attention
wins from a few hundred tokens, and cuDNN's fused attention can beat it on Hopper). So the choice is not a
table of habits: at model build, a meta-device forward finds each attention layer's (tokens, width, heads);
the candidates (SDPA with torch's choice and the explicit matmul path; on CUDA also SDPA pinned to its
flash, memory-efficient and cuDNN kernels) are timed on one layer of that shape (forward + backward, the
run's precision policy and batch); the fastest is set on every layer of the shape, and a candidate that
cannot run there is left out. Each layer is converted to the fused CPU kernels where the run's model will be
(the plan's ``cpu_kernels``: :func:`vitrain.kernels.wanted`). Results are cached with the other measured
choices (:mod:`vitrain.train.choices`) under the device as it computes, the precision policy, whether the
fused kernels run and the shape, so the probe runs once per machine and shape.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Any

import torch
from torch import nn

from vitrain import kernels
from vitrain.config.precision import PrecisionPolicy
from vitrain.models.layers import SDPA_BACKENDS, Attention
from vitrain.train.choices import device_key, measured_entry

log = logging.getLogger("vitrain")

IMPLEMENTATIONS = ("sdpa", "matmul")
CUDA_IMPLEMENTATIONS = (*IMPLEMENTATIONS, *(impl for impl in SDPA_BACKENDS if impl != "sdpa_math"))
"""On CUDA also SDPA pinned to each fused kernel (its math kernel is never the fastest)."""
NO_KERNEL = ("No available kernel", "No viable backend")
"""What torch's SDPA says when the kernels it may use cannot take the inputs."""
Shape = tuple[int, int, int]  # tokens, width, heads


def attention_shapes(model: nn.Module, images: torch.Tensor) -> dict[Shape, list[Attention]]:
    """Attention layers grouped by the (tokens, width, heads) they see for ``images`` (meta tensors work)."""
    shapes: dict[Shape, list[Attention]] = {}

    def record(module: Attention, inputs: tuple[torch.Tensor, ...]) -> None:
        *_, width = inputs[0].shape  # (B, N, C) tokens, or a (B, H, W, C) grid (VOLO)
        tokens = math.prod(inputs[0].shape[1:-1])
        shapes.setdefault((tokens, width, module.num_heads), []).append(module)

    handles = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, Attention)]
    try:
        with torch.no_grad():
            model(images)
    finally:
        for handle in handles:
            handle.remove()
    return shapes


def time_attention(impl: str, shape: Shape, batch: int, policy: PrecisionPolicy, fused: bool) -> float:
    """Median seconds of one forward + backward of an attention layer of ``shape``, computing as the
    run's training forward does (its weights' dtype, autocast or not; ``fused``: converted to the fused
    CPU kernels, as the run converts its model)."""
    tokens, width, heads = shape
    device, dtype = policy.device, policy.weights_dtype
    generator = torch.Generator(device=device).manual_seed(0)
    module = Attention(width, heads, impl=impl, device=device, dtype=dtype)
    if fused:
        kernels.convert(module)
    x = torch.randn(batch, tokens, width, device=device, dtype=dtype, generator=generator, requires_grad=True)
    context = policy.training_context()

    def run(steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            with context:
                out = module(x)
            out.float().sum().backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        return (time.perf_counter() - started) / steps

    run(2)  # warm-up: kernel selection, allocator
    return statistics.median(run(3) for _ in range(3))


def _key(shape: Shape, batch: int, policy: PrecisionPolicy, fused: bool) -> str:
    tokens, width, heads = shape
    ops = "fused kernels" if fused else "native ops"
    return (
        f"attention | {device_key(policy.device)} | {policy.dtype} {policy.mode}, {ops} | "
        f"batch {batch}, {tokens} tokens, width {width}, {heads} heads"
    )


def candidates(device: str) -> tuple[str, ...]:
    """The implementations the probe times on ``device``."""
    return CUDA_IMPLEMENTATIONS if device.startswith("cuda") else IMPLEMENTATIONS


def measure_candidates(shape: Shape, batch: int, policy: PrecisionPolicy, fused: bool) -> dict[str, Any]:
    """The cache entry of one shape: each candidate's milliseconds per layer step, the fastest as ``impl``;
    a candidate that cannot run at this shape (a pinned SDPA kernel refusing it) under ``unavailable``."""
    seconds, unavailable = {}, {}
    for impl in candidates(policy.device):
        try:
            seconds[impl] = time_attention(impl, shape, batch, policy, fused)
        except RuntimeError as error:
            # only a pinned kernel's refusal of the shape; anything else (out of memory, a CUDA fault) is real
            if impl in IMPLEMENTATIONS or not any(words in str(error) for words in NO_KERNEL):
                raise
            unavailable[impl] = str(error).strip().splitlines()[0][:200]
    return {
        "impl": min(seconds, key=seconds.get),
        **{f"{impl}_ms": 1e3 * s for impl, s in seconds.items()},
        **({"unavailable": unavailable} if unavailable else {}),
    }


def _is_complete(entry: dict, device: str) -> bool:
    """A cached entry answers for every candidate of this device (entries written before a candidate
    existed are measured again)."""
    return "impl" in entry and all(
        f"{impl}_ms" in entry or impl in entry.get("unavailable", {}) for impl in candidates(device)
    )


def choose_attention(
    model: nn.Module, images: torch.Tensor, batch: int, policy: PrecisionPolicy, cpu_kernels: str
) -> dict[Shape, str]:
    """Set the fastest implementation on every attention layer of ``model``; return the choice per shape.
    ``images``: one input of the run's shape (a meta tensor is enough); ``cpu_kernels``: the plan's mode of
    the fused CPU kernels (``auto``, ``fused``, ``native``), which decides whether the layers timed are
    converted to them as the run's model will be."""
    fused = kernels.wanted(policy.device, policy.dtype, cpu_kernels)
    chosen = {}
    for shape, modules in attention_shapes(model, images).items():
        entry, cached = measured_entry(
            _key(shape, batch, policy, fused),
            lambda shape=shape: measure_candidates(shape, batch, policy, fused),
            lambda entry: _is_complete(entry, policy.device),
        )
        chosen[shape] = entry["impl"]
        for module in modules:
            module.impl = entry["impl"]
        timings = ", ".join(
            f"{impl} {entry[f'{impl}_ms']:.2f} ms" for impl in candidates(policy.device) if f"{impl}_ms" in entry
        )
        log.info(
            "attention: %s for %d tokens x %d wide, %d heads (%s per layer step%s)",
            entry["impl"],
            *shape,
            timings,
            ", cached" if cached else "",
        )
    return chosen


def attention_impl(model: nn.Module) -> str | None:
    """The implementation the model's attention layers use: one name, ``mixed``, or None without any."""
    impls = {module.impl for module in model.modules() if isinstance(module, Attention)}
    return impls.pop() if len(impls) == 1 else ("mixed" if impls else None)
