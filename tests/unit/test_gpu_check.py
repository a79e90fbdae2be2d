"""``make gpu-check`` (experiments/gpu_check.py): the dry run on the CPU at toy sizes runs every stage end to
end (doctor, the gpu tests, the benchmark set, the ladder) and writes its record; the GPU tests are
collected and skip here with their reason; a run past its deadline reports what it did not run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "gpu_check.py"
STAGES = [
    "doctor",
    "pytest-gpu",
    "bench-vit_b16",
    "bench-vit_s16",
    "bench-volo_d1",
    "bench-resnet50_cl",
    "ladder-vit_b16",
]
SPEED = ["speed-bf16", "speed-fp8-b2x", "volo-fp8"]
"""The dry run's rows of the speed sweep: one of each kind."""


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _stage_rows(summary: str) -> dict[str, str]:
    rows = {}
    for line in summary.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0] in STAGES:
            rows[cells[0]] = cells[1]
    return rows


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(),
    )
    return out, result


def test_the_dry_run_passes_every_stage_and_writes_the_record(dry_run):
    out, result = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert _stage_rows((out / "summary.md").read_text()) == dict.fromkeys(STAGES, "pass")
    doctor = json.loads((out / "doctor.json").read_text())
    assert doctor["exit_code"] == 0 and doctor["checks"]
    for name in ("vit_b16", "vit_s16", "volo_d1", "resnet50_cl"):
        bench = json.loads((out / f"bench-{name}.json").read_text())
        assert bench["device"] == "cpu" and bench["img_s_median"] > 0
        assert bench["timm"]["img_s_median"] > 0  # --compare-timm measured both
    assert json.loads((out / "bench-resnet50_cl.json").read_text())["model"] == "resnet50"
    ladder = json.loads((out / "ladder-vit_b16.json").read_text())
    assert [row["rung"] for row in ladder["rungs"]][0] == "fp32 baseline"
    assert len(ladder["rungs"]) + len(ladder["skipped"]) == 7
    summary = (out / "summary.md").read_text()
    assert "| vit_base_patch16 (vit_b16) | 2 |" in summary
    for name in ("vit_b16", "resnet50_cl"):  # every bench profiled its step, ours and timm's
        bench = json.loads((out / f"bench-{name}.json").read_text())
        assert bench["step_breakdown"]["profiled_steps"] == bench["timm"]["step_breakdown"]["profiled_steps"] == 1
        assert f"| bench-{name} vitrain | " in summary and f"| bench-{name} timm | " in summary
    assert (
        json.loads((out / "bench-resnet50_cl.json").read_text())["step_breakdown"]["categories_ms"]["convolution"] > 0
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip reasons of a machine without CUDA")
def test_the_gpu_tests_are_collected_and_skip_with_their_reason(dry_run):
    out, _ = dry_run
    suite = ElementTree.parse(out / "pytest-gpu.xml").getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) >= 20
    reasons = {case.find("skipped").get("message") for case in cases}
    assert all("CUDA" in reason for reason in reasons), reasons


def test_a_run_past_its_deadline_says_what_it_did_not_run(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(tmp_path), "--deadline-s", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert result.returncode == 1
    assert _stage_rows((tmp_path / "summary.md").read_text()) == dict.fromkeys(STAGES, "not run (deadline)")


def test_the_speed_sweep_dry_run_compares_bf16_with_fp8_and_profiles_each_row(tmp_path):
    """``--speed``: bf16 O2 and FP8 rows compiled, the first against timm compiled and eager, each profiled,
    then JPEG decode."""
    pytest.importorskip("torchao", reason="the sweep's FP8 rows need torchao (the dev extra installs it)")
    env = {**_env(), "VITRAIN_CACHE_DIR": str(tmp_path / "cache")}  # the probe of the auto rows measures afresh
    out = tmp_path / "speed"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--speed", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {name: json.loads((out / f"{name}.json").read_text()) for name in SPEED}
    assert rows["volo-fp8"]["model"] == "volo_d1" and rows["speed-fp8-b2x"]["batch"] == 4
    assert all(row["compile"] and row["precision_mode"] == "o2" for row in rows.values())
    precisions = {name: (row["precision"], row["fp8_scaling"]) for name, row in rows.items()}
    assert precisions["speed-bf16"] == ("bf16", None) and precisions["speed-fp8-b2x"] == ("fp8", "tensorwise")
    assert "mfu_bf16_equivalent" in rows["volo-fp8"] and "mfu_bf16_equivalent" not in rows["speed-bf16"]
    assert rows["speed-bf16"]["attn_impl"] in ("sdpa", "matmul")  # the probe's CPU candidates
    first = rows["speed-bf16"]
    assert (first["timm"]["compile"], first["timm_eager"]["compile"]) == (True, False)
    assert "timm" not in rows["speed-fp8-b2x"]
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# GPU speed sweep") and "| speed-fp8-b2x | vit_base_patch16 | 4 | fp8 o2 |" in summary
    assert f"| {first['ours_over_timm']:.3f} | {first['ours_over_timm_eager']:.3f} |" in summary
    breakdown = summary.split("## Where the step goes")[1]
    assert "| speed-bf16 timm eager | " in breakdown and "| volo-fp8 vitrain | " in breakdown
    assert first["step_breakdown"]["categories_ms"]["matmul"] > 0
    assert "### speed-bf16 vitrain" in summary and "### speed-bf16 timm" in summary  # the top kernels
    decode = json.loads((out / "decode.json").read_text())
    assert [row["name"] for row in decode["rows"]][:2] == ["pillow, 1 process", "torchvision decode_jpeg cpu"]
    assert all(row["img_s"] > 0 for row in decode["rows"][:2]) and "## JPEG decode on the device" in summary
