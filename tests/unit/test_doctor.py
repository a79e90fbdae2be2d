"""vitrain doctor: the report on this CPU, exit codes, the GPU section with a mocked torch.cuda,
thresholds of the environment checks, and the CLI's JSON file."""

from __future__ import annotations

import collections
import json
import sys
import types
from pathlib import Path

import pytest
import torch

import vitrain.doctor as doctor
from vitrain.cli import main
from vitrain.config import build_config
from vitrain.doctor import Check, Context, cpu, environment, format_report, gpu, run_doctor
from vitrain.recipes import get_recipe

GIB = 2**30
CHECK_FIELDS = {"section", "name", "status", "value", "fix", "data"}


def synthetic_config():
    return build_config(get_recipe("fmnist"), [], ["data.name=synthetic"])


@pytest.fixture(scope="module")
def cpu_report():
    return run_doctor(synthetic_config(), device="auto")


def test_report_on_this_cpu_has_sections_fields_and_sane_values(cpu_report):
    assert list(cpu_report.sections()) == ["CPU", "GPU", "Environment"]
    as_dict = json.loads(json.dumps(cpu_report.to_dict()))
    assert {"status", "exit_code", "counts", "checks"} <= as_dict.keys()
    assert all(set(check) == CHECK_FIELDS for check in as_dict["checks"])
    assert sum(as_dict["counts"].values()) == len(cpu_report.checks)
    assert cpu_report.find("CPU", "cores").data["usable"] >= 1
    assert cpu_report.find("CPU", "fp32 matmul").data["tflops"] > 0
    assert cpu_report.find("CPU", "precision=auto").data["precision"] in ("bf16", "fp32")
    assert cpu_report.find("CPU", "threads").data["threads"] == torch.get_num_threads()
    assert cpu_report.find("Environment", "data").status == "PASS"
    assert all(check.fix for check in cpu_report.checks if check.status != "PASS")
    assert cpu_report.exit_code == 0 and cpu_report.status in ("PASS", "WARN")


def test_table_groups_sections_and_aligns_columns(cpu_report):
    lines = format_report(cpu_report).splitlines()
    assert [line for line in lines if line and not line.startswith(" ")][:3] == ["CPU", "GPU", "Environment"]
    rows = [line for line in lines if line.startswith(("  PASS", "  WARN", "  FAIL"))]
    assert len(rows) == len(cpu_report.checks)
    value_columns = {line.index(check.value, 8) for line, check in zip(rows, cpu_report.checks, strict=True)}
    assert len(value_columns) == 1
    assert lines[-1].startswith(cpu_report.status)


def failing_check(context: Context) -> list[Check]:
    return [Check("CPU", "injected", "FAIL", "broken on purpose", "nothing to fix")]


def crashing_check(context: Context) -> list[Check]:
    raise RuntimeError("probe exploded")


def quick_checks():
    return [(section, check) for section, check in doctor.CHECKS if check is not cpu.check_matmul]


def test_a_failing_check_makes_exit_code_one():
    config = synthetic_config()
    assert run_doctor(config, device="cpu", checks=quick_checks()).exit_code == 0
    report = run_doctor(config, device="cpu", checks=[*quick_checks(), ("CPU", failing_check)])
    assert report.exit_code == 1 and report.find("CPU", "injected").status == "FAIL"


def test_a_crashing_check_becomes_a_fail_line():
    report = run_doctor(synthetic_config(), device="cpu", checks=[("GPU", crashing_check), *quick_checks()])
    line = report.find("GPU", "crashing_check")
    assert line.status == "FAIL" and "probe exploded" in line.value
    assert report.find("Environment", "disk") is not None  # the others still ran


def test_cli_writes_parseable_json_and_maps_failure_to_exit_one(tmp_path, monkeypatch, capsys):
    path = tmp_path / "doctor.json"
    argv = ["doctor", "--device", "cpu", "--set", "data.name=synthetic", "--out", str(tmp_path), "--json", str(path)]
    monkeypatch.setattr(doctor, "CHECKS", quick_checks())
    assert main(argv) == 0
    written = json.loads(path.read_text())
    assert written["exit_code"] == 0
    assert {check["section"] for check in written["checks"]} == {"CPU", "GPU", "Environment"}
    assert "Environment" in capsys.readouterr().out
    monkeypatch.setattr(doctor, "CHECKS", [*quick_checks(), ("CPU", failing_check)])
    assert main(argv) == 1
    assert json.loads(path.read_text())["status"] == "FAIL"


# --- GPU section, torch.cuda mocked ------------------------------------------------------------------

GPUS = [
    types.SimpleNamespace(
        name="NVIDIA H100 80GB HBM3", total_memory=80 * GIB, major=9, minor=0, multi_processor_count=132
    ),
    types.SimpleNamespace(
        name="NVIDIA H100 80GB HBM3", total_memory=80 * GIB, major=9, minor=0, multi_processor_count=132
    ),
    types.SimpleNamespace(name="Tesla Mystery", total_memory=16 * GIB, major=7, minor=5, multi_processor_count=40),
]


@pytest.fixture
def mocked_cuda(monkeypatch):
    probed = []

    def probe(index):
        probed.append(index)
        if GPUS[index].major < 8:
            return {"flash": "RuntimeError: No available kernel", "efficient": None, "cudnn": "x", "math": None}
        return {"flash": None, "efficient": None, "cudnn": None, "math": None}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(GPUS))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: GPUS[index])
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: 2 not in (a, b))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    monkeypatch.setattr(gpu, "probe_sdpa_backends", probe)
    return probed


def gpu_report(device="auto"):
    return run_doctor(synthetic_config(), device=device, checks=[("GPU", gpu.check_gpus)])


def test_gpu_section_with_mocked_cuda(mocked_cuda):
    report = gpu_report()
    assert report.find("GPU", "versions").value.endswith("cudnn 9.1.0, nccl 2.21.5")
    first = report.find("GPU", "gpu0")
    assert first.value == "NVIDIA H100 80GB HBM3, 80.0 GiB, compute capability 9.0"
    assert first.data["capability"] == [9, 0] and first.data["memory_bytes"] == 80 * GIB
    assert report.find("GPU", "gpu0 bf16").status == "PASS" and report.find("GPU", "gpu0 fp8").data["fp8"]
    peak = report.find("GPU", "gpu0 peak")
    assert (
        peak.status == "PASS"
        and peak.data["bf16_tflops"] == 989.4
        and peak.data["fp8_tflops"] == 1978.9
        and "H100 SXM" in peak.value
    )
    assert report.find("GPU", "gpu0 sdpa").data["backends"] == ["flash", "efficient", "cudnn", "math"]
    assert report.find("GPU", "gpu2 bf16").status == "WARN" and not report.find("GPU", "gpu2 fp8").data["fp8"]
    unknown = report.find("GPU", "gpu2 peak")
    assert unknown.status == "WARN" and "CUDA_PEAKS" in unknown.fix and unknown.data["bf16_tflops"] is None
    assert report.find("GPU", "gpu2 sdpa").data["backends"] == ["efficient", "math"]
    p2p = report.find("GPU", "p2p")
    assert p2p.status == "WARN" and "0->2" in p2p.value and "0->1" not in p2p.value
    assert mocked_cuda == [0, 2]  # one SDPA probe per distinct GPU model
    assert report.exit_code == 0
    assert "gpu2 peak" in format_report(report)


def test_a_broken_gpu_probe_is_a_line_not_a_crash(mocked_cuda, monkeypatch):
    def broken(index):
        if index == 1:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return GPUS[index]

    monkeypatch.setattr(torch.cuda, "get_device_properties", broken)
    monkeypatch.setattr(gpu, "probe_sdpa_backends", lambda index: dict.fromkeys(gpu.SDPA_BACKENDS, "no kernel"))
    report = gpu_report()
    assert report.find("GPU", "gpu1").status == "FAIL" and "launch failure" in report.find("GPU", "gpu1").value
    assert report.find("GPU", "gpu0 sdpa").status == "FAIL"  # no backend at all ran
    assert report.find("GPU", "gpu2") is not None


@pytest.mark.parametrize(("device", "status"), [("auto", "WARN"), ("cuda", "FAIL"), ("cpu", "PASS")])
def test_no_cuda_is_one_line_whose_status_follows_device(monkeypatch, device, status):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = gpu_report(device)
    assert [(check.name, check.status) for check in report.checks] == [("cuda", status)]
    assert report.exit_code == (1 if status == "FAIL" else 0)


# --- environment -------------------------------------------------------------------------------------

Usage = collections.namedtuple("Usage", "total used free")


@pytest.mark.parametrize(("free_gib", "status"), [(0.5, "FAIL"), (5, "WARN"), (100, "PASS")])
def test_disk_thresholds(monkeypatch, tmp_path, free_gib, status):
    monkeypatch.setattr(environment.shutil, "disk_usage", lambda path: Usage(200 * GIB, 0, int(free_gib * GIB)))
    (line,) = environment.check_disk(Context(synthetic_config(), out=tmp_path / "not" / "yet"))
    assert line.status == status and line.data["measured_at"] == str(tmp_path)


@pytest.mark.parametrize(
    ("out_dir", "root"),
    [("runs/{recipe}-{time}", "runs"), ("/data/exp-{time}", "/data"), ("out", "out"), ("{time}", ".")],
)
def test_runs_root_is_out_dir_before_its_placeholders(out_dir, root):
    assert str(environment.runs_root(out_dir)) == root


def test_small_shm_and_open_file_limit_warn_with_a_fix(monkeypatch):
    import resource

    monkeypatch.setattr(environment.shutil, "disk_usage", lambda path: Usage(64 * 2**20, 0, 64 * 2**20))
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, 4096))
    context = Context(synthetic_config())
    (shm,) = environment.check_shm(context)
    (files,) = environment.check_open_files(context)
    assert shm.status == "WARN" and "--shm-size" in shm.fix
    assert files.status == "WARN" and "ulimit -n 4096" in files.fix


def test_missing_fashion_mnist_fails_with_the_package_fix(tmp_path):
    config = build_config(get_recipe("fmnist"), [], [f"data.root={tmp_path}"])
    (line,) = environment.check_data(Context(config))
    assert line.status == "FAIL" and "dataset-fashion-mnist" in line.fix


def test_fashion_mnist_present_passes(tiny_fmnist):
    config = build_config(get_recipe("fmnist"), [], [f"data.root={tiny_fmnist}"])
    (line,) = environment.check_data(Context(config))
    assert line.status == "PASS" and line.data["root"] == str(tiny_fmnist)


def test_optional_packages_never_fail(monkeypatch):
    monkeypatch.setattr(environment, "_installed_version", lambda module, distribution: None)
    lines = environment.check_optional_packages(Context(synthetic_config()))
    assert {line.name for line in lines} == set(environment.OPTIONAL_PACKAGES)
    assert {line.status for line in lines} == {"PASS", "WARN"}  # WARN: vitrain uses it (timm, matplotlib)


def test_kernels_without_a_compiler_warn(monkeypatch):
    monkeypatch.setattr(cpu.build, "cache_state", lambda: ("missing", None))
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)
    (line,) = cpu.check_kernels(Context(synthetic_config()))
    assert line.status == "WARN" and "compiler" in line.value and line.fix


def test_kernels_without_ninja_name_the_pip_install_into_this_environment(monkeypatch):
    monkeypatch.setattr(cpu.build, "cache_state", lambda: ("missing", None))
    monkeypatch.setattr(cpu, "_compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(cpu.build, "ninja_binary", lambda: None)
    (line,) = cpu.check_kernels(Context(synthetic_config()))
    assert line.status == "WARN" and line.value == "cannot build: no ninja", line.value
    assert f"{sys.executable} -m pip install ninja" in line.fix and "compiler" not in line.fix, line.fix


def test_kernels_report_the_ninja_the_build_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu.build, "cache_state", lambda: ("missing", None))
    monkeypatch.setenv("PATH", str(tmp_path))  # no ninja on PATH: an environment that is not activated
    ninja = pytest.importorskip("ninja", reason="the ninja package (a dependency of vitrain) is not installed")
    (line,) = cpu.check_kernels(Context(synthetic_config()))
    assert line.data["ninja"] == str(Path(ninja.BIN_DIR) / "ninja"), line.data


@pytest.mark.parametrize("state", ["missing", "locked", "stale"])
def test_kernels_are_never_compiled_or_waited_for(monkeypatch, tmp_path, state):
    monkeypatch.setattr(cpu.build, "cache_state", lambda: (state, None if state == "missing" else tmp_path / "lock"))
    monkeypatch.setattr(cpu.build, "load", lambda: pytest.fail("the doctor must not build"))
    (line,) = cpu.check_kernels(Context(synthetic_config()))
    assert line.data["cache"] == state and not line.data["loaded"]
    assert (line.status == "WARN") == (state == "locked") or line.data["compiler"] is None


def test_kernels_are_off_where_the_config_says_native(monkeypatch):
    """The config's mode decides, not whatever a run of this process set before."""
    monkeypatch.setattr(cpu.build, "load", lambda: pytest.fail("the doctor must not load kernels that are off"))
    native = build_config(get_recipe("fmnist"), [], ["data.name=synthetic", "performance.cpu_kernels=native"])
    (line,) = cpu.check_kernels(Context(native))
    assert line.status == "PASS" and line.value.startswith("off") and not line.data["loaded"]
    monkeypatch.setattr(cpu.build, "cache_state", lambda: ("missing", None))
    (line,) = cpu.check_kernels(Context(synthetic_config()))  # auto, the recipe's
    assert not line.value.startswith("off"), line.value


def test_cache_state_reads_torch_cache(monkeypatch, tmp_path):
    folder = tmp_path / cpu.build.extension_name()
    folder.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpu.build.cache_state() == ("missing", None)
    library = folder / f"{cpu.build.extension_name()}.so"
    library.write_bytes(b"")
    (folder / "build.ninja").write_text(f"build module.o: compile {cpu.build.SOURCES[0]}\n")
    assert cpu.build.cache_state() == ("fresh", library)
    (folder / "build.ninja").write_text("build module.o: compile /elsewhere/module.cpp\n")
    assert cpu.build.cache_state()[0] == "stale"


def test_a_lock_file_locks_the_cache_only_as_torch_locks_it(monkeypatch, tmp_path):
    """torch 2.14's loader holds an OS lock on ``lock`` and leaves the file behind: locked only while a
    process holds it; with the older lock file (its existence is the lock) the file alone locks."""
    from filelock import FileLock

    folder = tmp_path / cpu.build.extension_name()
    folder.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    library, lock = folder / f"{cpu.build.extension_name()}.so", folder / "lock"
    library.write_bytes(b"")
    (folder / "build.ninja").write_text(f"build module.o: compile {cpu.build.SOURCES[0]}\n")
    lock.write_bytes(b"")  # left by a build that ended
    monkeypatch.setattr(cpu.build, "lock_kind", lambda: "advisory")
    assert cpu.build.cache_state() == ("fresh", library)
    with FileLock(lock):  # a build under way
        assert cpu.build.cache_state() == ("locked", lock)
        (line,) = cpu.check_kernels(Context(synthetic_config()))
        assert line.status == "WARN" and "building them now" in line.value and "wait" in line.fix
    assert cpu.build.cache_state() == ("fresh", library) and lock.exists()
    monkeypatch.setattr(cpu.build, "lock_kind", lambda: "file")
    assert cpu.build.cache_state() == ("locked", lock)
    (line,) = cpu.check_kernels(Context(synthetic_config()))
    assert line.status == "WARN" and f"delete {lock}" in line.fix


def test_kernels_that_die_on_their_own_errors_are_reported_with_the_compiler_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu.build, "cache_state", lambda: ("fresh", tmp_path / "k.so"))
    monkeypatch.setattr(cpu.build, "load", lambda: None)
    reason = "RuntimeError: the built kernels cannot raise an error: a process that made them raise one was killed"
    monkeypatch.setattr(cpu.build, "failure", lambda: reason)
    (line,) = cpu.check_kernels(Context(synthetic_config()))
    assert line.status == "WARN" and reason in line.value and "compiler torch was built with" in line.fix
