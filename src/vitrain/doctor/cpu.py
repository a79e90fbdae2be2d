"""CPU checks: model, cores, vector ISA, measured matmul peaks, bf16, what ``precision=auto`` picks,
the fused CPU kernels and the thread count."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path

import torch

from vitrain import cpu_features
from vitrain.doctor.report import Check, Context
from vitrain.kernels import build
from vitrain.metrics.peak import measure_cpu_peak

SECTION = "CPU"
PROBE_SIZE, PROBE_SECONDS, PROBE_TRIALS = 2048, 0.3, 3
"""A short matmul probe: about 0.3 s per dtype after one warm-up product."""

# /proc/cpuinfo flag -> the name the report prints, in order of capability
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX512", "avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"}


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (Linux), empty elsewhere."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def check_model(context: Context) -> list[Check]:
    name = _cpuinfo().get("model name") or platform.processor() or platform.machine()
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
    flags = set(_cpuinfo().get("flags", "").split())
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
    from vitrain.config.resolve import Hardware, auto_precision, precision_policy

    native = cpu_features.cpu_bf16_native()
    checks = [
        Check(SECTION, "bf16", "PASS", "native (oneDNN: AVX512-BF16 or AMX)", data={"native": True})
        if native
        else Check(
            SECTION,
            "bf16",
            "WARN",
            "emulated: bf16 runs converted in software, many times slower than fp32",
            "train in fp32 on this CPU (precision=auto does), or use a CPU with AVX512-BF16/AMX",
            {"native": False},
        )
    ]
    picked = auto_precision(Hardware.detect("cpu"))
    mode = context.config.precision_mode if picked != "fp32" else "autocast"
    policy = precision_policy(picked, mode, "cpu")
    value = f"{picked}" + (f" ({policy.mode}, weights {policy.weights})" if picked != "fp32" else "")
    data = {"precision": picked, "mode": policy.mode, "weights": policy.weights}
    checks.append(Check(SECTION, "precision=auto", "PASS", value, data=data))
    return checks


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
    """Loads the extension only from a fresh cache: compiling takes minutes."""
    compiler, ninja = _compiler(), build.ninja_binary()
    state, path = build.cache_state()
    data = {"compiler": compiler, "ninja": ninja, "cache": state, "path": str(path) if path else None}
    data["loaded"] = False
    if build.current_mode() == "native":
        return [Check(SECTION, "fused kernels", "PASS", "off (train.cpu_kernels=native)", data=data)]
    if state != "fresh":
        return [_kernels_not_loaded(state, path, compiler, ninja, data)]
    module = build.load()
    data["loaded"] = module is not None
    if module is None:
        fix = "install a C++ compiler and ninja, or set train.cpu_kernels=native to use PyTorch's ops"
        if build.ERROR_PATH_FAILURE in (build.failure() or ""):
            fix = "rebuild them with the compiler torch was built with (the reason names it), or set train.cpu_kernels=native"
        return [Check(SECTION, "fused kernels", "WARN", f"load failed: {build.failure()}", fix, data)]
    amx = bool(module.amx_available()) and cpu_features.amx_allowed()
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


CHECKS = [check_model, check_isa, check_matmul, check_bf16, check_kernels, check_threads]
