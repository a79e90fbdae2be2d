"""TFLOP/s, MFU and peak memory in the training metrics, against the benchmark's formula worked out here:
training FLOPs = 3 x analytic forward FLOPs per image at the step's size x images, over the fake clock's
seconds."""

from __future__ import annotations

import pytest

from tests.conftest import make_config
from vitrain.metrics import read_jsonl
from vitrain.metrics.peak import PeakFlops
from vitrain.models.flops import model_flops
from vitrain.train import build_model_for, loop, make_plan, train

SECONDS_PER_STEP = 0.25
PEAK_TFLOPS = 0.1


def _fix_peak(monkeypatch, tflops: float | None) -> list[tuple[str, str]]:
    """The device peak the loop looks up, fixed; returns the lookups it made."""
    asked = []

    def fixed_peak(device: str, precision: str) -> PeakFlops:
        asked.append((device, precision))
        return PeakFlops(tflops, "a fixed test peak" if tflops else "no peak for this device")

    monkeypatch.setattr(loop, "peak_flops", fixed_peak)
    return asked


def _run(overrides, step_clock):
    step_clock.seconds_per_step = SECONDS_PER_STEP
    plan = make_plan(make_config(*overrides))
    summary = train(plan, clock=step_clock)
    records = [record for record in read_jsonl(plan.out_dir / "metrics.jsonl") if record["event"] == "train"]
    return plan, summary, records


def _expected_tflops(plan, records, shapes):
    """Each window's TFLOP/s from the shapes the steps ran: (batch, channels, size, size) per step."""
    model = build_model_for(plan)
    forward = {size: model_flops(model, size) for size in {shape[2] for shape in shapes}}
    flops = [3 * forward[shape[2]] * shape[0] for shape in shapes]  # backward = 2 x forward
    expected, previous = [], 0
    for record in records:
        steps = record["step"] - previous
        expected.append(sum(flops[previous : record["step"]]) / (steps * SECONDS_PER_STEP) / 1e12)
        previous = record["step"]
    return expected, sum(flops) / (len(shapes) * SECONDS_PER_STEP) / 1e12


def test_tflops_and_mfu_follow_the_bench_formula(small_synthetic_overrides, step_clock, monkeypatch, one_thread):
    asked = _fix_peak(monkeypatch, PEAK_TFLOPS)
    plan, summary, records = _run([*small_synthetic_overrides, "train.epochs=1"], step_clock)
    assert asked == [("cpu", "fp32")]
    expected, mean = _expected_tflops(plan, records, step_clock.shapes)
    assert [record["tflops"] for record in records] == pytest.approx(expected, rel=1e-9)
    assert [record["mfu"] for record in records] == pytest.approx([tflops / PEAK_TFLOPS for tflops in expected])
    assert 0 < records[0]["mfu"] < 1
    assert summary["mean_tflops"] == pytest.approx(mean, rel=1e-9)
    assert summary["mean_mfu"] == pytest.approx(mean / PEAK_TFLOPS, rel=1e-9)
    memory = [record["peak_mem_gib"] for record in records]
    assert all(value > 0 for value in memory) and summary["peak_mem_gib"] == max(memory)


def test_tflops_count_each_step_at_its_curriculum_size(small_synthetic_overrides, step_clock, monkeypatch, one_thread):
    """14 px for the first 4 steps, then 21 px: the window of steps 4-6 mixes both sizes."""
    _fix_peak(monkeypatch, PEAK_TFLOPS)
    overrides = [
        *small_synthetic_overrides,
        "data.image_size=21",
        "train.epochs=2",
        "train.log_every_steps=3",
        "curriculum.stages=[{until: 0.3, image_size: 14}]",
    ]
    plan, summary, records = _run(overrides, step_clock)
    sizes = [shape[2] for shape in step_clock.shapes]
    assert sizes == [14] * 4 + [21] * 8
    expected, mean = _expected_tflops(plan, records, step_clock.shapes)
    assert [record["step"] for record in records] == [3, 6, 9, 12]
    assert [record["tflops"] for record in records] == pytest.approx(expected, rel=1e-9)
    assert expected[0] < expected[1] < expected[2]  # 21 px costs more per image than 14 px
    assert [record["mfu"] for record in records] == pytest.approx([tflops / PEAK_TFLOPS for tflops in expected])
    assert summary["mean_tflops"] == pytest.approx(mean, rel=1e-9)
    assert summary["mean_mfu"] == pytest.approx(mean / PEAK_TFLOPS, rel=1e-9)


def test_mfu_is_none_when_the_peak_is_unknown(small_synthetic_overrides, step_clock, monkeypatch, one_thread):
    _fix_peak(monkeypatch, None)
    _, summary, records = _run([*small_synthetic_overrides, "train.epochs=1"], step_clock)
    assert records and all(record["mfu"] is None and record["tflops"] > 0 for record in records)
    assert summary["mean_mfu"] is None and summary["mean_tflops"] > 0


@pytest.mark.parametrize(
    ("fp32", "bf16", "best"),
    [(0.119, 0.031, "fp32"), (0.2, 0.9, "bf16")],
    ids=["emulated-bf16", "native-bf16"],
)
def test_mfu_on_a_cpu_divides_by_the_best_precision_it_trains_in(monkeypatch, fp32, bf16, best):
    """An Ice Lake Xeon emulates bf16 at a quarter of its fp32 speed: a bf16 run there must not be measured
    against the emulated bf16 peak (it showed MFU 0.63 while running at a quarter of the machine's speed)."""
    from vitrain.metrics import peak

    measured = {"fp32": fp32, "bf16": bf16}
    monkeypatch.setattr(peak, "measure_cpu_peak", lambda precision: PeakFlops(measured[precision], precision))
    for precision in ("fp32", "bf16"):
        chosen = peak.peak_flops("cpu", precision)
        assert chosen.tflops == measured[best] and f", {best} (" in chosen.source, chosen.source
