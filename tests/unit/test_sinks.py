"""log.sinks: a tiny run written to TensorBoard, MLflow, W&B (offline) and CSV, each read back with its own
library, holds the losses, eval top-1 and config of metrics.jsonl; a resumed run continues each sink
without repeated steps; a missing package is a ConfigError naming the extra; a failing sink is dropped
with one warning and the run completes."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import logging
import shutil
import struct
from pathlib import Path

import pytest

from tests.conftest import SMALL_SYNTHETIC_RUN, make_config
from vitrain.config import ConfigError, LogPlan
from vitrain.metrics import read_jsonl
from vitrain.metrics import sinks as sinks_module
from vitrain.metrics.sinks import CsvSink
from vitrain.train import make_plan, train

TOOLS = ("tensorboard", "mlflow", "wandb")
needs_tools = pytest.mark.skipif(
    any(importlib.util.find_spec(package) is None for package in TOOLS),
    reason="needs tensorboard, mlflow-skinny and wandb (the dev extra installs them)",
)
ALL_SINKS = "log.sinks=[jsonl, tensorboard, mlflow, wandb, csv]"


def _tool_environment(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """W&B offline and silent, its settings and caches in the test's folder; MLflow's file store allowed."""
    monkeypatch.delenv("WANDB_DIR", raising=False)  # the sink's default: the run folder's wandb/
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(home / "wandb-config"),
        "WANDB_CACHE_DIR": str(home / "wandb-cache"),
        "WANDB_DATA_DIR": str(home / "wandb-data"),
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-epoch run (12 steps, a window every 2, evals at steps 6 and 12) with every sink."""
    home = tmp_path_factory.mktemp("sinks")
    overrides = [*SMALL_SYNTHETIC_RUN, "train.epochs=2", "train.log_every_steps=2", ALL_SINKS, "log.run_name=tiny"]
    with pytest.MonkeyPatch.context() as monkeypatch:
        _tool_environment(monkeypatch, home)
        plan = make_plan(make_config(*overrides, f"train.out_dir={home / 'run'}"))
        summary = train(plan)
        yield plan.out_dir, overrides, summary
        import wandb

        wandb.teardown()  # ends W&B's service process


def _jsonl_values(folder: Path, event: str, field: str) -> dict[int, float]:
    records = read_jsonl(folder / "metrics.jsonl")
    return {record["step"]: record[field] for record in records if record["event"] == event}


def _tensorboard(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return events


def _tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in _tensorboard(folder).Scalars(tag)]


def _tensorboard_hparams(folder: Path) -> dict:
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = _tensorboard(folder).PluginTagToContent("hparams")["_hparams_/session_start_info"]
    return dict(plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams)


def _mlflow(folder: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(folder / "mlruns").resolve().as_uri())
    return client, (folder / "mlflow_run_id").read_text().strip()


def _wandb_records(path: Path) -> list:
    """The protobuf records of a W&B transaction log (run-<id>.wandb): after W&B's 7-byte file header,
    LevelDB's log format (32 KiB blocks; each piece a 7-byte header: checksum, length, full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, pending, position = [], b"", 7
    while position + 7 <= len(data):
        left_in_block = block - position % block
        if left_in_block < 7:
            position += left_in_block  # a block's tail too short for a header is padding
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # full or last piece
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def _wandb_item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _wandb_run(folder: Path) -> tuple[dict[int, dict], dict, dict]:
    """History rows by step, config and summary of the run folder's (single) offline W&B run."""
    (log_file,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    history, config, summary = {}, {}, {}
    for record in _wandb_records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {_wandb_item_key(item): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(row["_step"], {}).update(row)
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({_wandb_item_key(item): json.loads(item.value_json) for item in updates})
        elif kind == "summary":
            summary.update({_wandb_item_key(item): json.loads(item.value_json) for item in record.summary.update})
    return history, config, summary


def _csv_rows(folder: Path, event: str) -> list[dict[str, str]]:
    with open(folder / f"metrics-{event}.csv", newline="") as handle:
        return list(csv.DictReader(handle))


@needs_tools
def test_each_sink_holds_the_losses_top1_and_config_of_the_jsonl(finished_run):
    folder, _, summary = finished_run
    losses, top1 = _jsonl_values(folder, "train", "loss"), _jsonl_values(folder, "eval", "top1")
    assert sorted(losses) == [2, 4, 6, 8, 10, 12] and sorted(top1) == [6, 12]

    assert dict(_tensorboard_scalars(folder, "train/loss")) == pytest.approx(losses, rel=1e-6)  # float32 events
    assert dict(_tensorboard_scalars(folder, "eval/top1")) == pytest.approx(top1, rel=1e-6)
    hparams = _tensorboard_hparams(folder)
    assert hparams["model.name"].string_value == "vit_tiny6_patch7"
    assert hparams["train.batch_size"].number_value == 16

    client, run_id = _mlflow(folder)
    assert {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")} == losses
    assert {m.step: m.value for m in client.get_metric_history(run_id, "eval/top1")} == top1
    run = client.get_run(run_id)
    assert run.data.params["model.name"] == "vit_tiny6_patch7" and run.data.params["train.batch_size"] == "16"
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    assert run.data.metrics["summary/final_top1"] == summary["final_top1"]

    history, config, wandb_summary = _wandb_run(folder)
    assert {step: row["train/loss"] for step, row in history.items() if "train/loss" in row} == losses
    assert {step: row["eval/top1"] for step, row in history.items() if "eval/top1" in row} == top1
    assert config["model.name"] == "vit_tiny6_patch7" and config["train.batch_size"] == 16
    assert wandb_summary["final_top1"] == summary["final_top1"] and wandb_summary["model"] == "vit_tiny6_patch7"

    assert {int(row["step"]): float(row["loss"]) for row in _csv_rows(folder, "train")} == losses
    assert {int(row["step"]): float(row["top1"]) for row in _csv_rows(folder, "eval")} == top1
    assert float(_csv_rows(folder, "summary")[0]["final_top1"]) == summary["final_top1"]


@needs_tools
def test_a_resumed_run_continues_each_sink_without_repeated_steps(finished_run, tmp_path, monkeypatch):
    finished, overrides, _ = finished_run
    folder = tmp_path / "run"
    shutil.copytree(finished, folder)
    (folder / "checkpoints" / "step-000000012.pt").unlink()  # as if it crashed before the final checkpoint
    run_ids = {tool: (folder / f"{tool}_run_id").read_text() for tool in ("mlflow", "wandb")}
    _tool_environment(monkeypatch, tmp_path)
    plan = make_plan(make_config(*overrides, f"train.out_dir={folder}"))
    train(plan, resume=str(folder / "checkpoints" / "step-000000006.pt"))

    losses, top1 = _jsonl_values(folder, "train", "loss"), _jsonl_values(folder, "eval", "top1")
    assert sorted(losses) == [2, 4, 6, 8, 10, 12]
    steps = [step for step, _ in _tensorboard_scalars(folder, "train/loss")]
    assert steps == sorted(set(steps)) == sorted(losses)
    assert dict(_tensorboard_scalars(folder, "train/loss")) == pytest.approx(losses, rel=1e-6)
    train_rows = _csv_rows(folder, "train")
    assert [int(row["step"]) for row in train_rows] == sorted(losses)
    assert {int(row["step"]): float(row["loss"]) for row in train_rows} == losses
    assert [int(row["step"]) for row in _csv_rows(folder, "eval")] == sorted(top1)

    assert {tool: (folder / f"{tool}_run_id").read_text() for tool in run_ids} == run_ids
    client, run_id = _mlflow(folder)
    assert len(client.search_runs([client.get_run(run_id).info.experiment_id])) == 1  # the same run, continued
    assert {m.step: m.value for m in client.get_metric_history(run_id, "eval/top1")} == top1
    offline_runs = sorted(folder.glob("wandb/offline-run-*"))
    assert len(offline_runs) == 2 and all(path.name.endswith(run_ids["wandb"]) for path in offline_runs)
    import wandb

    wandb.teardown()


@pytest.mark.parametrize("sink", TOOLS)
def test_a_sink_without_its_package_is_a_config_error_naming_the_extra(sink, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == sink else real_find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=rf"log.sinks: {sink} .*pip install 'vitrain\[{sink}\]'"):
        make_plan(make_config(*SMALL_SYNTHETIC_RUN, f"log.sinks=[{sink}, csv]"))


class _RecordingSink:
    """Keeps what it is handed; ``fail_at`` (a method name) raises on that method's second call."""

    def __init__(self, name: str, fail_at: str | None = None):
        self.name, self.fail_at = name, fail_at
        self.calls: list[tuple[str, dict]] = []

    def _call(self, method: str, payload: dict) -> None:
        self.calls.append((method, payload))
        if method == self.fail_at and sum(name == method for name, _ in self.calls) == 2:
            raise ConnectionError("tracking server unreachable")

    def write(self, record):
        self._call("write", record)

    def log_config(self, config):
        self._call("log_config", config)

    def log_summary(self, summary):
        self._call("log_summary", summary)

    def close(self):
        self._call("close", {})


def _refuse_to_start(plan, out_dir, resume_step):
    raise ConnectionError("tracking server unreachable")


def test_a_failing_sink_is_dropped_with_one_warning_and_the_run_completes(tmp_path, monkeypatch, caplog):
    failing, recording = _RecordingSink("failing", fail_at="write"), _RecordingSink("recording")
    monkeypatch.setitem(sinks_module.SINK_BUILDERS, "failing", lambda *arguments: failing)
    monkeypatch.setitem(sinks_module.SINK_BUILDERS, "recording", lambda *arguments: recording)
    monkeypatch.setitem(sinks_module.SINK_BUILDERS, "unreachable", _refuse_to_start)
    plan = make_plan(make_config(*SMALL_SYNTHETIC_RUN, "train.epochs=1", f"train.out_dir={tmp_path / 'run'}"))
    plan = dataclasses.replace(plan, log=LogPlan(sinks=("unreachable", "failing", "recording")))
    with caplog.at_level(logging.WARNING, logger="vitrain"):
        summary = train(plan)

    assert summary["steps"] == 6
    warnings = [record.getMessage() for record in caplog.records if "metrics sink" in record.getMessage()]
    assert len(warnings) == 2, warnings
    assert "sink unreachable failed at start" in warnings[0] and "sink failing failed at write" in warnings[1]
    assert [method for method, _ in failing.calls] == ["log_config", "write", "write"]  # nothing after it failed
    records = read_jsonl(plan.out_dir / "metrics.jsonl")
    assert [payload for method, payload in recording.calls if method == "write"] == records
    assert [method for method, _ in recording.calls][-2:] == ["log_summary", "close"]
    assert recording.calls[0][0] == "log_config" and recording.calls[0][1]["model.name"] == "vit_tiny6_patch7"


def test_csv_tables_widen_for_a_new_field_and_drop_rows_after_the_resume_step(tmp_path):
    sink = CsvSink(tmp_path, resume_step=0)
    sink.write({"event": "train", "step": 2, "loss": 1.5, "note": None})
    sink.write({"event": "train", "step": 4, "loss": 1.25, "note": "text", "mfu": 0.3})
    sink.write({"event": "train", "step": 6, "loss": 1.0, "shapes": [[6, 14]]})
    rows = _csv_rows(tmp_path, "train")
    assert list(rows[0]) == ["event", "step", "loss", "note", "mfu", "shapes"]
    assert [(row["loss"], row["note"], row["mfu"], row["shapes"]) for row in rows] == [
        ("1.5", "", "", ""),
        ("1.25", "text", "0.3", ""),
        ("1.0", "", "", "[[6, 14]]"),
    ]
    CsvSink(tmp_path, resume_step=4).write({"event": "train", "step": 6, "loss": 0.5})
    assert [(row["step"], row["loss"]) for row in _csv_rows(tmp_path, "train")] == [
        ("2", "1.5"),
        ("4", "1.25"),
        ("6", "0.5"),
    ]
