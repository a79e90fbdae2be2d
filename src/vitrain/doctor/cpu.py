"""CPU checks: model, cores, vector ISA, measured matmul peaks, bf16, what ``precision=auto`` picks,
the fused CPU kernels and the thread count."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import torch

from vitrain import cpu_features
from vitrain.doctor.report import Check, Context
from vitrain.hardware import detect_hardware
from vitrain.kernels import build
from vitrain.metrics.peak import measure_cpu_peak

SECTION = "CPU"
PROBE_SIZE, PROBE_SECONDS, PROBE_TRIALS = 2048, 0.3, 3
"""A short matmul probe: about 0.3 s per dtype after one warm-up product."""

# /proc/cpuinfo flag -> the name the report prints, in order of capability
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX512", "avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"}


def check_model(context: Context) -> list[Check]:
    name = cpu_features.cpu_model()
    logical = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    return [
        Check(SECTION, "model", "PASS", name or "unknown", data={"model": name}),
        Check(
            SECTION,
            "cores",
            "PASS",
            f"{usable} usable of {logical} logical",
            data={"logical": logical, "usable": usable},
        ),
    ]


def check_isa(context: Context) -> list[Check]:
    flags = cpu_features.cpu_flags() or set()
    found = [label for flag, label in ISA_FLAGS.items() if flag in flags]
    capability = torch.backends.cpu.get_cpu_capability()
    value = f"{' '.join(found) or 'none of AVX2/AVX512/AMX'} (torch kernels: {capability})"
    data = {"flags": found, "torch_capability": capability}
    if "AVX2" not in found and capability == "DEFAULT":
        fix = "no AVX2: every CPU path runs PyTorch's portable kernels; train on a newer CPU or a GPU"
        return [Check(SECTION, "isa", "WARN", value, fix, data)]
    return [Check(SECTION, "isa", "PASS", value, data=data)]


def check_matmul(context: Context) -> list[Check]:
    checks = []
    for precision in ("fp32", "bf16"):
        peak = measure_cpu_peak(precision, size=PROBE_SIZE, seconds=PROBE_SECONDS, trials=PROBE_TRIALS)
        data = {"tflops": peak.tflops, "size": PROBE_SIZE, "threads": torch.get_num_threads()}
        checks.append(Check(SECTION, f"{precision} matmul", "PASS", f"{peak.tflops:.3f} TFLOP/s", data=data))
    return checks


def check_bf16(context: Context) -> list[Check]:
    native = cpu_features.cpu_bf16_native()
    if native:
        return [Check(SECTION, "bf16", "PASS", cpu_features.bf16_state(), data={"native": True})]
    fix = "train in fp32 on this CPU (precision=auto does where it measures faster), or use a CPU with AVX512-BF16/AMX"
    return [Check(SECTION, "bf16", "WARN", cpu_features.bf16_state(), fix, {"native": False})]


def _probe_data(config) -> tuple[Any, str]:
    """The recipe's dataset description, or where its data is missing (the environment lines say so) the
    shape its source would have: the probe times the model, not the data."""
    from vitrain.config import ConfigError
    from vitrain.data import describe_source
    from vitrain.data.sources import nominal_source_info

    try:
        return describe_source(config.data), ""
    except ConfigError:
        return nominal_source_info(config.data), " (its data not found: the model timed at its shape)"


def check_auto_precision(context: Context) -> list[Check]:
    """What ``precision=auto`` (and ``precision_mode``/``performance.cpu_kernels`` auto) choose for the recipe's
    model on this CPU, by timing its step as a run does (cached; fused kernels not built yet are left out)."""
    from vitrain.config import precision_policy
    from vitrain.train.precision_choice import measure_precision

    if context.device == "cuda":
        return []
    config = context.config.model_copy(deep=True)
    config.train.device = "cpu"
    info, note = _probe_data(config)
    measured = measure_precision(config, info, detect_hardware("cpu"), may_build=False)
    if measured is None:
        picked = config.precision if config.precision != "auto" else "fp32"
        return [Check(SECTION, "precision=auto", "PASS", f"{picked} (nothing to choose: one candidate)")]
    policy = precision_policy(measured.precision, measured.mode, "cpu")
    data = {
        "precision": measured.precision,
        "mode": policy.mode,
        "weights": policy.weights,
        "cpu_kernels": measured.cpu_kernels,
        "model": config.model.name,
        **measured.record(),
    }
    return [Check(SECTION, "precision=auto", "PASS", f"{config.model.name}: {measured.describe()}{note}", data=data)]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


def _kernels_not_loaded(state: str, path, compiler: str | None, ninja: str | None, data: dict) -> Check:
    """The line for a cache :func:`load` would compile into or wait on (minutes): the doctor does not load."""
    if state == "locked" and build.lock_kind() == "advisory":
        fix = "wait for that build to end (torch releases its lock when the builder ends, even killed)"
        return Check(SECTION, "fused kernels", "WARN", f"locked: a process is building them now ({path})", fix, data)
    if state == "locked":
        fix = f"if no vitrain or ninja process is building them now, delete {path} (a killed build left it)"
        return Check(SECTION, "fused kernels", "WARN", f"locked: {path} exists, loading waits for it", fix, data)
    missing = [name for name, found in (("a C++ compiler", compiler), ("ninja", ninja)) if found is None]
    if missing:
        how = {
            "a C++ compiler": "a C++ compiler (apt-get install g++)",
            "ninja": f"ninja ({sys.executable} -m pip install ninja)",
        }
        fix = f"install {' and '.join(how[name] for name in missing)}; bf16 CPU runs need it"
        return Check(SECTION, "fused kernels", "WARN", f"cannot build: no {', no '.join(missing)}", fix, data)
    when = "not built yet" if state == "missing" else f"cached build at {path} is out of date"
    value = f"{when}; {compiler} found, the first bf16 CPU run builds and caches them"
    return Check(SECTION, "fused kernels", "PASS", value, data=data)


def check_kernels(context: Context) -> list[Check]:
    """Loads the extension only from a fresh cache: compiling takes minutes. Off where the config's
    ``performance.cpu_kernels`` is ``native``."""
    compiler, ninja = _compiler(), build.ninja_binary()
    state, path = build.cache_state()
    data = {"compiler": compiler, "ninja": ninja, "cache": state, "path": str(path) if path else None}
    data["loaded"] = False
    if context.config.performance.cpu_kernels == "native":
        return [Check(SECTION, "fused kernels", "PASS", "off (performance.cpu_kernels=native)", data=data)]
    if state != "fresh":
        return [_kernels_not_loaded(state, path, compiler, ninja, data)]
    module = build.load()
    data["loaded"] = module is not None
    if module is None:
        fix = "install a C++ compiler and ninja, or set performance.cpu_kernels=native to use PyTorch's ops"
        if build.ERROR_PATH_FAILURE in (build.failure() or ""):
            fix = "rebuild them with the compiler torch was built with (the reason names it), or set performance.cpu_kernels=native"
        return [Check(SECTION, "fused kernels", "WARN", f"load failed: {build.failure()}", fix, data)]
    amx = bool(module.amx_available()) and cpu_features.amx_allowed_by_environment()
    data["amx_tiles"] = amx
    value = f"built, cached in {path.parent}" + (", AMX tiles" if amx else "")
    return [Check(SECTION, "fused kernels", "PASS", value, data=data)]


def check_threads(context: Context) -> list[Check]:
    threads = torch.get_num_threads()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    setting = os.environ.get("OMP_NUM_THREADS")
    value = f"{threads} (OMP_NUM_THREADS={setting if setting is not None else 'unset'})"
    data = {"threads": threads, "usable_cores": usable, "omp_num_threads": setting}
    if threads == 1 and usable > 1:
        fix = f"unset OMP_NUM_THREADS or set it to the physical cores (up to {usable}); torchrun sets it to 1"
        return [Check(SECTION, "threads", "WARN", value, fix, data)]
    return [Check(SECTION, "threads", "PASS", value, data=data)]


CHECKS = [check_model, check_isa, check_matmul, check_bf16, check_auto_precision, check_kernels, check_threads]
