"""precision=auto, precision_mode=auto and performance.cpu_kernels=auto: chosen by timing the run's own step.

The candidate lists, the choice of the fastest, the kernels built only within reach, the cache, the smaller
probe batch, explicit settings left alone, and a real probe of a tiny run whose summary records the figures."""

from __future__ import annotations

import json

import pytest

from tests.conftest import make_config
from vitrain.config import DatasetInfo, Hardware, MeasuredPrecision, resolve
from vitrain.models import model_facts
from vitrain.train import make_plan, precision_choice, train
from vitrain.train.precision_choice import Candidate, candidates, measure_precision

DATA = DatasetInfo(num_train=512, num_eval=64, num_classes=10, channels=1, mean=(0.5,), std=(0.25,))
CPU = Hardware(cuda_available=False, bf16_supported=False, bf16_emulated=True)
CPU_AMX = Hardware(cuda_available=False, bf16_supported=True, bf16_emulated=True, amx_tiles=True)
GPU_BF16 = Hardware(cuda_available=True, bf16_supported=True)
GPU_NO_BF16 = Hardware(cuda_available=True, bf16_supported=False)
TINY = ["model.name=vit_tiny6_patch7", "data.image_size=14", "train.batch_size=16", "train.progress=off"]


def labels(found):
    return [candidate.label for candidate in found]


def test_candidates_follow_the_auto_settings_and_the_device():
    auto = make_config("precision=auto", "precision_mode=auto")
    assert labels(candidates(auto, "cpu", CPU)) == [
        "fp32",
        "bf16 autocast",
        "bf16 o2",
        "bf16 o2 + fused kernels",
    ]  # without AMX the kernels do not change an autocast step: nothing to build or time for it
    assert "bf16 autocast + fused kernels" in labels(candidates(auto, "cpu", CPU_AMX))
    assert labels(candidates(auto, "cuda", GPU_BF16)) == ["fp32", "bf16 autocast", "bf16 o2"]
    assert labels(candidates(auto, "cuda", GPU_NO_BF16)) == ["fp32"]  # fp16 is never chosen for the user
    assert labels(candidates(make_config("precision=auto", "precision_mode=o2"), "cpu", CPU)) == [
        "fp32",
        "bf16 o2",
        "bf16 o2 + fused kernels",
    ]
    explicit = make_config("precision=bf16", "precision_mode=o2")
    assert labels(candidates(explicit, "cpu", CPU)) == ["bf16 o2", "bf16 o2 + fused kernels"]
    pinned = make_config("precision=bf16", "precision_mode=o2", "performance.cpu_kernels=native")
    assert labels(candidates(pinned, "cpu", CPU)) == ["bf16 o2"]
    assert labels(candidates(make_config("precision=fp32", "precision_mode=auto"), "cpu", CPU)) == ["fp32"]


def _fake_timing(monkeypatch, rates: dict[str, float], first_s: float = 0.1):
    """Replace the timing of a candidate's step by fixed img/s per label; returns the labels timed, in order."""
    timed = []

    def fake(plan, best_step_s=None, best_first_s=None, max_step_s=None):
        label = Candidate(plan.precision.dtype, plan.precision.mode, plan.runtime.cpu_kernels).label
        timed.append((label, plan.batch.global_batch))
        return rates[label], first_s

    monkeypatch.setattr(precision_choice, "time_candidate", fake)
    return timed


def test_the_fastest_candidate_is_taken_and_resolve_follows_it(cache_dir, monkeypatch):
    rates = {"fp32": 100.0, "bf16 autocast": 150.0, "bf16 o2": 180.0, "bf16 o2 + fused kernels": 200.0}
    timed = _fake_timing(monkeypatch, rates)
    monkeypatch.setattr(precision_choice.kernels, "load", lambda: object())
    config = make_config(*TINY, "precision=auto", "precision_mode=auto")
    measured = measure_precision(config, DATA, CPU)
    assert [label for label, _ in timed] == list(rates)  # native ops first, then the kernels within reach
    assert (measured.precision, measured.mode, measured.cpu_kernels) == ("bf16", "o2", "auto")
    assert measured.img_s == rates and measured.chosen == "bf16 o2 + fused kernels" and not measured.cached
    plan = resolve(config, DATA, CPU, model_facts, measured=measured)
    assert (plan.precision.dtype, plan.precision.mode, plan.runtime.cpu_kernels) == ("bf16", "o2", "auto")
    assert plan.measured is measured

    def refuse(*args, **kwargs):
        raise AssertionError("a cached choice was timed again")

    monkeypatch.setattr(precision_choice, "time_candidate", refuse)
    again = measure_precision(config, DATA, CPU)
    assert again.cached and again.chosen == measured.chosen and again.img_s == rates
    (key,) = json.loads((cache_dir / "measured.json").read_text())
    assert key.startswith("precision | ") and "vit_tiny6_patch7" in key and "batch 16" in key


def test_kernels_are_not_built_where_bf16_cannot_come_within_their_reach(cache_dir, monkeypatch):
    """An emulated-bf16 CPU: bf16 far slower than fp32, so the kernels (minutes to build) are never built."""
    rates = {"fp32": 430.0, "bf16 autocast": 160.0, "bf16 o2": 169.0}
    timed = _fake_timing(monkeypatch, rates)

    def no_build():
        raise AssertionError("the kernels were built for a candidate that cannot win")

    monkeypatch.setattr(precision_choice.kernels, "load", no_build)
    measured = measure_precision(make_config(*TINY, "precision=auto", "precision_mode=auto"), DATA, CPU)
    assert (measured.precision, measured.cpu_kernels) == ("fp32", "native")
    assert [label for label, _ in timed] == list(rates)
    assert "cannot win" in measured.skipped["bf16 o2 + fused kernels"]
    plan = resolve(
        make_config(*TINY, "precision=auto", "precision_mode=auto"), DATA, CPU, model_facts, measured=measured
    )
    assert (plan.precision.dtype, plan.runtime.cpu_kernels) == ("fp32", "native")


def test_kernels_that_fail_to_build_are_left_out_and_measured_again_later(cache_dir, monkeypatch):
    _fake_timing(monkeypatch, {"bf16 o2": 100.0})
    monkeypatch.setattr(precision_choice.kernels, "load", lambda: None)
    monkeypatch.setattr(precision_choice.kernels.build, "failure", lambda: "RuntimeError: no g++")
    monkeypatch.setattr(precision_choice.kernels.build, "cache_state", lambda: ("missing", None))
    config = make_config(*TINY, "precision=bf16", "precision_mode=o2")
    measured = measure_precision(config, DATA, CPU)
    assert measured.chosen == "bf16 o2" and measured.cpu_kernels == "native"
    assert "could not be built" in measured.skipped["bf16 o2 + fused kernels"]
    assert not measure_precision(config, DATA, CPU).cached  # a build failure may pass (a compiler installed)


def test_a_step_of_seconds_makes_the_probe_time_a_smaller_batch(cache_dir, monkeypatch):
    timed = _fake_timing(monkeypatch, {"fp32": 2.0, "bf16 o2": 1.0}, first_s=30.0)  # fp32: 8 s a step of 16
    config = make_config(*TINY, "precision=auto", "precision_mode=o2", "performance.cpu_kernels=native")
    measured = measure_precision(config, DATA, CPU)
    batch = int(16 * precision_choice.MAX_STEP_S / 8.0)
    assert timed == [("fp32", 16), ("fp32", batch), ("bf16 o2", batch)] and measured.batch == batch


def test_explicit_settings_are_never_measured_or_overridden(cache_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an explicit setting was measured")

    monkeypatch.setattr(precision_choice, "time_candidate", refuse)
    for overrides in (
        ["precision=fp32"],
        ["precision=bf16", "precision_mode=autocast"],
        ["precision=bf16", "precision_mode=o2", "performance.cpu_kernels=native"],
    ):
        assert measure_precision(make_config(*TINY, *overrides), DATA, CPU) is None
    fp32 = MeasuredPrecision("fp32", "autocast", "native", {"fp32": 2.0, "bf16 o2": 1.0}, "fp32", 16)
    plan = resolve(make_config(*TINY, "precision=bf16", "precision_mode=o2"), DATA, CPU, model_facts, measured=fp32)
    assert (plan.precision.dtype, plan.precision.mode) == ("bf16", "o2")  # the measurement does not override


def test_unmeasured_auto_falls_back_and_the_kernels_are_not_wanted_where_they_cannot_apply():
    plan = resolve(make_config(*TINY, "precision=auto", "precision_mode=auto"), DATA, CPU, model_facts)
    assert (plan.precision.dtype, plan.runtime.cpu_kernels) == ("fp32", "native")
    native = Hardware(cuda_available=False, bf16_supported=True, bf16_emulated=True)
    plan = resolve(make_config(*TINY, "precision=auto", "precision_mode=auto"), DATA, native, model_facts)
    assert (plan.precision.dtype, plan.precision.mode, plan.runtime.cpu_kernels) == ("bf16", "autocast", "native")
    plan = resolve(make_config(*TINY, "precision=bf16", "precision_mode=o2"), DATA, CPU, model_facts)
    assert plan.runtime.cpu_kernels == "auto"


@pytest.fixture
def patient_probe(monkeypatch):
    """No step is too slow to time at the run's batch: on a busy machine the probe would otherwise halve
    the batch, which these tests read back."""
    monkeypatch.setattr(precision_choice, "MAX_STEP_S", 1e9)


def test_a_real_probe_times_the_candidates_and_the_summary_keeps_the_figures(cache_dir, tmp_path, patient_probe):
    overrides = [
        *TINY,
        "data.name=synthetic",
        "data.synthetic_num_train=64",
        "data.synthetic_num_eval=16",
        "precision=auto",
        "precision_mode=o2",
        "performance.cpu_kernels=native",
        "train.steps=2",
        f"train.out_dir={tmp_path / 'run'}",
    ]
    plan = make_plan(make_config(*overrides))
    measured = plan.measured
    assert set(measured.img_s) == {"fp32", "bf16 o2"} and all(rate > 0 for rate in measured.img_s.values())
    assert measured.chosen == max(measured.img_s, key=measured.img_s.get) and measured.batch == 16
    assert plan.precision.dtype == measured.precision
    summary = train(plan)
    recorded = json.loads((plan.out_dir / "summary.json").read_text())
    assert recorded["auto"]["chosen"] == measured.chosen and recorded["auto"]["img_s"] == pytest.approx(measured.img_s)
    assert summary["precision"] == measured.precision
    assert recorded["mfu_peak_source"].startswith("measured: the CPU's best matmul probe")
    assert make_plan(make_config(*overrides)).measured.cached


def test_a_candidate_the_run_itself_refuses_is_not_timed(cache_dir, monkeypatch):
    """Tensor parallelism refuses O2: the single-process probe would admit it, the run would not."""
    from vitrain.config import World

    timed = _fake_timing(monkeypatch, {"fp32": 100.0, "bf16 autocast": 200.0, "bf16 o2": 300.0})
    config = make_config(*TINY, "precision=auto", "precision_mode=auto", "parallel.strategy=tp", "model.num_heads=6")
    monkeypatch.setattr(precision_choice, "broadcast_object", lambda value: value)
    measured = measure_precision(config, DATA, CPU, World(rank=0, size=2))
    assert [label for label, _ in timed] == ["fp32", "bf16 autocast"] and measured.chosen == "bf16 autocast"
    plan = resolve(config, DATA, CPU, model_facts, world=World(rank=0, size=2), measured=measured)
    assert plan.precision.mode == "autocast"


def test_a_large_model_is_probed_at_the_batch_its_flops_allow_in_seconds(cache_dir, monkeypatch):
    """ViT-B/16 at 224 px and batch 1024 on a CPU: the probe starts where a step takes seconds, not minutes."""
    from vitrain.metrics import peak

    monkeypatch.setattr(peak, "measure_cpu_peak", lambda precision: peak.PeakFlops(0.2, "a 2-core CPU's fp32"))
    timed = _fake_timing(monkeypatch, {"fp32": 10.0, "bf16 o2": 20.0})
    config = make_config(
        "model.name=vit_base_patch16",
        "data.image_size=224",
        "train.batch_size=1024",
        "precision=auto",
        "precision_mode=o2",
        "performance.cpu_kernels=native",
    )
    imagenet = DatasetInfo(
        num_train=1_281_167, num_eval=50_000, num_classes=1000, channels=3, mean=(0.5,) * 3, std=(0.25,) * 3
    )
    measure_precision(config, imagenet, CPU)
    batch = timed[0][1]
    assert 1 <= batch <= 16 and all(size == batch for _, size in timed)  # 3 x 17.6 GFLOPs an image at 0.2 TFLOP/s


def test_show_config_prints_the_measured_choice_and_its_figures(cache_dir, capsys, patient_probe):
    from vitrain.cli import main

    argv = ["show-config", *[item for setting in TINY for item in ("--set", setting)]]
    argv += ["--set", "data.name=synthetic", "--set", "precision=auto", "--set", "performance.cpu_kernels=native"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    measured = next(line for line in lines if line.startswith("# runs on cpu in ") and "(measured: " in line)
    assert "fp32 " in measured and "bf16 autocast " in measured and "img/s at batch 16" in measured
    assert main([*argv, "--set", "precision=fp32"]) == 0  # nothing to choose: what it computes in, unmeasured
    assert "# runs on cpu in fp32 autocast\n" in capsys.readouterr().out
