"""Where a training step's time goes: ``vitrain bench --profile N``.

After the timed windows, N more steps run under ``torch.profiler``; their time is sorted into
categories by the names of what ran:

- on CUDA, the GPU kernels (CUPTI's start and end of each): per category milliseconds per step,
  the device's busy time (the union of kernel intervals) and its idle time, the gaps where the
  GPU waited for the host;
- on the CPU, the operators' self time (a parallel operator counts once, its wall time on the calling
  thread), and the time outside any operator (Python, the framework's dispatch).

Shares are of the profiled step (the profiler's own cost makes it slower than the timed one, by
little on a GPU; both are reported). ``tensor_tflops`` is the model's training FLOPs per step over the
time of the matrix-product, attention and convolution kernels: how fast the kernels that do nearly
all the arithmetic run, against the peak the MFU uses; what the step spends elsewhere is the rest of
the breakdown.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from torch.autograd import DeviceType
from torch.profiler import profile

# (category, pattern searched in the lowercased kernel or operator name); the first that matches wins
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl|c10d|all_?reduce|all_?gather|reduce_?scatter"),
    (  # autograd's nodes (custom ops' backward wrappers too), and operators that only make views or allocate
        "framework",
        r"^autograd::|^torch::autograd|backward\d+$|^generatedbackwardfor_.*backward$|^vitrain::linear$|"
        r"^(aten::)?(view|t|as_strided|empty|empty_strided|empty_like|transpose|reshape|_reshape_alias|expand|"
        r"permute|unsqueeze|squeeze|select|slice|detach|alias|"
        r"_unsafe_view|split|unbind|result_type|lift_fresh)$",
    ),
    ("optimizer", r"optimizer\.|adam|multi_tensor_apply|_foreach_|muon|linalg_vector_norm|lpnorm|clip_grad"),
    ("loss", r"cross_entropy|log_?softmax|nll_loss"),
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("convolution", r"convolution|conv\d|conv_|_conv(?!ert)|fprop|dgrad|wgrad|winograd"),
    (
        "matmul",
        r"gemm|xmma|nvjet|wgmma|cutlass|cublas|^triton_tem_|_linear_pointwise|weight_gradient|"
        r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$",
    ),
    ("normalization", r"layer_?norm|batch_?norm|group_?norm|rms_?norm"),
    # inductor's fused kernels name every op they hold (``_to_copy`` in most): they count as elementwise
    (
        "copy",
        r"memcpy|memset|catarray|nchwtonhwc|nhwctonchw|^(?!triton_).*copy|"
        r"^aten::(to|clone|contiguous|cat|stack|zero_|fill_|zeros|ones)$",
    ),
    ("elementwise", r"triton_|elementwise|vectorized|reduce|gelu|hardswish|silu|dropout|^aten::|^vitrain::"),
)
DISPLAY_ORDER = (
    "matmul", "attention", "convolution", "normalization", "elementwise", "copy", "optimizer", "loss", "framework",
    "communication", "other",
)  # fmt: skip
"""Every category (with ``other``), in the order tables show them."""
TENSOR_CATEGORIES = ("matmul", "attention", "convolution")
"""The categories whose kernels do (nearly) all of a model's FLOPs."""
_COMPILED = [(name, re.compile(pattern)) for name, pattern in CATEGORIES]
# The forward of a custom op with autograd runs in a function named for its backward; its self time is the
# op's own work (its products are operators of their own), so it counts as the op
_CUSTOM_FORWARD = re.compile(r"^generatedbackwardfor_([a-z0-9]+)_(\w+?)_default$")
TOP_ROWS = 12


def category(name: str) -> str:
    """The category of a kernel or operator name (``other`` when none matches)."""
    lowered = _CUSTOM_FORWARD.sub(r"\1::\2", name.lower())
    return next((label for label, pattern in _COMPILED if pattern.search(lowered)), "other")


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: the time at least one kernel ran."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _device_times(prof: profile) -> tuple[dict[str, list[float]], float]:
    """Per GPU kernel name: [total microseconds, calls]; and the busy microseconds of all of them."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    intervals = []
    for event in prof.events():
        # a record_function span (the optimizer's, compiled regions') is mirrored on the GPU's timeline as a
        # user annotation around the kernels it launched: not a kernel, as torch's own tables count it
        if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue
        start, end = event.time_range.start, event.time_range.end
        totals[event.name][0] += end - start
        totals[event.name][1] += 1
        intervals.append((start, end))
    return totals, busy_us(intervals)


def _operator_times(prof: profile) -> tuple[dict[str, list[float]], float]:
    """Per CPU operator: [self microseconds, calls]; and the sum of their self times."""
    totals = {
        average.key: [float(average.self_cpu_time_total), average.count]
        for average in prof.key_averages()
        if average.self_cpu_time_total > 0
    }
    return totals, sum(total for total, _ in totals.values())


def step_breakdown(
    totals: dict[str, list[float]], busy: float, steps: int, profiled_s: float, train_flops_per_step: int, cuda: bool
) -> dict[str, Any]:
    """The breakdown record from per-name [microseconds, calls] over ``steps`` profiled steps."""
    per_step_ms = 1e-3 / steps
    categories: dict[str, float] = defaultdict(float)
    for name, (total, _) in totals.items():
        categories[category(name)] += total * per_step_ms
    step_ms = 1e3 * profiled_s / steps
    busy_ms = busy * per_step_ms
    tensor_ms = sum(categories.get(name, 0.0) for name in TENSOR_CATEGORIES)
    top = sorted(totals.items(), key=lambda item: -item[1][0])[:TOP_ROWS]
    return {
        "source": "CUDA kernels (CUPTI)" if cuda else "CPU operators' self time",
        "profiled_steps": steps,
        "profiled_step_ms": step_ms,
        "busy_ms": busy_ms,
        "idle_ms": max(0.0, step_ms - busy_ms),
        "categories_ms": dict(sorted(categories.items(), key=lambda item: -item[1])),
        "tensor_tflops": train_flops_per_step / (tensor_ms * 1e-3) / 1e12 if tensor_ms > 0 else None,
        "top": [
            {"name": name[:160], "category": category(name), "ms": total * per_step_ms, "calls": calls / steps}
            for name, (total, calls) in top
        ],
    }


def profile_breakdown(prof: profile, steps: int, profiled_s: float, train_flops_per_step: int, cuda: bool) -> dict:
    """The breakdown of ``steps`` steps that ``prof`` recorded in ``profiled_s`` seconds (GPU kernels on CUDA,
    CPU operators otherwise)."""
    totals, busy = (_device_times if cuda else _operator_times)(prof)
    return step_breakdown(totals, busy, steps, profiled_s, train_flops_per_step, cuda)


def format_breakdown(label: str, breakdown: dict[str, Any]) -> str:
    """Two lines: the categories in ms per step with their share, then busy, idle and kernel TFLOP/s."""
    step_ms = breakdown["profiled_step_ms"]
    parts = [f"{name} {ms:.2f} ms ({100 * ms / step_ms:.0f} %)" for name, ms in breakdown["categories_ms"].items()]
    unused = "idle" if breakdown["source"].startswith("CUDA") else "outside operators"
    tail = f"busy {breakdown['busy_ms']:.2f} ms, {unused} {breakdown['idle_ms']:.2f} ms of {step_ms:.2f} ms/step"
    if breakdown["tensor_tflops"] is not None:
        tail += f"; matmul/attention/conv kernels at {breakdown['tensor_tflops']:.3g} TFLOP/s"
    source = f"{breakdown['source']}, {breakdown['profiled_steps']} steps profiled"
    return f"{label} step breakdown ({source}): " + ", ".join(parts) + f"\n  {tail}"
