"""GPU checks: library versions, and per GPU its memory, compute capability, bf16/fp8, the datasheet
peak MFU uses, the SDPA backends that run at a ViT-B shape, and peer access between GPU pairs.

Each probe is guarded: one that raises becomes a FAIL or WARN line naming the error, never a crash.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable

import torch

from vitrain.config.resolve import FP8_CAPABILITY
from vitrain.doctor.report import Check, Context, Status
from vitrain.metrics.peak import cuda_peak, find_gpu_peaks

SECTION = "GPU"
SDPA_SHAPE = (8, 12, 197, 64)
"""ViT-B/16 at 224 px: batch 8, 12 heads, 196 patches + the class token, head dimension 64."""
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _guarded(name: str, probe: Callable[[], list[Check]], status: Status = "FAIL") -> list[Check]:
    try:
        return probe()
    except Exception as error:  # noqa: BLE001 - a broken probe is a report line, not a crash
        fix = "this probe raised; the error names the cause (driver, CUDA build of torch, device state)"
        return [Check(SECTION, name, status, f"probe failed: {_first_line(error)}", fix, {"error": str(error)})]


def _no_cuda(device: str) -> Check:
    data = {"cuda_available": False, "torch_cuda": torch.version.cuda}
    if device == "cpu":
        return Check(SECTION, "cuda", "PASS", "not checked (--device cpu)", data=data)
    why = "no CUDA device" + ("" if torch.version.cuda else " (this torch is a CPU-only build)")
    fix = "install a CUDA build of torch and an NVIDIA driver (nvidia-smi must list the GPU)"
    if device == "cuda":
        return Check(SECTION, "cuda", "FAIL", why, fix, data)
    return Check(SECTION, "cuda", "WARN", why + "; runs use the CPU", fix, data)


def _cudnn_version() -> str | None:
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None:
        return None
    # cuDNN 9 encodes major*10000 + minor*100 + patch, cuDNN 8 major*1000 + minor*100 + patch
    major, rest = divmod(version, 10000) if version >= 90000 else divmod(version, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _nccl_version() -> str | None:
    version = torch.cuda.nccl.version()
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    major, rest = divmod(int(version), 1000)  # older torch: major*1000 + minor*100 + patch
    return f"{major}.{rest // 100}.{rest % 100}"


def _versions() -> list[Check]:
    found: dict[str, str | None] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    errors = {}
    for key, read in (("cudnn", _cudnn_version), ("nccl", _nccl_version)):
        try:
            found[key] = read()
        except Exception as error:  # noqa: BLE001
            found[key], errors[key] = None, _first_line(error)
    value = ", ".join(f"{key} {found[key] or 'missing'}" for key in ("torch", "cuda", "cudnn", "nccl"))
    missing = [key for key in ("cudnn", "nccl") if found[key] is None]
    if not missing:
        return [Check(SECTION, "versions", "PASS", value, data=found)]
    fix = f"{' and '.join(missing)} not found ({'; '.join(errors.values()) or 'not in this build'}): install torch's CUDA wheel, which bundles both"
    return [Check(SECTION, "versions", "WARN", value, fix, {**found, "errors": errors})]


def _device_line(index: int, properties) -> Check:
    memory_gib = properties.total_memory / 2**30
    capability = (properties.major, properties.minor)
    value = f"{properties.name}, {memory_gib:.1f} GiB, compute capability {capability[0]}.{capability[1]}"
    data = {
        "index": index,
        "name": properties.name,
        "memory_bytes": int(properties.total_memory),
        "capability": list(capability),
        "multiprocessors": getattr(properties, "multi_processor_count", None),
    }
    return Check(SECTION, f"gpu{index}", "PASS", value, data=data)


def _precision_lines(index: int, capability: tuple[int, int]) -> list[Check]:
    bf16 = capability >= (8, 0)
    if bf16:
        bf16_line = Check(SECTION, f"gpu{index} bf16", "PASS", "yes: precision=auto picks bf16", data={"bf16": True})
    else:
        fix = "precision=auto picks fp32 here; precision=fp16 (with loss scaling) is the fast option on this GPU"
        bf16_line = Check(SECTION, f"gpu{index} bf16", "WARN", "no (compute capability < 8.0)", fix, {"bf16": False})
    fp8 = capability >= FP8_CAPABILITY
    fp8_value = "yes (compute capability >= 8.9): precision=fp8 runs" if fp8 else "no (needs compute capability 8.9+)"
    return [bf16_line, Check(SECTION, f"gpu{index} fp8", "PASS", fp8_value, data={"fp8": fp8})]


def _peak_line(index: int, name: str) -> Check:
    peaks = {precision: cuda_peak(name, precision) for precision in ("bf16", "fp8", "fp32")}
    data = {f"{precision}_tflops": peak.tflops for precision, peak in peaks.items()}
    entry = find_gpu_peaks(name)
    if entry is None:
        fix = (
            "add a GpuPeaks(pattern, label, {fp32, tf32, bf16, fp16, fp8 dense TFLOP/s}, datasheet) entry to "
            "CUDA_PEAKS in src/vitrain/metrics/peak.py; until then bench and training report no MFU"
        )
        return Check(SECTION, f"gpu{index} peak", "WARN", f"{name!r} is not in the peak table", fix, data)
    figures = ", ".join(
        f"{precision} {peak.tflops:g}" if peak.tflops else f"{precision} none" for precision, peak in peaks.items()
    )
    data.update(label=entry.label, source=entry.source)
    return Check(SECTION, f"gpu{index} peak", "PASS", f"{figures} TFLOP/s dense ({entry.label} datasheet)", data=data)


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    members = {
        "flash": "FLASH_ATTENTION",
        "efficient": "EFFICIENT_ATTENTION",
        "cudnn": "CUDNN_ATTENTION",
        "math": "MATH",
    }
    return getattr(SDPBackend, members[name])


def _run_sdpa(index: int, backend: str) -> None:
    from torch.nn.attention import sdpa_kernel

    device = torch.device("cuda", index)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(SDPA_SHAPE, device=device, dtype=torch.bfloat16, generator=generator).requires_grad_()
        for _ in range(3)
    )
    with sdpa_kernel(_sdpa_backend(backend)):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        out.float().sum().backward()
    torch.cuda.synchronize(device)
    if not all(torch.isfinite(tensor.grad).all() for tensor in (q, k, v)):
        raise RuntimeError("non-finite gradients")


def probe_sdpa_backends(index: int) -> dict[str, str | None]:
    """Backend -> None when forward+backward ran at :data:`SDPA_SHAPE` in bf16 on GPU ``index``,
    else the reason it did not (torch's warnings say why a backend refused)."""
    results: dict[str, str | None] = {}
    for backend in SDPA_BACKENDS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                _run_sdpa(index, backend)
                results[backend] = None
            except Exception as error:  # noqa: BLE001 - a backend that cannot run is the finding
                reasons = [str(warning.message).strip().splitlines()[0] for warning in caught]
                results[backend] = "; ".join([*reasons, _first_line(error)])
    return results


def _sdpa_line(index: int, results: dict[str, str | None]) -> Check:
    running = [backend for backend, reason in results.items() if reason is None]
    failing = {backend: reason for backend, reason in results.items() if reason is not None}
    data = {"backends": running, "errors": failing}
    value = f"{', '.join(running) or 'none'} run" + (f"; not {', '.join(failing)}" if failing else "")
    if any(backend in running for backend in ("flash", "efficient", "cudnn")):
        return Check(SECTION, f"gpu{index} sdpa", "PASS", value, data=data)
    reasons = "; ".join(f"{backend}: {reason}" for backend, reason in failing.items())
    if running:  # math alone: attention runs, slowly and materializing the full score matrix
        return Check(SECTION, f"gpu{index} sdpa", "WARN", value, f"no fused attention backend ran ({reasons})", data)
    return Check(SECTION, f"gpu{index} sdpa", "FAIL", value, f"no attention backend ran ({reasons})", data)


def _gpu_lines(index: int, probed: dict[tuple, dict[str, str | None]]) -> list[Check]:
    properties = torch.cuda.get_device_properties(index)
    capability = (properties.major, properties.minor)
    checks = [_device_line(index, properties), *_precision_lines(index, capability)]
    checks += _guarded(f"gpu{index} peak", lambda: [_peak_line(index, properties.name)], "WARN")
    key = (properties.name, capability)  # identical GPUs run the same kernels: probe one of each
    if key not in probed:
        probed[key] = probe_sdpa_backends(index)
    checks.append(_sdpa_line(index, probed[key]))
    return checks


def _peer_lines(count: int) -> list[Check]:
    pairs = list(itertools.permutations(range(count), 2))
    missing = [f"{a}->{b}" for a, b in pairs if not torch.cuda.can_device_access_peer(a, b)]
    data = {"pairs": len(pairs), "without_peer_access": missing}
    if not missing:
        return [Check(SECTION, "p2p", "PASS", f"all {len(pairs)} GPU pairs reach each other directly", data=data)]
    fix = (
        "NCCL goes through host memory between these GPUs (slower all-reduce); check `nvidia-smi topo -m`, "
        "the IOMMU/ACS settings, or the container's GPU isolation"
    )
    return [Check(SECTION, "p2p", "WARN", f"no peer access for {', '.join(missing)}", fix, data)]


def check_gpus(context: Context) -> list[Check]:
    if context.device == "cpu":
        return [_no_cuda("cpu")]
    if not torch.cuda.is_available():
        return [_no_cuda(context.device)]
    checks = _guarded("versions", _versions, "WARN")
    count = torch.cuda.device_count()
    probed: dict[tuple, dict[str, str | None]] = {}
    for index in range(count):
        checks += _guarded(f"gpu{index}", lambda index=index: _gpu_lines(index, probed))
    if count > 1:
        checks += _guarded("p2p", lambda: _peer_lines(count), "WARN")
    return checks


CHECKS = [check_gpus]
__all__ = ["CHECKS", "SDPA_BACKENDS", "SDPA_SHAPE", "check_gpus", "probe_sdpa_backends"]
