"""`vitrain bench`: records, FLOPs and MFU arithmetic, peak FLOPs, the timm reference, bad input.

Nothing here asserts a speed: timings only have to be positive and consistent with each other.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from vitrain.bench import (
    BenchSettings,
    bench_overrides,
    measure_training_step,
    time_training_steps,
    timm_reference,
    window_ms,
)
from vitrain.cli import main
from vitrain.config import Config, ConfigError, build_config
from vitrain.metrics.peak import CUDA_PEAKS, cuda_peak, measure_cpu_peak
from vitrain.models import build_model
from vitrain.models.flops import model_flops
from vitrain.recipes import get_recipe
from vitrain.train import make_plan

RECORD_FIELDS = {
    "model", "image_size", "batch", "precision", "precision_mode", "compile", "device", "device_name", "threads",
    "img_s_median", "img_s_min", "img_s_max", "step_ms_median", "flops_per_image_fwd", "train_flops_per_step",
    "achieved_tflops", "peak_tflops", "peak_source", "mfu", "peak_memory_bytes", "torch", "git_revision",
    "warmup_s", "compile_s", "host_allocator",
}  # fmt: skip
TINY = ["--image-size", "14", "--batch", "4", "--precision", "fp32", "--steps", "2", "--repeats", "2", "--warmup", "1"]


def _plan(model: str, image_size: int, batch: int, *overrides: str, recipe: str | None = None, **settings):
    bench = BenchSettings(**{"steps": 1, "warmup": 1, "repeats": 1, **settings})
    base = get_recipe(recipe) if recipe else Config()
    flags = bench_overrides(model, image_size, batch, "fp32", None, bench)
    return make_plan(build_config(base, [], flags + list(overrides))), bench


def _check_record(record: dict, batch: int) -> None:
    assert not RECORD_FIELDS - record.keys()
    assert 0 < record["img_s_min"] <= record["img_s_median"] <= record["img_s_max"]
    assert record["step_ms_median"] > 0
    assert record["train_flops_per_step"] == 3 * record["flops_per_image_fwd"] * batch
    expected_tflops = record["train_flops_per_step"] / batch * record["img_s_median"] / 1e12
    assert record["achieved_tflops"] == pytest.approx(expected_tflops)
    assert record["mfu"] == pytest.approx(record["achieved_tflops"] / record["peak_tflops"])
    if record["peak_memory_bytes"] is None:
        assert record["peak_memory_reason"]
    else:
        assert record["peak_memory_bytes"] > 0


def test_bench_writes_a_json_record_with_flops_mfu_and_memory(tmp_path, capsys):
    path = tmp_path / "out" / "bench.json"
    argv = ["bench", "--model", "vit_tiny6_patch7", "--set", "model.head=gap", *TINY, "--json", str(path)]
    assert main(argv) == 0
    record = json.loads(path.read_text())
    _check_record(record, batch=4)
    assert (record["model"], record["image_size"], record["batch"]) == ("vit_tiny6_patch7", 14, 4)
    assert (record["precision"], record["precision_mode"], record["compile"], record["device"]) == (
        "fp32", "autocast", False, "cpu"
    )  # fmt: skip
    gap = build_model("vit_tiny6_patch7", device="meta", img_size=14, head="gap", num_classes=10)
    cls = build_model("vit_tiny6_patch7", device="meta", img_size=14, head="cls", num_classes=10)
    assert record["flops_per_image_fwd"] == model_flops(gap, 14) != model_flops(cls, 14)  # --set reached the model
    assert record["peak_source"].startswith("measured: the CPU's best matmul probe")  # of fp32 and bf16, whichever runs
    assert 0 < record["mfu"] < 1
    assert record["threads"] == torch.get_num_threads() and record["torch"] == torch.__version__
    assert record["compile_s"] is None and record["final_loss"] > 0
    printed = capsys.readouterr().out
    assert "img/s median" in printed and "vit_tiny6_patch7" in printed and "MFU" in printed


def test_compare_timm_times_both_with_the_same_harness(tmp_path, capsys):
    pytest.importorskip("timm")
    path = tmp_path / "bench.json"
    argv = ["bench", "--model", "vit_tiny_patch16", "--image-size", "32", "--batch", "2", "--precision", "fp32"]
    argv += ["--steps", "1", "--repeats", "2", "--warmup", "1", "--compare-timm", "--json", str(path)]
    assert main(argv) == 0
    result = json.loads(path.read_text())
    ours, theirs = result, result["timm"]
    _check_record(ours, batch=2)
    _check_record(theirs, batch=2)
    assert (ours["implementation"], theirs["implementation"]) == ("vitrain", "timm")
    assert theirs["model"] == theirs["timm_reference"] == "vit_tiny_patch16_224"
    assert theirs["num_params"] == ours["num_params"]  # the same architecture
    assert theirs["flops_per_image_fwd"] == ours["flops_per_image_fwd"]
    assert result["ours_over_timm"] == pytest.approx(ours["img_s_median"] / theirs["img_s_median"])
    printed = capsys.readouterr().out
    assert "vit_tiny_patch16_224" in printed and f"vitrain / timm img/s: {result['ours_over_timm']:.3f}" in printed


def test_timm_eager_times_timm_uncompiled_beside_a_compiled_run(tmp_path, capsys, monkeypatch):
    """``--timm-eager``: timm as its train.py runs by default, in the same process as the compiled runs;
    ``--compile-mode`` reaches torch.compile for ours and the compiled timm (an ``eager`` backend that
    records its calls stands in for inductor)."""
    pytest.importorskip("timm")
    modes = []
    real_compile = torch.nn.Module.compile

    def recording_compile(module, *args, **kwargs):
        modes.append((type(module).__name__, kwargs.get("mode")))
        return real_compile(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", recording_compile)
    path = tmp_path / "bench.json"
    argv = ["bench", "--model", "vit_tiny_patch16", "--image-size", "32", "--batch", "2", "--precision", "fp32"]
    argv += ["--steps", "1", "--repeats", "1", "--warmup", "1", "--compile", "--compile-backend", "eager"]
    argv += ["--compile-mode", "max-autotune-no-cudagraphs", "--compare-timm", "--timm-eager", "--json", str(path)]
    assert main(argv) == 0
    result = json.loads(path.read_text())
    ours, compiled, eager = result, result["timm"], result["timm_eager"]
    assert (ours["compile"], compiled["compile"], eager["compile"]) == (True, True, False)
    assert (ours["compile_mode"], compiled["compile_mode"], eager["compile_mode"]) == (
        "max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs", None
    )  # fmt: skip
    assert modes == [("VisionTransformer", "max-autotune-no-cudagraphs")] * 2  # ours, then timm's; eager: none
    assert result["ours_over_timm_eager"] == pytest.approx(ours["img_s_median"] / eager["img_s_median"])
    printed = capsys.readouterr().out
    assert "timm eager" in printed.splitlines()[0]
    assert f"vitrain / timm eager img/s: {result['ours_over_timm_eager']:.3f}" in printed


def test_timm_reference_maps_locality_and_small_vits_to_plain_timm_vits():
    timm = pytest.importorskip("timm")
    plan, _ = _plan("locality_vit_small_patch16", 32, 2)
    reference = timm_reference(plan)
    assert reference.description == "vit_small_patch16_224 (no locality FFN in timm)"
    ours = build_model("locality_vit_small_patch16", device="meta", img_size=32, num_classes=10)
    assert reference.flops_per_image < model_flops(ours, 32)  # without the depthwise conv

    plan, _ = _plan("locality_vit_tiny6_patch7", 28, 2, "model.head=gap")
    reference = timm_reference(plan)
    assert "depth=6" in reference.description and "patch_size=7" in reference.description
    assert "no locality FFN in timm" in reference.description
    with torch.device("meta"):
        theirs = timm.create_model(reference.architecture, pretrained=False, **reference.kwargs)
    plain = build_model("vit_tiny6_patch7", device="meta", img_size=28, head="gap", num_classes=10)
    theirs_shapes = {key: tuple(value.shape) for key, value in theirs.state_dict().items()}
    assert theirs_shapes == {key: tuple(value.shape) for key, value in plain.state_dict().items()}
    assert reference.flops_per_image == model_flops(plain, 28)

    plan, _ = _plan("vit_tiny6_convstem_patch8", 32, 2, "model.head=gap")
    reference = timm_reference(plan)
    assert "timm's patchify stem" in reference.description
    patchify = build_model("vit_tiny6_convstem_patch8", device="meta", stem="patch", head="gap", num_classes=10)
    assert reference.flops_per_image == model_flops(patchify, 32)

    plan, _ = _plan("vit_tiny_patch16", 32, 2, "model.mlp_ratio=2", "model.head=gap")
    reference = timm_reference(plan)
    assert reference.description == "vit_tiny_patch16_224 (with mlp_ratio=2.0)"
    assert reference.kwargs["mlp_ratio"] == 2.0 and reference.kwargs["global_pool"] == "avg"


def test_recipe_settings_apply_and_its_data_is_replaced_by_synthetic():
    plan, settings = _plan("locality_vit_tiny6_patch7", 28, 8, recipe="fmnist", warmup=2, steps=3, repeats=4)
    assert (plan.config.model.head, plan.config.model.attn_impl) == ("gap", "matmul")  # from the recipe
    assert plan.config.data.name == "synthetic" and plan.config.data.root is None
    assert (plan.batch.global_batch, plan.schedule.total_steps) == (8, settings.total_steps) == (8, 14)


def test_compile_targets_the_module_that_runs_forward(monkeypatch):
    compiled = []
    original = torch.nn.Module.compile

    def spy(module, *args, **kwargs):
        compiled.append(module)
        return original(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", spy)
    plan, settings = _plan(
        "vit_tiny6_patch7", 14, 2, "precision=bf16", "precision_mode=o2", compile=True, compile_backend="eager"
    )
    record = measure_training_step(plan, settings)
    assert len(compiled) == 1 and next(compiled[0].parameters()).dtype == torch.bfloat16  # O2's compute copy
    assert record["compile"] is True and record["compile_s"] > 0 and record["precision_mode"] == "o2"
    assert record["peak_source"].startswith("measured: the CPU's best matmul probe")


def test_mfu_above_one_is_refused_with_a_reason(monkeypatch):
    from vitrain.bench import throughput
    from vitrain.bench.memory import PeakMemory
    from vitrain.metrics.peak import PeakFlops

    plan, settings = _plan("vit_tiny6_patch7", 14, 4)
    times = throughput.StepTimes(warmup_s=1.0, first_step_s=0.5, window_s=(0.1,), final_loss=2.0)
    memory = PeakMemory("cpu")
    monkeypatch.setattr(throughput, "run_peaks", lambda plan: (PeakFlops(1e-9, "a tiny peak"), None))
    record = throughput.throughput_record(plan, times, settings, 1_000_000, memory)
    assert record["img_s_median"] == pytest.approx(40.0) and record["step_ms_median"] == pytest.approx(100.0)
    assert record["mfu"] is None and "exceeds the peak" in record["mfu_reason"]
    monkeypatch.setattr(throughput, "run_peaks", lambda plan: (PeakFlops(None, "no figure"), None))
    record = throughput.throughput_record(plan, times, settings, 1_000_000, memory)
    assert record["mfu"] is None and record["mfu_reason"] == "no figure"


def test_timing_harness_runs_warmup_then_windows():
    calls = []

    def step(images, labels):
        calls.append(len(labels))
        return torch.tensor(1.5), None

    settings = BenchSettings(steps=3, warmup=2, repeats=4)
    times = time_training_steps(step, torch.zeros(5, 1), torch.zeros(5), "cpu", settings)
    assert len(calls) == settings.total_steps == 14
    assert len(times.window_s) == 4 and all(seconds > 0 for seconds in times.window_s)
    assert times.first_step_s is not None and times.first_step_s <= times.warmup_s
    assert times.final_loss == 1.5


def test_cpu_peak_probe_is_positive_and_cached():
    from vitrain.metrics.peak import _cpu_matmul_tflops

    _cpu_matmul_tflops.cache_clear()
    first = measure_cpu_peak("fp32", size=128, seconds=0.02)
    second = measure_cpu_peak("fp32", size=128, seconds=0.02)
    assert first.tflops > 0 and second == first
    assert _cpu_matmul_tflops.cache_info().misses == 1 and _cpu_matmul_tflops.cache_info().hits == 1
    assert first.source.startswith("measured: CPU matmul probe 128x128 fp32")
    with pytest.raises(ValueError, match="precision"):
        measure_cpu_peak("fp8")


@pytest.mark.parametrize(
    ("name", "precision", "matmul_precision", "tflops", "label"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", "highest", 989.4, "H100 SXM"),
        ("NVIDIA H100 PCIe", "bf16", "highest", 756.0, "H100 PCIe"),
        ("NVIDIA H100 NVL", "fp16", "highest", 835.5, "H100 NVL"),
        ("NVIDIA H200", "bf16", "highest", 989.4, "H200 SXM"),
        ("NVIDIA A100-SXM4-80GB", "fp16", "highest", 312.0, "A100"),
        ("NVIDIA A100-PCIE-40GB", "fp32", "highest", 19.5, "A100"),
        ("NVIDIA A100-SXM4-40GB", "fp32", "high", 156.0, "A100 tf32"),
        ("NVIDIA A10", "bf16", "highest", 125.0, "A10 bf16"),
        ("NVIDIA L4", "bf16", "highest", 121.0, "L4 bf16"),
        ("NVIDIA L40S", "bf16", "highest", 362.05, "L40S bf16"),
        ("Tesla V100-SXM2-16GB", "fp16", "highest", 125.0, "V100 SXM2"),
    ],
)
def test_cuda_peak_table_lookup(name, precision, matmul_precision, tflops, label):
    peak = cuda_peak(name, precision, float32_matmul_precision=matmul_precision)
    assert peak.tflops == tflops and label in peak.source and "datasheet" in peak.source


def test_cuda_peak_without_a_figure_gives_a_reason():
    unknown = cuda_peak("NVIDIA GeForce GTX 1080", "bf16")
    assert unknown.tflops is None and "CUDA_PEAKS" in unknown.source
    no_bf16 = cuda_peak("Tesla V100-PCIE-16GB", "bf16")
    assert no_bf16.tflops is None and "V100 PCIe has no bf16" in no_bf16.source
    assert all(entry.source and all(value > 0 for value in entry.tflops.values()) for entry in CUDA_PEAKS)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "vit_tiny_patchX", "--image-size", "32"], "unknown model 'vit_tiny_patchX'"),
        (["--model", "vit_tiny_patch16", "--image-size", "30"], "not divisible by the patch size 16"),
        (["--model", "vit_tiny_patch16", "--image-size", "32", "--steps", "0"], "--steps must be >= 1"),
        (["--model", "vit_tiny_patch16", "--image-size", "32", "--compile", "--warmup", "0"], "--warmup must be >= 1"),
        (["--model", "localvit_tiny_patch16", "--image-size", "32", "--compare-timm"], "has no timm equivalent"),
        (["--model", "volo_d1", "--image-size", "32", "--recipe", "fmnist"], "set model.head=null"),
        (["--model", "vit_tiny_patch16", "--image-size", "32", "--compare-timm", "--timm-eager"], "add --compare-timm"),
        (["--model", "vit_tiny_patch16", "--image-size", "32", "--compile", "--timm-eager"], "and --compile"),
    ],
)
def test_bad_input_exits_2_with_a_message(argv, needle, capsys):
    assert main(["bench", *argv, "--batch", "2", "--precision", "fp32"]) == 2
    assert needle in capsys.readouterr().err


def test_bench_settings_reject_nonpositive_counts():
    with pytest.raises(ConfigError, match="--repeats"):
        BenchSettings(repeats=0)


def _ladder_plan_for(model: str, image_size: int, batch: int):
    settings = BenchSettings(steps=1, warmup=1, repeats=1, compile_backend="eager")
    flags = bench_overrides(model, image_size, batch, "bf16", None, settings)
    return (lambda extra: make_plan(build_config(Config(), [], flags + extra))), settings


def test_ladder_is_cumulative_keeps_the_faster_attention_and_reports_relative_throughput():
    from vitrain.bench import ladder_rungs, run_ladder

    plan_for, settings = _ladder_plan_for("vit_tiny6_patch7", 14, 4)
    result = run_ladder(plan_for, settings, ladder_rungs("bf16", ("sdpa", "matmul"), with_compile=True))
    rows = result["rungs"]
    assert [row["rung"] for row in rows] == [
        "fp32 baseline",
        "+ bf16 autocast",
        "+ fused optimizer",
        "+ attention choice",
        "+ torch.compile",
        "+ bf16 O2 weights",
        "+ activation checkpointing (memory)",
    ]
    assert rows[0]["speedup"] == 1.0 and all(row["speedup"] > 0 for row in rows)
    assert (rows[0]["precision"], rows[0]["optimizer"], rows[0]["compile"]) == (
        "fp32",
        "adamw for-loop (vitrain build_optimizer)",
        False,
    )
    assert (rows[1]["precision"], rows[2]["optimizer"]) == ("bf16", "adamw fused (vitrain build_optimizer)")
    alternatives = rows[3]["alternatives"]
    faster = max(alternatives, key=alternatives.get)
    assert set(alternatives) == {"model.attn_impl=sdpa", "model.attn_impl=matmul"} and rows[3]["chosen"] == faster
    kept = rows[4]["chosen"] is None  # compile stays on only if it measured faster than the rung before
    assert rows[4]["compile"] and rows[5]["precision_mode"] == "o2" and rows[6]["compile"] == kept
    assert rows[6]["settings"][-1] == ("--compile" if kept else "performance.activation_checkpointing=all")
    assert all(faster in row["settings"] for row in rows[3:])
    assert result["skipped"] == []


def test_the_attention_rung_measures_every_candidate_of_the_device():
    from vitrain.bench import ladder_rungs
    from vitrain.train.attention_probe import candidates

    def attention_rung(device):
        rungs = {rung.name: rung for rung in ladder_rungs("bf16", candidates(device), with_compile=True)}
        return rungs["+ attention choice"].alternatives

    assert attention_rung("cpu") == (("model.attn_impl=sdpa",), ("model.attn_impl=matmul",))
    pinned = {f"model.attn_impl=sdpa_{kernel}" for kernel in ("flash", "efficient", "cudnn")}
    assert {choice for (choice,) in attention_rung("cuda:0")} == pinned | set(sum(attention_rung("cpu"), ()))
    assert "+ attention choice" not in {rung.name for rung in ladder_rungs("bf16", (), with_compile=True)}


def test_an_attention_alternative_that_cannot_run_leaves_the_others(monkeypatch):
    """One pinned kernel this GPU lacks is recorded as failed; the rung keeps the fastest of the rest."""
    import vitrain.bench.ladder as ladder

    def fake_measure(plan, settings):  # noqa: ANN001, ANN202
        impl = plan.config.model.attn_impl
        if impl == "sdpa_math":
            raise RuntimeError("No available kernel. Aborting execution.")
        return {"img_s_median": {"sdpa_flash": 300.0, "sdpa": 200.0}.get(impl, 100.0), "peak_memory_bytes": None}

    monkeypatch.setattr(ladder, "measure_training_step", fake_measure)
    plan_for, settings = _ladder_plan_for("vit_tiny6_patch7", 14, 4)
    rungs = ladder.ladder_rungs("bf16", ("sdpa", "matmul", "sdpa_flash", "sdpa_math"), with_compile=False)
    result = ladder.run_ladder(plan_for, settings, rungs)
    (attention,) = [row for row in result["rungs"] if row["rung"] == "+ attention choice"]
    assert attention["chosen"] == "model.attn_impl=sdpa_flash" and set(attention["alternatives"]) == {
        "model.attn_impl=sdpa", "model.attn_impl=matmul", "model.attn_impl=sdpa_flash"
    }  # fmt: skip
    assert attention["failed"] == {
        "model.attn_impl=sdpa_math": "RuntimeError: No available kernel. Aborting execution."
    }
    assert result["skipped"] == [] and "model.attn_impl=sdpa_flash" in result["rungs"][-1]["settings"]


@pytest.mark.parametrize("compile_pays", [True, False])
def test_ladder_carries_compile_forward_only_if_it_measured_faster(monkeypatch, compile_pays):
    """Measurements injected (a real compile's speed depends on the host): compile 1.5x the rung before
    is kept for the O2 and checkpointing rungs; compile at 0.8x is reported but the later rungs run
    without it."""
    import vitrain.bench.ladder as ladder

    calls = []

    def fake_measure(plan, settings):  # noqa: ANN001, ANN202
        calls.append(settings.compile)
        factor = (1.5 if compile_pays else 0.8) if settings.compile else 1.0
        return {"img_s_median": 100.0 * factor, "compile": settings.compile, "peak_memory_bytes": None}

    monkeypatch.setattr(ladder, "measure_training_step", fake_measure)
    plan_for, settings = _ladder_plan_for("vit_tiny6_patch7", 14, 4)
    rows = ladder.run_ladder(plan_for, settings, ladder.ladder_rungs("bf16", (), with_compile=True))["rungs"]
    names = [row["rung"] for row in rows]
    compiled = rows[names.index("+ torch.compile")]
    assert compiled["compile"] and compiled["settings"][-1] == "--compile"
    later = rows[names.index("+ torch.compile") + 1 :]
    assert [row["compile"] for row in later] == [compile_pays] * 2
    assert all(("--compile" in row["settings"]) == compile_pays for row in later)
    assert (compiled["chosen"] is None) == compile_pays
    assert calls == [False, False, False, True, compile_pays, compile_pays]


def test_ladder_reports_a_rung_the_model_cannot_take_and_goes_on(tmp_path, capsys, monkeypatch):
    """ResNet-50 has no attention option (no attention rung) and its BatchNorm blocks refuse
    activation checkpointing: that rung is reported as skipped, the others are measured."""
    import vitrain.bench

    rungs = vitrain.bench.ladder_rungs  # inductor would compile ResNet-50 for minutes: test without
    monkeypatch.setattr(vitrain.bench, "ladder_rungs", lambda *a, **k: rungs(*a, **{**k, "with_compile": False}))
    path = tmp_path / "ladder.json"
    argv = ["bench", "--ladder", "--model", "resnet50", "--image-size", "32", "--batch", "2", "--precision", "bf16"]
    assert main([*argv, "--steps", "1", "--repeats", "1", "--warmup", "1", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    names = [row["rung"] for row in result["rungs"]]
    assert "+ attention choice" not in names and names[0] == "fp32 baseline"
    assert [row["rung"] for row in result["skipped"]] == ["+ activation checkpointing (memory)"]
    assert "BatchNorm" in result["skipped"][0]["reason"]
    out = capsys.readouterr()
    assert "skipped: + activation checkpointing" in out.out
    assert ("plot:" in out.out) == path.with_suffix(".png").exists()


def test_window_ms_times_each_window_per_call_after_the_warm_up():
    calls = []

    def sleep_5ms() -> None:
        calls.append(None)
        time.sleep(0.005)

    windows = window_ms(sleep_5ms, repeats=3, calls=4, warmup=2)
    assert len(calls) == 2 + 3 * 4 and len(windows) == 3
    # milliseconds per call (at least the 5 ms slept), not per window of 4 calls (20 ms and more)
    assert all(5 <= window < 20 for window in windows)


@pytest.mark.parametrize("precision_mode", ["autocast", "o2"])
def test_compiled_step_with_activation_checkpointing_measures(precision_mode):
    """The ladder's last rung when compile was kept: a whole-model graph around checkpointed blocks
    saved other tensors than the eager recomputation (CheckpointError); the bench compiles per block."""
    import dataclasses

    from vitrain.bench import measure_training_step

    plan_for, settings = _ladder_plan_for("vit_tiny6_patch7", 14, 4)
    plan = plan_for([f"precision_mode={precision_mode}", "performance.activation_checkpointing=all"])
    record = measure_training_step(plan, dataclasses.replace(settings, compile=True))
    assert record["compile"] and record["img_s_median"] > 0
