"""Training-step throughput on synthetic data, through the training code path.

The model is built as training builds it (meta device -> materialize -> ``init_weights``), the
optimizer by ``build_optimizer`` and the step is :class:`~vitrain.train.step.TrainStep`
(forward, loss, backward, grad clipping, optimizer; the LR stays at its peak, as setting it is
outside the step). The batch is random uint8 images, normalized once on the device before the clock
starts, with random labels: this measures the step, not the input pipeline.

Timing: ``warmup`` steps (compilation included) are excluded; then ``repeats`` windows of
``steps`` steps each, every window closed by a device synchronisation (``torch.cuda.synchronize``;
on CPU ``loss.item()``). The median window gives img/s and ms per step; min and max give the spread.
MFU = 3 x analytic forward FLOPs x img/s / peak FLOP/s of the device for the dtype
(``vitrain.metrics.utilization``, which the training loop's metrics lines use too).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from vitrain.bench.breakdown import format_breakdown, profile_breakdown
from vitrain.bench.memory import PeakMemory
from vitrain.config import ConfigError, Plan
from vitrain.metrics.records import run_environment
from vitrain.metrics.utilization import achieved_tflops, training_flops, utilization
from vitrain.models import num_parameters
from vitrain.models.flops import model_flops
from vitrain.parallel.parallelize import compile_mode_argument
from vitrain.train.attention_probe import attention_impl
from vitrain.train.build import build_training_step, run_peaks
from vitrain.train.summary import describe_precision
from vitrain.train.timing import synchronize, synthetic_batch

log = logging.getLogger("vitrain")

# A step takes (images, labels) and returns (loss, grad norm or None) as device tensors.
StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """How long to measure, and whether to compile the model first."""

    steps: int = 10
    """Steps per timed window."""
    warmup: int = 3
    """Untimed steps before the first window (compilation happens here)."""
    repeats: int = 5
    """Timed windows; img/s is their median."""
    compile: bool = False
    """``torch.compile`` the module that runs the forward pass."""
    compile_backend: str = "inductor"
    """torch.compile backend (tests use ``eager`` to exercise the path quickly)."""
    compile_mode: str = "default"
    """torch.compile mode (``performance.compile_mode``), for our model and timm's."""
    profile: int = 0
    """Steps profiled after the timed windows for the step breakdown (0: none)."""

    def __post_init__(self) -> None:
        minimums = (("steps", 1), ("repeats", 1), ("warmup", 1 if self.compile else 0), ("profile", 0))
        for name, minimum in minimums:
            value = getattr(self, name)
            if value < minimum:
                why = " with --compile (compilation must stay out of the timed windows)" if name == "warmup" else ""
                raise ConfigError(f"--{name} must be >= {minimum}{why}; got {value}")

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps * self.repeats


def bench_overrides(
    model: str, image_size: int, batch: int, precision: str, precision_mode: str | None, settings: BenchSettings
) -> list[str]:
    """``--set`` style overrides that turn a recipe into a benchmark config: the bench flags, synthetic
    data (the recipe's data path, limits and normalization do not apply), one batch per epoch, and as
    many steps as the benchmark runs."""
    overrides = [
        f"model.name={model}",
        f"data.image_size={image_size}",
        f"train.batch_size={batch}",
        f"precision={precision}",
        "data.name=synthetic",
        "data.root=null",
        "data.mean=null",
        "data.std=null",
        "data.limit_train=null",
        f"data.synthetic_num_train={max(batch, 1)}",  # a bad batch is reported as train.batch_size
        f"train.steps={settings.total_steps}",
    ]
    if precision_mode is not None:
        overrides.append(f"precision_mode={precision_mode}")
    return overrides


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Seconds of the warm-up, of its first step (compilation included) and of each timed window."""

    warmup_s: float
    first_step_s: float | None
    window_s: tuple[float, ...]
    final_loss: float


def time_training_steps(
    step: StepFn, images: torch.Tensor, labels: torch.Tensor, device: str, settings: BenchSettings
) -> StepTimes:
    """Run the warm-up, then ``repeats`` windows of ``steps`` steps, each closed by a device sync."""
    started = time.perf_counter()
    first_step_s = None
    for index in range(settings.warmup):
        loss, _ = step(images, labels)
        if index == 0:
            synchronize(device, loss)
            first_step_s = time.perf_counter() - started
    if settings.warmup:
        synchronize(device, loss)
    warmup_s = time.perf_counter() - started
    windows = []
    for _ in range(settings.repeats):
        started = time.perf_counter()
        for _ in range(settings.steps):
            loss, _ = step(images, labels)
        synchronize(device, loss)
        windows.append(time.perf_counter() - started)
    return StepTimes(warmup_s, first_step_s, tuple(windows), loss.item())


def window_ms(function: Callable[[], Any], repeats: int, calls: int, warmup: int = 0) -> list[float]:
    """Milliseconds per call of ``function`` in each of ``repeats`` windows of ``calls`` calls,
    after ``warmup`` untimed calls: the timing of the CPU micro-benchmarks under ``bench/``."""
    for _ in range(warmup):
        function()
    windows = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            function()
        windows.append((time.perf_counter() - started) / calls * 1e3)
    return windows


def throughput_record(
    plan: Plan, times: StepTimes, settings: BenchSettings, flops_per_image: int, memory: PeakMemory
) -> dict[str, Any]:
    """The measured figures of one benchmark: img/s (global), ms/step, FLOPs, MFU per device, peak memory."""
    batch, devices = plan.batch.global_batch, plan.world.size
    rates = [batch * settings.steps / seconds for seconds in times.window_s]
    train_flops_per_step = training_flops(flops_per_image, batch)
    img_s_median = statistics.median(rates)
    tflops = achieved_tflops(training_flops(flops_per_image, 1) * img_s_median) / devices  # per device
    peak, bf16_peak = run_peaks(plan)
    mfu, mfu_reason = utilization(tflops, peak)
    bf16_equivalent = {} if bf16_peak is None else {"mfu_bf16_equivalent": utilization(tflops, bf16_peak)[0]}
    return {
        "world_size": devices,
        "img_s_median": img_s_median,
        "img_s_per_device": img_s_median / devices,
        "img_s_min": min(rates),
        "img_s_max": max(rates),
        "step_ms_median": 1000 * statistics.median(times.window_s) / settings.steps,
        "warmup_s": times.warmup_s,
        "compile_s": times.first_step_s if settings.compile else None,
        "final_loss": times.final_loss,
        "flops_per_image_fwd": flops_per_image,
        "train_flops_per_step": train_flops_per_step,
        "achieved_tflops": tflops,
        "peak_tflops": peak.tflops,
        "peak_source": peak.source,
        "mfu": mfu,
        "mfu_reason": mfu_reason,
        **bf16_equivalent,
        "peak_memory_bytes": memory.bytes,
        "peak_memory_source": memory.source,
        "peak_memory_reason": memory.reason,
    }


def describe_run(plan: Plan, settings: BenchSettings) -> dict[str, Any]:
    """What was benchmarked and where: the fields shared by our measurement and the timm reference."""
    return {
        "image_size": plan.model.image_size,
        "batch": plan.batch.global_batch,
        "precision": plan.precision.name,
        "fp8_scaling": plan.precision.fp8_scaling,
        "compile": settings.compile,
        "compile_mode": settings.compile_mode if settings.compile else None,
        "steps": settings.steps,
        "warmup": settings.warmup,
        "repeats": settings.repeats,
        "device": plan.device,
        "threads": torch.get_num_threads(),
        "host_allocator": plan.runtime.host_allocator,  # the process's, so timm's run has it too
        **run_environment(plan.device),
    }


def apply_compile(module: nn.Module, settings: BenchSettings) -> None:
    """Compile ``module`` in place (its parameters and state-dict keys stay the same)."""
    if settings.compile:
        module.compile(backend=settings.compile_backend, mode=compile_mode_argument(settings.compile_mode))


def with_bench_compile(plan: Plan, settings: BenchSettings) -> Plan:
    """The plan with the benchmark's ``--compile``: the whole module that runs the forward pass, or per
    block, as training compiles, under activation checkpointing (around checkpointed blocks a whole-model
    graph saves other tensors than the eager recomputation in backward does: CheckpointError)."""
    if not settings.compile:
        return plan
    scope = "blocks" if plan.parallel.activation_checkpointing else "model"
    parallel = dataclasses.replace(
        plan.parallel,
        compile=True,
        compile_backend=settings.compile_backend,
        compile_mode=settings.compile_mode,
        compile_scope=scope,
    )
    return dataclasses.replace(plan, parallel=parallel)


def measure_training_step(plan: Plan, settings: BenchSettings) -> dict[str, Any]:
    """Time the plan's training step; return one flat record (see docs/benchmarks.md for the fields)."""
    memory = PeakMemory(plan.device)
    memory.start()
    step = build_training_step(with_bench_compile(plan, settings))
    model = step.model
    model.train()
    images, labels = synthetic_batch(plan)
    log.info(
        "bench %s: batch %d at %d px, %s on %s, %d warm-up + %d x %d steps",
        plan.model.name,
        plan.batch.global_batch,
        plan.model.image_size,
        describe_precision(plan.precision),
        plan.device,
        settings.warmup,
        settings.repeats,
        settings.steps,
    )
    times = time_training_steps(step, images, labels, plan.device, settings)
    memory.stop()
    optim = plan.optim
    flops = model_flops(model, plan.model.image_size)
    record = throughput_record(plan, times, settings, flops, memory)
    return {
        "implementation": "vitrain",
        "model": plan.model.name,
        "recipe": plan.config.recipe,
        **describe_run(plan, settings),
        "precision_mode": plan.precision.mode,
        "optimizer": f"{optim.name} {optim.implementation} (vitrain build_optimizer)",
        "attn_impl": attention_impl(model),
        "grad_clip": plan.step.grad_clip,
        "num_params": num_parameters(model),
        **record,
        **breakdown_record(step, images, labels, plan.device, settings, record),
    }


def breakdown_record(
    step: StepFn, images: torch.Tensor, labels: torch.Tensor, device: str, settings: BenchSettings, record: dict
) -> dict[str, Any]:
    """``{"step_breakdown": ...}`` of ``settings.profile`` more steps under ``torch.profiler`` (nothing when it
    is 0); called after :func:`time_training_steps`, whose last window ended with a device sync."""
    if not settings.profile:
        return {}
    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        started = time.perf_counter()
        for _ in range(settings.profile):
            loss, _ = step(images, labels)
        synchronize(device, loss)
        profiled_s = time.perf_counter() - started
    flops = record["train_flops_per_step"]
    return {"step_breakdown": profile_breakdown(prof, settings.profile, profiled_s, flops, cuda)}


# --- Console table (derived from the JSON record) -------------------------------------------------

_TABLE_ROWS = (
    ("model", "model"),
    ("timm reference", "timm_reference"),
    ("image size", "image_size"),
    ("batch", "batch"),
    ("precision", "precision"),
    ("precision mode", "precision_mode"),
    ("optimizer", "optimizer"),
    ("attention", "attn_impl"),
    ("compile", "compile"),
    ("compile mode", "compile_mode"),
    ("device", "device"),
    ("device name", "device_name"),
    ("threads", "threads"),
    ("img/s median", "img_s_median"),
    ("img/s min", "img_s_min"),
    ("img/s max", "img_s_max"),
    ("ms/step median", "step_ms_median"),
    ("warm-up s", "warmup_s"),
    ("compile s", "compile_s"),
    ("params", "num_params"),
    ("GFLOPs/image fwd", "flops_per_image_fwd"),
    ("TFLOPs/step train", "train_flops_per_step"),
    ("achieved TFLOP/s", "achieved_tflops"),
    ("peak TFLOP/s", "peak_tflops"),
    ("MFU", "mfu"),
    ("peak memory MiB", "peak_memory_bytes"),
    ("torch", "torch"),
    ("git revision", "git_revision"),
)
_SCALES = {"flops_per_image_fwd": 1e9, "train_flops_per_step": 1e12, "peak_memory_bytes": 2**20}


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in _SCALES:
        value = value / _SCALES[key]
    if key == "mfu":
        return f"{100 * value:.1f} %"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


_TIMM_COLUMNS = (("timm", "timm"), ("timm eager", "timm_eager"))
"""The timm records of ``--compare-timm`` (and ``--timm-eager``): column name, key in the result."""


def format_table(result: dict[str, Any]) -> str:
    """One table: a column for our measurement and, after ``--compare-timm``, one for timm's."""
    columns = {result["implementation"]: result} | {name: result[key] for name, key in _TIMM_COLUMNS if key in result}
    names, records = list(columns), list(columns.values())
    rows = [("", *names)]
    for label, key in _TABLE_ROWS:
        if any(record.get(key) is not None for record in records):
            rows.append((label, *[_cell(key, record.get(key)) for record in records]))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    notes = []
    for name, record in columns.items():
        notes.append(f"{name} peak: {record['peak_source']}")
        for key in ("peak_memory_reason", "mfu_reason"):
            if record.get(key):
                notes.append(f"{name} {key.removesuffix('_reason').replace('_', ' ')}: {record[key]}")
    if "ours_over_timm" in result:
        notes.append(f"vitrain / timm img/s: {result['ours_over_timm']:.3f}")
    if "ours_over_timm_eager" in result:
        notes.append(f"vitrain / timm eager img/s: {result['ours_over_timm_eager']:.3f}")
    notes += [
        format_breakdown(name, record["step_breakdown"])
        for name, record in columns.items()
        if "step_breakdown" in record
    ]
    return "\n".join(lines + notes)
