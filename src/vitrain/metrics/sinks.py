"""Metric sinks: a run's records in the tools users already watch runs in.

``metrics.jsonl`` stays the source of truth; :class:`MetricsSinks` writes every record there and hands
the same record to each sink of ``log.sinks``: TensorBoard, MLflow, Weights & Biases, CSV files. Every
sink has ``write(record)``, ``log_config(flat config)``, ``log_summary(summary)`` and ``close()``.
Numeric fields go as ``<event>/<field>`` (``train/loss``, ``eval/top1``) at the record's step. A sink
that fails (a tracking server down, a full disk) is dropped with one warning: training never stops
because of a sink. A resumed run continues each sink's run from the checkpoint's step.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from vitrain.config import LogPlan
from vitrain.io import write_file_atomic
from vitrain.metrics.records import JsonlWriter

log = logging.getLogger("vitrain")


class MetricSink(Protocol):
    """One tool the run's records go to besides metrics.jsonl."""

    name: str

    def write(self, record: dict[str, Any]) -> None: ...

    def log_config(self, config: dict[str, Any]) -> None: ...

    def log_summary(self, summary: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def numeric_fields(record: dict[str, Any]) -> dict[str, float]:
    """A record's finite numbers named ``<event>/<field>`` (``train/loss``); its step, text, None and
    non-finite values left out."""
    return {
        f"{record['event']}/{key}": float(value)
        for key, value in record.items()
        if key not in ("event", "step") and _is_number(value) and math.isfinite(value)
    }


def _is_number(value: Any) -> bool:
    """An int or float (a bool is neither here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"name": ...}}`` -> ``{"model.name": ...}``; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def as_scalar_or_text(value: Any) -> bool | int | float | str:
    """A config value as a tool's parameter takes it: numbers, booleans and text as they are, anything
    else (lists, null) as JSON text."""
    return value if isinstance(value, (bool, int, float, str)) else json.dumps(value)


class TensorBoardSink:
    """Event files in the run folder's ``tb/`` (``tensorboard --logdir <run folder>/tb``): scalars per
    step, the config as hyperparameters (the HParams tab, with eval/top1 as its metric), the summary's
    numbers as ``summary/<field>``. A resumed run purges the steps after its checkpoint."""

    name = "tensorboard"

    def __init__(self, folder: Path, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        purge_step = resume_step + 1 if folder.exists() else None  # TensorBoard hides events from purge_step on
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge_step, flush_secs=10)

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in numeric_fields(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def log_config(self, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        values = {key: as_scalar_or_text(value) for key, value in config.items()}
        for event in hparams(values, {"eval/top1": None, "eval/loss": None}):
            self.writer.file_writer.add_summary(event)

    def log_summary(self, summary: dict[str, Any]) -> None:
        for key, value in summary.items():
            if _is_number(value):
                self.writer.add_scalar(f"summary/{key}", value, summary.get("steps", 0))

    def close(self) -> None:
        self.writer.close()


def _run_id_file(out_dir: Path, tool: str) -> Path:
    """Where the run folder keeps its run's id in ``tool``, so a resumed run continues that run."""
    return out_dir / f"{tool}_run_id"


def _stored_run_id(out_dir: Path, tool: str, resume_step: int) -> str | None:
    """The id a resumed run continues (None: a new run, at step 0 or without a stored id)."""
    path = _run_id_file(out_dir, tool)
    if resume_step == 0 or not path.is_file():
        return None
    return path.read_text().strip() or None


def _is_local_file_store(uri: str) -> bool:
    """A path or ``file:`` URI: MLflow's file store, not a server or database."""
    return uri.startswith("file:") or "://" not in uri


class MlflowSink:
    """One MLflow run: the config as params, numbers per step as metrics, the summary's numbers as
    ``summary/<field>``; its status at close: FINISHED, KILLED (preempted) or FAILED (no summary).
    Its id is kept in the run folder's ``mlflow_run_id``; a resumed run logs into the same run."""

    name = "mlflow"

    def __init__(self, plan: LogPlan, out_dir: Path, resume_step: int):
        uri = plan.mlflow_tracking_uri or (out_dir / "mlruns").resolve().as_uri()
        if _is_local_file_store(uri):
            # MLflow 3 refuses its file store unless asked; the client without a server needs it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.status = "FAILED"
        self.run_id = _stored_run_id(out_dir, "mlflow", resume_step)
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(plan.mlflow_experiment)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(plan.mlflow_experiment)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=plan.name_of(out_dir)).info.run_id
        write_file_atomic(_run_id_file(out_dir, "mlflow"), self.run_id.encode())

    def _log_metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        metrics = [Metric(key, value, timestamp, step) for key, value in values.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def write(self, record: dict[str, Any]) -> None:
        self._log_metrics(numeric_fields(record), record["step"])

    def log_config(self, config: dict[str, Any]) -> None:
        """Params are write-once in MLflow: a resumed run adds the keys its run lacks and names the
        values that changed since (they stay as first logged)."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        logged = self.client.get_run(self.run_id).data.params
        values = {key: str(as_scalar_or_text(value))[:MAX_PARAM_VAL_LENGTH] for key, value in config.items()}
        changed = sorted(key for key, value in values.items() if key in logged and logged[key] != value)
        if changed:
            log.info("mlflow: params keep their first values; changed since: %s", ", ".join(changed))
        params = [Param(key, value) for key, value in values.items() if key not in logged]
        if params:
            self.client.log_batch(self.run_id, params=params)

    def log_summary(self, summary: dict[str, Any]) -> None:
        values = {f"summary/{key}": float(value) for key, value in summary.items() if _is_number(value)}
        self._log_metrics(values, summary.get("steps", 0))
        self.status = "KILLED" if summary.get("preempted") else "FINISHED"

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status=self.status)


class WandbSink:
    """One Weights & Biases run (``log.wandb_mode``: offline into the run folder's ``wandb/``, or
    online): numbers per step, the config, the summary. Its id is kept in the run folder's
    ``wandb_run_id``; a resumed run continues it (``resume="allow"``)."""

    name = "wandb"

    def __init__(self, plan: LogPlan, out_dir: Path, resume_step: int):
        import wandb

        self.run = wandb.init(
            project=plan.wandb_project,
            name=plan.name_of(out_dir),
            id=_stored_run_id(out_dir, "wandb", resume_step),  # None: W&B makes a new id
            resume="allow",
            mode=plan.wandb_mode,
            dir=None if "WANDB_DIR" in os.environ else str(out_dir),
            settings=wandb.Settings(console="off"),  # the run's own log and progress bar stay untouched
        )
        write_file_atomic(_run_id_file(out_dir, "wandb"), self.run.id.encode())
        self.exit_code = 1

    def write(self, record: dict[str, Any]) -> None:
        values = numeric_fields(record)
        if values:
            self.run.log(values, step=record["step"])

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_summary(self, summary: dict[str, Any]) -> None:
        """Numbers and text (W&B's summary keeps both)."""
        self.run.summary.update(
            {key: value for key, value in summary.items() if _is_number(value) or isinstance(value, str)}
        )
        self.exit_code = 0

    def close(self) -> None:
        self.run.finish(exit_code=self.exit_code)


def _csv_cell(value: Any) -> Any:
    """A record's value as a spreadsheet cell: null empty, lists and dicts as JSON."""
    return "" if value is None else json.dumps(value) if isinstance(value, (dict, list)) else value


def _write_csv(path: Path, fields: list[str], rows: list[dict[str, Any]]) -> None:
    """Write a whole table, replacing ``path`` at once (a crash leaves the old table or the new one)."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows({key: _csv_cell(value) for key, value in row.items()} for row in rows)
    write_file_atomic(path, text.getvalue().encode())


class CsvSink:
    """One table per record kind in the run folder, for spreadsheets: ``metrics-train.csv`` (a row per
    logged window), ``metrics-eval.csv`` (a row per evaluation), ``metrics-stage.csv``, ... with every
    field of the records, text included, and ``metrics-summary.csv`` (one row) at the end. A resumed run
    drops the rows after its checkpoint's step, as metrics.jsonl does."""

    name = "csv"

    def __init__(self, folder: Path, resume_step: int):
        self.folder = folder
        self.fields: dict[str, list[str]] = {}
        for path in folder.glob("metrics-*.csv"):
            header, rows = self._read(path)
            kept = [row for row in rows if not row.get("step") or float(row["step"]) <= resume_step]
            _write_csv(path, header, kept)
            self.fields[path.stem.removeprefix("metrics-")] = header

    @staticmethod
    def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            return list(reader.fieldnames or []), list(reader)

    def write(self, record: dict[str, Any]) -> None:
        event = record["event"]
        path = self.folder / f"metrics-{event}.csv"
        fields = self.fields.get(event)
        if fields is None or not set(record) <= set(fields):
            # a first record, or one with a new field: the table is written again with the wider header
            rows = self._read(path)[1] if fields is not None else []
            self.fields[event] = fields = [*(fields or []), *(key for key in record if key not in (fields or []))]
            _write_csv(path, fields, [*rows, record])
            return
        with open(path, "a", newline="") as handle:
            csv.DictWriter(handle, fields).writerow({key: _csv_cell(value) for key, value in record.items()})

    def log_config(self, config: dict[str, Any]) -> None:
        """Nothing: the run folder's config.yaml holds the config."""

    def log_summary(self, summary: dict[str, Any]) -> None:
        _write_csv(self.folder / "metrics-summary.csv", list(summary), [summary])

    def close(self) -> None:
        """Nothing: every row is written when it comes."""


SINK_BUILDERS: dict[str, Callable[[LogPlan, Path, int], MetricSink]] = {
    "tensorboard": lambda plan, out_dir, resume_step: TensorBoardSink(out_dir / "tb", resume_step),
    "mlflow": MlflowSink,
    "wandb": WandbSink,
    "csv": lambda plan, out_dir, resume_step: CsvSink(out_dir, resume_step),
}
"""How each sink of ``log.sinks`` is made from the log plan, the run folder and the step the run starts at."""


class MetricsSinks:
    """The metrics writer of rank 0: metrics.jsonl and the sinks of ``log.sinks``, fed the same records.
    A JSONL failure stops the run as before; a sink that fails is dropped with one warning."""

    def __init__(self, jsonl: JsonlWriter, sinks: list[MetricSink]):
        self.jsonl, self.sinks = jsonl, list(sinks)

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(record)
        self._each("write", record)

    def log_config(self, config: dict[str, Any]) -> None:
        """The run's config (nested, as ``Config.model_dump``) flattened to ``model.name``-style keys."""
        self._each("log_config", flatten_config(config))

    def log_summary(self, summary: dict[str, Any]) -> None:
        self._each("log_summary", summary)

    def close(self) -> None:
        self.jsonl.close()
        self._each("close")
        self.sinks = []

    def _each(self, method: str, *arguments: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*arguments)
            except Exception as error:  # a sink must never stop training, whatever it raises
                self.sinks.remove(sink)
                _warn_dropped(sink.name, method, error)


def _warn_dropped(name: str, action: str, error: Exception) -> None:
    log.warning(
        "metrics sink %s failed at %s (%s: %s); it is dropped for the rest of the run, which goes on; "
        "metrics.jsonl keeps every record",
        name,
        action,
        type(error).__name__,
        error,
    )


def build_metrics_sinks(plan: LogPlan, out_dir: Path, resume_step: int) -> MetricsSinks:
    """metrics.jsonl in ``out_dir`` (records after ``resume_step`` dropped) and the sinks of ``plan``, each
    continuing from ``resume_step`` (0: a new run); a sink that cannot start is left out with a warning."""
    jsonl = JsonlWriter(out_dir / "metrics.jsonl", truncate_after_step=resume_step)
    sinks = []
    for name in plan.sinks:
        try:
            sinks.append(SINK_BUILDERS[name](plan, out_dir, resume_step))
        except Exception as error:  # a tracking server down at the start must not stop the run either
            _warn_dropped(name, "start", error)
    return MetricsSinks(jsonl, sinks)
