"""TFLOP/s, MFU and peak memory in the training metrics, against the benchmark's formula worked out here:
training FLOPs = 3 x analytic forward FLOPs per image at the step's size x images, over the fake clock's
seconds."""

from __future__ import annotations

import pytest

from tests.conftest import make_config
from vitrain.metrics import ThroughputMeter, read_jsonl
from vitrain.metrics.peak import PeakFlops
from vitrain.models.flops import model_flops
from vitrain.train import build, build_model_for, make_plan, train

SECONDS_PER_STEP = 0.25
PEAK_TFLOPS = 0.1


def _fix_peak(monkeypatch, tflops: float | None) -> list[tuple[str, str]]:
    """The device peak the loop looks up, fixed; returns the lookups it made."""
    asked = []

    def fixed_peak(device: str, precision: str, fp8_share: float = 0.0) -> PeakFlops:
        asked.append((device, precision))
        return PeakFlops(tflops, "a fixed test peak" if tflops else "no peak for this device")

    monkeypatch.setattr(build, "peak_flops", fixed_peak)
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


def test_the_throughput_meter_counts_windows_and_the_session():
    meter = ThroughputMeter("cpu", devices=2, peak=PeakFlops(0.1, "a fixed test peak"))
    meter.forward_flops = 10**9
    meter.open_window(10.0, (1_000_000, 3))
    meter.waited_for_data(0.5)
    meter.stepped(10)
    meter.stepped(10)
    elapsed, window = meter.close_window(12.0, (3_000_000, 7))
    assert elapsed == 2.0 and list(window) == [
        "img_s", "tflops", "mfu", "peak_mem_gib", "data_wait_frac", "read_mb_s", "files_s"
    ]  # fmt: skip
    tflops = 3 * 10**9 * 20 / 2.0 / 1e12  # training FLOPs: forward + a backward of twice its cost
    assert window["img_s"] == 10.0 and window["tflops"] == pytest.approx(tflops)
    assert window["mfu"] == pytest.approx(tflops / 2 / 0.1)  # per device
    assert window["data_wait_frac"] == 0.25 and window["read_mb_s"] == 1.0 and window["files_s"] == 2.0
    assert window["peak_mem_gib"] > 0
    meter.open_window(12.0, (3_000_000, 7))
    meter.stepped(20)
    meter.close_window(14.0, (3_000_000, 7))
    assert (meter.images, meter.train_s, meter.data_wait_s) == (40, 4.0, 0.5)
    session = meter.session_utilization()
    assert session["mean_tflops"] == pytest.approx(tflops) and session["mfu_peak_tflops"] == 0.1
    assert meter.session_reads((3_000_000, 7)) == {"mean_read_mb_s": 0.5, "mean_files_s": 1.0}
    assert meter.session_reads(None) == {"mean_read_mb_s": None, "mean_files_s": None}  # in-memory data


def test_the_meter_without_a_peak_or_reads_reports_none():
    meter = ThroughputMeter("cpu")
    meter.open_window(0.0, None)
    meter.stepped(4)
    _, window = meter.close_window(1.0, None)
    assert window["tflops"] == 0.0 and window["mfu"] is None  # no forward FLOPs known, no peak
    assert window["read_mb_s"] is None and window["files_s"] is None
