"""JSONL metric records and the environment facts every record set carries."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from vitrain import cpu_features


class JsonlWriter:
    """Appends one JSON object per line, flushed at once so a crash loses at most a line."""

    def __init__(self, path: Path, truncate_after_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if truncate_after_step is not None and self.path.exists():
            # A resumed run repeats the steps after its checkpoint; drop their stale lines.
            kept = [record for record in read_jsonl(self.path) if record.get("step", 0) <= truncate_after_step]
            # a new file renamed over the old: a crash here must not lose the records of the run so far
            temporary = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
            temporary.write_text("".join(json.dumps(record) + "\n" for record in kept))
            os.replace(temporary, self.path)
        self.handle = open(self.path, "a", buffering=1)  # noqa: SIM115 (closed by close())

    def write(self, record: dict[str, Any]) -> None:
        self.handle.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.handle.close()


class NullWriter:
    """The metrics writer of ranks other than 0: rank 0 writes the run's records."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def log_config(self, config: dict[str, Any]) -> None:
        pass

    def log_summary(self, summary: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
    return records


def _git_revision() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None


def run_environment(device: str) -> dict[str, Any]:
    """Facts that make a record reproducible: versions, revision, device and CPU."""
    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_revision": _git_revision(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_features.cpu_model(),
        "cpu_bf16": cpu_features.bf16_state(),
        "cpu_key": cpu_features.cpu_key(),
        "cpu_threads": torch.get_num_threads(),
    }
    if device.startswith("cuda"):
        facts["device_name"] = torch.cuda.get_device_name(torch.device(device))
    else:
        facts["device_name"] = f"CPU ({torch.backends.cpu.get_cpu_capability()})"
    return facts
