"""``precision=auto``, ``precision_mode=auto`` and ``performance.cpu_kernels=auto``: chosen by timing the run's
own training step on this machine, never by a library's capability flag.

Before the run starts, each candidate way of computing its step is built as the run builds it (model,
converters, optimizer, step: :func:`~vitrain.train.build.build_training_step`) and timed for a few steps on
random images of the run's shape, at its per-process batch:

- precision: fp32, and bf16 (on a CPU always, native or emulated; on CUDA where the GPU has bf16). fp16 is
  never a candidate: its loss scaling and narrow range are the user's decision;
- mode: autocast and O2 where ``precision_mode=auto``, else the mode set;
- the fused CPU kernels off and on where ``performance.cpu_kernels=auto`` and they apply (CPU bf16 outside
  autocast, or with AMX tiles). They are built (minutes, once per machine and torch) only when a bf16
  candidate with PyTorch's ops comes within :data:`KERNEL_REACH` of the fastest: on a CPU that emulates
  bf16 they cannot win, and nothing is built.

The fastest candidate is taken. The choice and every figure it rests on are logged, kept in
``summary.json``, and shown by ``vitrain show-config`` and ``vitrain doctor``; they are cached
(:mod:`vitrain.train.choices`) per device as it computes, model and shape, batch, optimizer and candidate
set, so later runs start at once. An explicit setting is never overridden: only ``auto`` settings have
candidates. Under several processes rank 0 measures, alone, and the others take its answer. What the
probe leaves out of the step: ``torch.compile`` (it times eager steps), the distillation teacher and
token labeling's targets, and the parallel wrapper.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import time
from typing import Any

import torch

from vitrain import kernels
from vitrain.checkpoint.rng import capture_rng_state, restore_rng_state
from vitrain.config import (
    Config,
    ConfigError,
    DatasetInfo,
    DistillConfig,
    EmaConfig,
    Hardware,
    MeasuredPrecision,
    Plan,
    TokenLabelConfig,
    World,
    resolve,
)
from vitrain.config.resolve import amx_tiles_for, kernels_can_apply
from vitrain.models import model_facts
from vitrain.parallel.distributed import active as distributed_active
from vitrain.parallel.distributed import broadcast_object
from vitrain.train.choices import cache_path, device_key, measured_entry, model_key
from vitrain.train.timing import synchronize, synthetic_batch

log = logging.getLogger("vitrain")

KERNEL_REACH = 1.3
"""The most the fused CPU kernels are allowed to make up: a margin above the largest step speed-up measured
for them (bf16 O2 with the kernels against autocast; docs/benchmarks.md, "What each technique buys"). A bf16
candidate slower than the fastest by more than this is not worth building them for."""
WARMUP_STEPS = 1
TIMED_STEPS = 3
GIVE_UP = 2.0
"""A candidate whose first timed step is this many times slower than the fastest so far stops there..."""
GIVE_UP_WARM_UP = 4.0
"""...and one whose warm-up step is this many times slower than the fastest warm-up so far stops before its
timed steps (its warm-up gives its rate: emulated bf16 on an AVX2 CPU is many times slower than fp32)."""
MAX_STEP_S = 3.0
"""Where a step at the run's batch takes longer (after its warm-up: a GPU's first step holds its start-up),
the probe times a smaller batch, the same for every candidate, so that it stays within seconds."""
BUILD_FAILED = "could not be built"


@dataclasses.dataclass(frozen=True)
class Candidate:
    precision: str
    mode: str
    kernels: str
    """``fused`` or ``native`` (PyTorch's ops)."""

    @property
    def label(self) -> str:
        if self.precision == "fp32":
            return "fp32"
        return f"{self.precision} {self.mode}" + (" + fused kernels" if self.kernels == "fused" else "")

    def apply(self, config: Config) -> Config:
        """``config`` computing as this candidate does."""
        changed = config.model_copy(deep=True)
        changed.precision, changed.precision_mode = self.precision, self.mode
        changed.performance.cpu_kernels = self.kernels
        return changed


def candidates(config: Config, device: str, hardware: Hardware) -> list[Candidate]:
    """The ways of computing the run's step that its ``auto`` settings leave open, fp32 first."""
    if config.precision == "auto":
        precisions = ["fp32", "bf16"] if (hardware.bf16_supported or not device.startswith("cuda")) else ["fp32"]
    else:
        precisions = [config.precision]
    found = []
    for precision in precisions:
        if precision == "fp32":
            found.append(Candidate("fp32", "autocast", "native"))
            continue
        modes = ["autocast", "o2"] if config.precision_mode == "auto" else [config.precision_mode]
        for mode in modes:
            if not kernels_can_apply(device, precision, mode, amx_tiles_for(config, hardware)):
                options = ["native"]
            elif config.performance.cpu_kernels == "auto":
                options = ["native", "fused"]
            else:
                options = [config.performance.cpu_kernels]
            found += [Candidate(precision, mode, option) for option in options]
    return found


def probe_config(config: Config, per_process_batch: int) -> Config:
    """The single-process config whose step the probe times: the run's model, shape, optimizer and step at
    the per-process batch, without compile, teacher, token labels, curriculum or parallel wrapper."""
    probe = config.model_copy(deep=True)
    probe.parallel.strategy, probe.parallel.tp_size = "ddp", 0
    probe.train.batch_size = per_process_batch
    if probe.train.micro_batch_size is not None:
        probe.train.micro_batch_size = min(probe.train.micro_batch_size, per_process_batch)
    probe.performance.compile = False
    probe.train.distill, probe.token_labels, probe.train.ema = DistillConfig(), TokenLabelConfig(), EmaConfig()
    probe.train.init_from = None
    probe.curriculum.stages, probe.curriculum.start_size = [], None
    probe.train.steps, probe.train.epochs, probe.train.samples, probe.train.budget = 1000, None, None, None
    return probe


def _key(plan: Plan, found: list[Candidate]) -> str:
    model, optim = plan.model, plan.optim
    return (
        f"precision | {device_key(plan.device)} | {model_key(model)} | batch {plan.batch.per_process(plan.batch.global_batch)} micro "
        f"{plan.batch.micro_batch} | {optim.name} {optim.implementation}, clip {plan.step.grad_clip} | checkpointing "
        f"{plan.parallel.activation_checkpointing}, channels_last {plan.runtime.channels_last} | candidates "
        f"{', '.join(candidate.label for candidate in found)}"
    )


@contextlib.contextmanager
def _quiet_probe():
    """The candidates' builds log below INFO (their attention probes, ...); RNG streams are as they were
    after the probe, so the run's own build is unchanged by it."""
    level, rng = log.level, capture_rng_state()
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)
        restore_rng_state(rng)


def time_candidate(
    plan: Plan, best_step_s: float | None = None, best_first_s: float | None = None, max_step_s: float | None = None
) -> tuple[float, float]:
    """(img/s, seconds of the warm-up step) of ``plan``'s training step: a warm-up step, then
    :data:`TIMED_STEPS` steps each closed by a device sync (the fastest: other work on the machine only ever
    adds time); fewer when the first is :data:`GIVE_UP` times slower than ``best_step_s`` or slower than
    ``max_step_s``, none when the warm-up is :data:`GIVE_UP_WARM_UP` times slower than ``best_first_s``."""
    from vitrain.train.build import build_training_step

    step = build_training_step(plan)
    step.model.train()
    images, labels = synthetic_batch(plan)
    try:
        started = time.perf_counter()
        for _ in range(WARMUP_STEPS):
            loss, _ = step(images, labels)
        synchronize(plan.device, loss)
        first_s = time.perf_counter() - started
        if best_first_s is not None and first_s > GIVE_UP_WARM_UP * best_first_s:
            return len(labels) * WARMUP_STEPS / first_s, first_s
        times = []
        for _ in range(TIMED_STEPS):
            started = time.perf_counter()
            loss, _ = step(images, labels)
            synchronize(plan.device, loss)
            times.append(time.perf_counter() - started)
            if (best_step_s is not None and times[0] > GIVE_UP * best_step_s) or times[0] > (max_step_s or math.inf):
                break
        return len(labels) / min(times), first_s
    finally:
        del step
        gc.collect()
        if plan.device.startswith("cuda"):
            torch.cuda.empty_cache()


class _Probe:
    """One measurement: the candidates' plans at one batch, timed in order."""

    def __init__(self, config: Config, info: DatasetInfo, hardware: Hardware, batch: int, may_build: bool):
        self.config, self.info, self.hardware, self.batch = config, info, hardware, batch
        self.may_build = may_build
        self.img_s: dict[str, float] = {}
        self.skipped: dict[str, str] = {}
        self.best_first_s: float | None = None

    def plan_of(self, candidate: Candidate) -> Plan:
        return resolve(candidate.apply(probe_config(self.config, self.batch)), self.info, self.hardware, model_facts)

    def best_step_s(self) -> float | None:
        return self.batch / max(self.img_s.values()) if self.img_s else None

    def measure(self, candidate: Candidate, max_step_s: float | None = None) -> float | None:
        """Seconds of one of the candidate's steps after its warm-up (None: it could not run, see ``skipped``)."""
        if candidate.kernels == "fused" and not self._kernels_ready(candidate):
            return None
        try:
            rate, first_s = time_candidate(self.plan_of(candidate), self.best_step_s(), self.best_first_s, max_step_s)
        except (RuntimeError, ConfigError) as error:  # out of memory, a refused combination, a failed build
            self.skipped[candidate.label] = str(error).strip().splitlines()[0][:200] if str(error).strip() else "failed"
            return None
        self.img_s[candidate.label] = rate
        self.best_first_s = min(first_s, self.best_first_s or first_s)
        return self.batch / rate

    def _kernels_ready(self, candidate: Candidate) -> bool:
        if not self.may_build and kernels.build.cache_state()[0] != "fresh":
            self.skipped[candidate.label] = "not built yet (a run builds them when bf16 comes within reach)"
            return False
        if kernels.build.cache_state()[0] != "fresh":
            log.warning("building the fused CPU kernels to time them (once per machine and torch; minutes)")
        if kernels.load() is None:
            self.skipped[candidate.label] = f"{BUILD_FAILED}: {kernels.build.failure()}"
            return False
        return True


def affordable_batch(plan: Plan, batch: int) -> int:
    """The largest batch up to ``batch`` whose training FLOPs (3 x the analytic forward, ``vitrain.models.flops``)
    the device could do in :data:`MAX_STEP_S` at its fp32 peak (CPU: the measured matmul probe; CUDA: the
    datasheet's): the batch the probe starts from, so that a large model on a CPU is never first timed at a
    batch that takes minutes a step or all the memory."""
    from vitrain.metrics.peak import measure_cpu_peak, peak_flops
    from vitrain.models import build_model
    from vitrain.models.flops import model_flops

    model = build_model(plan.model.name, device="meta", **plan.model.arguments)
    flops = 3 * model_flops(model, plan.model.image_size)
    peak = peak_flops(plan.device, "fp32") if plan.device.startswith("cuda") else measure_cpu_peak("fp32")
    if not peak.tflops or flops <= 0:
        return batch
    return max(1, min(batch, int(MAX_STEP_S * peak.tflops * 1e12 / flops)))


def _measure(
    config: Config, info: DatasetInfo, hardware: Hardware, batch: int, found: list[Candidate], may_build: bool
) -> dict[str, Any]:
    """The cache entry: each candidate's img/s, those skipped and why, the batch timed and the choice."""
    batch = affordable_batch(resolve(probe_config(config, batch), info, hardware, model_facts), batch)
    probe = _Probe(config, info, hardware, batch, may_build)
    native = [candidate for candidate in found if candidate.kernels != "fused"]
    step_s = probe.measure(native[0], MAX_STEP_S) if native else None
    if step_s is not None and step_s > MAX_STEP_S and batch > 1:  # seconds a step: time a smaller batch
        probe = _Probe(config, info, hardware, max(1, int(batch * MAX_STEP_S / step_s)), may_build)
        probe.measure(native[0])
    for candidate in native[1:]:
        probe.measure(candidate)
    if not probe.img_s:
        raise ConfigError(f"no way of computing this run's step could run here: {probe.skipped}")
    best = max(probe.img_s.values())
    for candidate in found:
        if candidate.kernels != "fused":
            continue
        twin = probe.img_s.get(dataclasses.replace(candidate, kernels="native").label)
        if twin is not None and twin * KERNEL_REACH < best:
            probe.skipped[candidate.label] = f"cannot win: PyTorch's ops {twin:.0f} img/s, fastest {best:.0f}"
        else:
            probe.measure(candidate)
    chosen = max(probe.img_s, key=probe.img_s.get)
    return {"img_s": probe.img_s, "skipped": probe.skipped, "batch": probe.batch, "chosen": chosen}


def _complete(entry: dict[str, Any]) -> bool:
    """A cached answer stands unless a candidate was left out for a reason that may pass (kernels not built)."""
    reasons = entry.get("skipped", {}).values()
    return "chosen" in entry and not any(BUILD_FAILED in why or "not built yet" in why for why in reasons)


def _runs_as_configured(
    candidate: Candidate, config: Config, info: DatasetInfo, hardware: Hardware, world: World
) -> bool:
    """Whether the run itself admits the candidate (tensor parallelism refuses O2, FSDP fp16, ...): the probe
    times a single process, which admits more."""
    try:
        resolve(candidate.apply(config), info, hardware, model_facts, world=world)
    except ConfigError:
        return False
    return True


def measure_precision(
    config: Config, info: DatasetInfo, hardware: Hardware, world: World | None = None, may_build: bool = True
) -> MeasuredPrecision | None:
    """What the ``auto`` settings of ``config`` choose on this machine (None: nothing to choose). Resolves the
    run first, so that its mistakes are reported before any measurement. ``may_build=False`` (the doctor):
    fused kernels not yet built are left out, not built."""
    world = world or World()
    plan = resolve(
        config, info, hardware, model_facts, world=world
    )  # the run's device and batch; errors before any work
    found = [
        candidate
        for candidate in candidates(config, plan.device, hardware)
        if _runs_as_configured(candidate, config, info, hardware, world)
    ]
    if len(found) < 2:
        return None
    kernels.use_amx_tiles(plan.runtime.amx_tiles)  # as each candidate's build sets it: the cache key says so
    entry = None
    if world.is_main or not distributed_active():  # rank 0 measures; a process alone measures for itself
        batch = plan.batch.per_process(plan.batch.global_batch)
        with _quiet_probe():
            entry, cached = measured_entry(
                _key(plan, found), lambda: _measure(config, info, hardware, batch, found, may_build), _complete
            )
        entry = {**entry, "cached": cached}
    entry = broadcast_object(entry)
    chosen = next(candidate for candidate in found if candidate.label == entry["chosen"])
    measured = MeasuredPrecision(
        precision=chosen.precision,
        mode=chosen.mode,
        cpu_kernels="auto" if chosen.kernels == "fused" else "native",
        img_s=entry["img_s"],
        chosen=chosen.label,
        batch=entry["batch"],
        skipped=entry["skipped"],
        cached=entry["cached"],
    )
    where = f" (cached in {cache_path()}: delete it to measure again)" if measured.cached else ""
    log.info("auto: %s%s", measured.describe(), where)
    return measured


__all__ = ["KERNEL_REACH", "Candidate", "candidates", "measure_precision", "probe_config", "time_candidate"]
