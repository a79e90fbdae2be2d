"""The precision, kernel, auto-choice and O2/FSDP tests once more at each lower CPU level, each in a subprocess
that sees this CPU as a machine of that level sees itself:

- ``avx2``: oneDNN limited to AVX2 (no bf16 inner product, bf16 emulated), ATen's and vitrain's kernels built for
  AVX2, vitrain's AMX tiles forbidden (an AVX2-only EPYC);
- ``avx512-no-bf16``: oneDNN limited to AVX512_CORE (bf16 emulated although PyTorch says it is supported), ATen
  at AVX512, no AMX tiles (the common cloud Xeon: Skylake, Cascade Lake, Ice Lake).

Every machine that runs the suite thus also checks the fallbacks and the measured choices of the levels below
its own; a level above the CPU's own cannot be emulated and is skipped, saying so."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

LEVELS = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "VITRAIN_AMX": "off"},
    "avx512-no-bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512", "VITRAIN_AMX": "off"},
}
CAPABILITY = {"avx2": "AVX2", "avx512-no-bf16": "AVX512"}
"""What ``torch.backends.cpu.get_cpu_capability()`` says at each level."""
NEEDS_FLAG = {"avx2": "avx2", "avx512-no-bf16": "avx512f"}
"""The CPU flag a level needs: the switches lower what the libraries use, they cannot raise it."""
LEVEL_SWITCH = "VITRAIN_TEST_CPU_LEVEL"
EMULATED_TESTS = [
    "tests/unit/test_cpu_levels.py::test_the_emulated_level_is_what_the_libraries_and_vitrain_see",
    "tests/unit/test_cpu_levels.py::test_auto_measures_fp32_faster_where_bf16_is_emulated",
    "tests/unit/test_kernels.py",
    "tests/unit/test_reference_weights.py",
    "tests/unit/test_precision_choice.py",
]
"""Run at every level: what the level changes (the kernels' vector code, the trained weights' digests, the
measured choices, what the doctor says)."""
EMULATED_TRAINING_TESTS = [
    "tests/unit/test_training.py::test_resume_after_epoch_is_bitwise_identical",
    "tests/unit/test_training.py::test_mixed_precision_steps_are_finite_and_keep_fp32_master_weights",
    "tests/unit/test_training.py::test_o2_step_updates_fp32_master_and_rounds_it_into_the_compute_copy",
    "tests/unit/test_training.py::test_flat_o2_buffers_step_bitwise_as_the_per_tensor_copies",
    "tests/unit/test_activation_checkpoint.py",
    "tests/unit/test_bench.py::test_ladder_is_cumulative_keeps_the_faster_attention_and_reports_relative_throughput",
    "tests/dist/test_sharded.py::test_fsdp_o2_computes_in_low_precision_and_keeps_fp32_master_weights[bf16-0.02]",
]
"""Run at the AVX-512-without-bf16 level only: training with emulated bf16 (O2 and its flat buffers, resume,
checkpointing, the ladder, FSDP's O2), whose code paths are the same at the AVX2 level, where the reference weights still
check the numbers."""
LEVEL_INDEPENDENT = "not (ninja or install_of_torch or error_of_the_kernels)"
"""The kernels' build-mechanics tests, which no CPU level changes (they run natively)."""
TIMEOUT_S = 1800
ROOT = Path(__file__).resolve().parents[2]


def _level() -> str | None:
    """The level this process emulates (set by :func:`test_the_suite_passes_at_each_lower_cpu_level`)."""
    return os.environ.get(LEVEL_SWITCH)


@pytest.mark.parametrize("level", list(LEVELS))
def test_the_suite_passes_at_each_lower_cpu_level(level, tmp_path):
    from vitrain import cpu_features

    if _level() is not None:
        pytest.skip("this is an emulated run itself")
    flags = cpu_features.cpu_flags()
    if flags is None or NEEDS_FLAG[level] not in flags:
        pytest.skip(f"this CPU has no {NEEDS_FLAG[level]}: the {level} level cannot be emulated on it")
    if _own_level(flags) == level:
        pytest.skip(f"this CPU is itself at the {level} level: the suite ran these tests at it already")
    environment = {**os.environ, **LEVELS[level], LEVEL_SWITCH: level, "VITRAIN_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-k", LEVEL_INDEPENDENT]
        + EMULATED_TESTS
        + (EMULATED_TRAINING_TESTS if level == "avx512-no-bf16" else []),
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"the suite at the {level} level: {summary}\n{result.stdout[-8000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed[1]) >= 40, summary  # the tests ran there, they were not all skipped


def _own_level(flags: set[str]) -> str | None:
    """The level of :data:`LEVELS` this CPU is at without any switch (None: above them all)."""
    if "avx512f" not in flags:
        return "avx2"
    return None if flags & {"avx512_bf16", "amx_bf16"} else "avx512-no-bf16"


def _emulated_level() -> str:
    level = _level()
    if level is None:
        pytest.skip(
            "runs inside the emulated subprocesses only (test_the_suite_passes_at_each_lower_cpu_level): "
            "this process sees the CPU as it is"
        )
    return level


def test_the_emulated_level_is_what_the_libraries_and_vitrain_see():
    """Inside an emulated run: no native bf16 (whatever PyTorch's flag says), no AMX tiles, the level's ISA; the
    doctor says bf16 is emulated."""
    import torch

    from vitrain import cpu_features, kernels
    from vitrain.doctor import cpu, run_doctor

    level = _emulated_level()
    assert torch.backends.cpu.get_cpu_capability() == CAPABILITY[level]
    assert not cpu_features.cpu_bf16_native() and not cpu_features.amx_allowed()
    if level == "avx2":
        assert not cpu_features.onednn_bf16_linear()
    if kernels.load() is not None:
        assert not kernels.paths().amx_tiles
    line = run_doctor(device="cpu", checks=[(cpu.SECTION, cpu.check_bf16)]).find("CPU", "bf16")
    assert line.status == "WARN" and line.value.startswith("emulated") and line.data["native"] is False


@pytest.mark.parametrize("model", ["default", "vit_ti4_32px"])
def test_auto_measures_fp32_faster_where_bf16_is_emulated(model):
    """What ``precision=auto`` picks at each emulated level, by measurement. For the default recipe's model
    (through the doctor's line, which e6d2653's code answered from PyTorch's bf16 flag: bf16 O2 at the AVX-512
    level) fp32 at both levels: emulated bf16 measured 19x slower at the AVX2 level and 1.19x at the AVX-512
    level on the AVX512-BF16 EPYC (2.5x on an Ice Lake Xeon). ViT-Ti/4 at 32 px, measured at the AVX-512 level
    only (at the AVX2 level it is 18x slower, as the default model is): bf16 came within 1.14x of fp32 on the
    EPYC, too close to assert on every CPU model, so the choice is checked to be the fastest it timed."""
    from tests.conftest import make_config
    from vitrain.data import describe_source
    from vitrain.doctor import cpu, run_doctor
    from vitrain.hardware import detect_hardware
    from vitrain.train.precision_choice import measure_precision

    level = _emulated_level()
    if model == "default":
        line = run_doctor(device="cpu", checks=[(cpu.SECTION, cpu.check_auto_precision)]).find("CPU", "precision=auto")
        assert line.status == "PASS" and line.data["precision"] == "fp32", line.value
        assert set(line.data["img_s"]) >= {"fp32", "bf16 autocast", "bf16 o2"}
        return
    if level == "avx2":  # the default model's case above already answers fp32 there, by 19x
        pytest.skip(
            "at the AVX2 level emulated bf16 is an order of magnitude slower for every model: "
            "the close case, ViT-Ti/4, is measured at the AVX-512-without-bf16 level"
        )
    config = make_config(*VIT_TI4_32PX, "precision=auto", "precision_mode=auto")
    measured = measure_precision(config, describe_source(config.data), detect_hardware("cpu"))
    assert {"fp32", "bf16 autocast", "bf16 o2"} <= set(measured.img_s), measured.describe()
    assert measured.chosen == max(measured.img_s, key=measured.img_s.get), measured.describe()


VIT_TI4_32PX = [
    "model.name=vit_tiny_patch16",
    "model.patch_size=4",
    "model.attn_impl=matmul",
    "data.name=synthetic",
    "data.image_size=32",
    "data.synthetic_num_train=1024",
    "train.batch_size=128",
]
"""ViT-Ti/4 at 32 px, batch 128: the small ViT of the CPU benchmarks (docs/benchmarks.md)."""
