"""``vitrain forecast``: the ring-collective arithmetic, the overlap simulations and memory against hand-derived
figures, the model's own sizes against the analytic FLOPs and the parameter count, ``bench --comm`` over two
gloo processes, and bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vitrain.cli import main
from vitrain.forecast.fabrics import FABRICS, Fabric, fit_alpha_beta, ring_seconds, wire_bytes
from vitrain.forecast.model import Data, Layout, Measured, forecast, forecast_row
from vitrain.forecast.sizes import model_sizes
from vitrain.models import build_model, num_parameters
from vitrain.models.flops import model_flops

FABRIC = Fabric("test", 4, 100.0, 10.0, 2.0, 8.0, "test")
STEP = Measured(0.3, 64, "bf16", "o2", "adamw", 12 * 2**30, "NVIDIA H100 80GB HBM3", "test")


@pytest.fixture(scope="module")
def vit_b():
    return model_sizes("vit_base_patch16", 224, 1000)


@pytest.mark.parametrize(("name", "size"), [("vit_base_patch16", 224), ("resnet50", 224), ("volo_d1", 224)])
def test_the_model_sizes_are_the_models_own(name, size):
    """Per-unit parameters add up to the model's; FLOPs match the analytic count within 1 %."""
    sizes = model_sizes(name, size, 1000)
    model = build_model(name, num_classes=1000, **({"img_size": size} if name != "resnet50" else {}))
    assert sizes.params == num_parameters(model) == sum(unit.params for unit in sizes.units)
    assert sizes.flops == pytest.approx(model_flops(model, size), rel=0.01)
    assert len(sizes.units) == len(model.block_modules()) + 1


def test_ring_bytes_and_the_fit_recover_the_fabric():
    assert wire_bytes("all_reduce", 800, 4) == 2 * 3 / 4 * 800
    assert wire_bytes("all_gather", 800, 4) == wire_bytes("reduce_scatter", 800, 4) == 600
    assert ring_seconds("all_reduce", 1e9, 8, FABRIC, span_nodes=False) == pytest.approx(1.75e9 / 100e9 + 14 * 2e-6)
    assert ring_seconds("all_reduce", 1e9, 8, FABRIC, span_nodes=True) == pytest.approx(1.75e9 / 10e9 + 14 * 8e-6)
    for op in ("all_reduce", "reduce_scatter"):
        points = [
            (ranks, size, ring_seconds(op, size, ranks, FABRIC, False)) for ranks in (2, 4) for size in (4e3, 4e6)
        ]
        fit = fit_alpha_beta(op, points)
        assert fit["bus_gbs"] == pytest.approx(100.0, rel=1e-6) and fit["latency_us"] == pytest.approx(2.0, rel=1e-6)
    slow_gather = dataclasses.replace(FABRIC, measured=(("all_gather", 1.0, 50.0),))
    assert ring_seconds("all_gather", 1e9, 2, slow_gather, False) == pytest.approx(0.5 + 50e-6)
    assert ring_seconds("all_reduce", 1e9, 2, slow_gather, False) == ring_seconds("all_reduce", 1e9, 2, FABRIC, False)


def test_one_device_is_the_measurement(vit_b):
    for strategy in ("ddp", "fsdp"):
        row = forecast_row(1, vit_b, STEP, Layout(strategy, 64), FABRIC, None)
        assert row["step_s"] == pytest.approx(STEP.step_s) and row["memory_bytes"] == STEP.memory_bytes
        assert row["wire_bytes_per_step"] == 0 and row["limit"] == "compute"


def test_ddp_overlaps_the_all_reduce_with_the_backward(vit_b):
    """Fast links: nothing exposed but the last bucket; slow links: the all-reduce runs past the backward by
    (almost) all it takes beyond it. The wire carries 2(N-1)/N of the bf16 gradients."""
    fast = dataclasses.replace(FABRIC, intra_gbs=1e4, inter_gbs=1e4, intra_latency_us=0, inter_latency_us=0)
    row = forecast_row(4, vit_b, STEP, Layout("ddp", 64), fast, None)
    assert row["wire_bytes_per_step"] == pytest.approx(2 * 3 / 4 * vit_b.params * 2)
    assert row["exposed_comm_s"] < 0.01 * row["comm_s"] + ring_seconds("all_reduce", 30e6, 4, fast, False)
    slow = dataclasses.replace(fast, intra_gbs=0.1, inter_gbs=0.1)
    row = forecast_row(4, vit_b, STEP, Layout("ddp", 64), slow, None)
    backward = 2 * STEP.step_s / 3
    assert row["comm_s"] - backward <= row["exposed_comm_s"] <= row["comm_s"]
    assert row["step_s"] == pytest.approx(STEP.step_s + row["exposed_comm_s"])


def test_fsdp_gathers_twice_reduces_once_and_shards_the_states(vit_b):
    row = forecast_row(4, vit_b, STEP, Layout("fsdp", 64), FABRIC, None)
    root, blocks = vit_b.units[0].params, vit_b.params - vit_b.units[0].params
    gathered = (root + 2 * blocks) * 2  # bf16 gathers; the root is kept gathered for the backward
    assert row["wire_bytes_per_step"] == pytest.approx(3 / 4 * (gathered + vit_b.params * 4))
    kept = forecast_row(4, vit_b, STEP, Layout("fsdp", 64, reshard_after_forward=False), FABRIC, None)
    assert kept["wire_bytes_per_step"] == pytest.approx(3 / 4 * (vit_b.params * 2 + vit_b.params * 4))
    memories = [forecast_row(n, vit_b, STEP, Layout("fsdp", 64), FABRIC, None)["memory_bytes"] for n in (1, 2, 4, 8)]
    assert memories == sorted(memories, reverse=True)
    states = vit_b.params * STEP.state_bytes_per_param()
    assert memories[0] - memories[-1] == pytest.approx(states * 7 / 8 - (2 * vit_b.largest_unit_params + root) * 2)


def test_tensor_parallel_splits_the_blocks_and_all_reduces_their_outputs(vit_b):
    plain = forecast_row(2, vit_b, STEP, Layout("ddp", 64), FABRIC, None)
    split = forecast_row(2, vit_b, STEP, Layout("ddp", 64, tensor_parallel=2), FABRIC, None)
    share = sum(unit.tp_flops for unit in vit_b.units) / vit_b.flops
    assert split["compute_s"] == pytest.approx(STEP.step_s * (1 - share / 2))
    assert split["data_parallel"] == 1 and split["global_batch"] == 64 and plain["global_batch"] == 128
    activation = 64 * vit_b.block_output_numel * 2
    assert split["wire_bytes_per_step"] == pytest.approx(4 * 12 * wire_bytes("all_reduce", activation, 2))


def test_data_rates_limits_and_epochs(vit_b):
    data = Data(1_000_000, 100_000.0, storage_gbs=0.5)
    rows = forecast(vit_b, STEP, Layout("ddp", 64), FABRICS["dgx-h100"], [1, 2, 4, 8, 16, 32], data)
    assert rows[0]["efficiency"] == 1.0
    for row in rows:
        assert row["img_s"] <= 0.5e9 / 100_000.0 + 1e-6
        assert row["storage_gbs"] == pytest.approx(row["img_s"] * 1e5 / 1e9)
        assert row["epoch_s"] == pytest.approx(1_000_000 / row["img_s"])
    assert rows[-1]["limit"] == "storage" and rows[0]["limit"] == "compute"
    shards = forecast_row(
        8, vit_b, STEP, Layout("ddp", 64), FABRICS["dgx-h100"], dataclasses.replace(data, shards=True)
    )
    assert shards["iops"] == pytest.approx(shards["img_s"] * 100_000 / 2**20)


def test_processes_sharing_a_machine_share_its_compute(vit_b):
    rows = forecast(vit_b, STEP, Layout("ddp", 64, shared_host=True), FABRIC, [1, 2, 4], None)
    assert [row["compute_s"] for row in rows] == pytest.approx([STEP.step_s * n for n in (1, 2, 4)])
    assert all(row["efficiency"] <= 1.0 for row in rows)  # the speed-up over one process
    assert rows[2]["exposed_comm_s"] == rows[2]["comm_s"] > 0  # the same cores compute and communicate


def test_forecast_cli_from_a_published_rate(tmp_path, capsys):
    out = tmp_path / "forecast.json"
    args = ["forecast", "--img-s-per-device", "776.9", "--model", "resnet50", "--batch", "208", "--precision"]
    args += ["fp16", "--precision-mode", "o2", "--optimizer", "sgd", "--network", "ac922-v100-edr", "--devices"]
    args += ["2-64", "--images", "1281167", "--mean-file-kib", "110", "--epochs", "90", "--json", str(out)]
    assert main(args) == 0
    record = json.loads(out.read_text())
    assert [row["devices"] for row in record["rows"]] == [2, 4, 8, 16, 32, 64]
    assert record["rows"][0]["nodes"] == 1 and record["rows"][-1]["nodes"] == 16
    assert "first limit" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--network", "nvlink9"], "--network 'nvlink9': give a preset"),
        (["--devices", "0-4"], "--devices '0-4'"),
        (["--tensor-parallel", "2", "--model", "resnet50"], "--tensor-parallel: resnet50 has no blocks"),
        (["--data", "/nonexistent/folder"], "--data /nonexistent/folder: no such file or folder"),
        (["--bench", "x.json"], "exactly one of --bench"),
        (["--set", "model.depth=3"], "--set model.* would change the model"),
    ],
)
def test_bad_forecast_input_is_one_line_and_exit_2(extra, message, capsys):
    base = ["forecast", "--img-s-per-device", "100", "--model", "vit_tiny_patch16", "--batch", "8", "--precision"]
    assert main([*base, "fp32", *extra]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1


def test_a_bench_of_several_processes_is_refused(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(
        json.dumps(
            {
                "model": "vit_tiny_patch16",
                "image_size": 224,
                "batch": 8,
                "step_ms_median": 10.0,
                "precision": "fp32",
                "world_size": 2,
            }
        )
    )
    assert main(["forecast", "--bench", str(path)]) == 2
    assert "measured on 2 processes" in capsys.readouterr().err


def test_bench_comm_times_the_collectives_of_two_gloo_processes():
    from vitrain.bench.comm import run_comm

    result = run_comm([1, 2], repeats=5, cpu=True, sizes=(4096, 2**20, 2**23))
    assert result["backend"] == "gloo" and len(result["rows"]) == 9
    assert {row["op"] for row in result["rows"]} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert all(row["seconds"] > 0 and row["ranks"] == 2 for row in result["rows"])
    assert all(result["fit"][op]["bus_gbs"] > 0 for op in ("all_reduce", "all_gather", "reduce_scatter"))
