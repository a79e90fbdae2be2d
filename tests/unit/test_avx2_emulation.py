"""The precision, kernel and O2/FSDP tests once more, in a subprocess that sees this CPU as an AVX2-only
machine sees itself: oneDNN limited to AVX2 (no native bf16, no bf16 inner product), ATen's and
vitrain's kernels built for AVX2, and vitrain's AMX tiles forbidden. Every machine that runs the suite
thus also checks the fallbacks of a CPU without native bf16, whichever kind of CPU it is."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

AVX2_ENVIRONMENT = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "VITRAIN_AMX": "off"}
EMULATED_TESTS = [
    "tests/unit/test_avx2_emulation.py::test_the_emulated_cpu_has_no_native_bf16_and_no_amx_tiles",
    "tests/unit/test_kernels.py",
    "tests/unit/test_training.py",
    "tests/unit/test_activation_checkpoint.py",
    "tests/unit/test_reference_weights.py",
    "tests/unit/test_bench.py::test_ladder_is_cumulative_keeps_the_faster_attention_and_reports_relative_throughput",
    "tests/dist/test_sharded.py::test_fsdp_o2_computes_in_bf16_and_keeps_fp32_master_weights",
]
TIMEOUT_S = 1800
ROOT = Path(__file__).resolve().parents[2]


def _emulated() -> bool:
    return all(os.environ.get(key) == value for key, value in AVX2_ENVIRONMENT.items())


def test_precision_and_kernel_tests_pass_on_an_emulated_avx2_cpu():
    if _emulated():
        pytest.skip("this is the emulated run itself")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *EMULATED_TESTS],
        cwd=ROOT,
        env={**os.environ, **AVX2_ENVIRONMENT},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"the suite on an emulated AVX2 CPU: {summary}\n{result.stdout[-8000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed[1]) >= 40, summary  # the tests ran there, they were not all skipped


def test_the_emulated_cpu_has_no_native_bf16_and_no_amx_tiles():
    """Inside the emulated run: what the libraries and vitrain see is an AVX2-only CPU."""
    if not _emulated():
        pytest.skip("runs inside the emulated AVX2 subprocess only (test_precision_and_kernel_tests_pass_...)")
    import torch

    from vitrain import cpu_features, kernels
    from vitrain.config import Config, DatasetInfo, Hardware, resolve

    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert not cpu_features.cpu_bf16_native() and not cpu_features.onednn_bf16_linear()
    assert not cpu_features.amx_allowed()
    if kernels.load() is not None:
        assert kernels.paths() == kernels.Paths(bias_in_product=False, amx_tiles=False)
    info = DatasetInfo(num_train=60000, num_eval=10000, num_classes=10, channels=1, mean=(0.5,), std=(0.5,))
    assert resolve(Config(), info, Hardware.detect("cpu")).precision.dtype == "fp32"  # auto: bf16 is not native
