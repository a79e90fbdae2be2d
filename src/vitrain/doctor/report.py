"""The doctor's report: one :class:`Check` per line, grouped by section, as a table or as JSON."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

Status = Literal["PASS", "WARN", "FAIL"]
STATUSES: tuple[Status, ...] = ("PASS", "WARN", "FAIL")


@dataclasses.dataclass
class Check:
    """One line of the report."""

    section: str
    """CPU, GPU or Environment."""
    name: str
    """What was checked (``model``, ``gpu0 sdpa``, ``/dev/shm``...)."""
    status: Status
    value: str
    """What was found, for a reader."""
    fix: str = ""
    """What to do about it; empty on PASS lines."""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The same facts as numbers and names, for programs (keys per check: docs/doctor.md)."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {self.status!r}")


@dataclasses.dataclass
class Report:
    checks: list[Check]

    @property
    def status(self) -> Status:
        """The worst status of any line."""
        return max((check.status for check in self.checks), key=STATUSES.index, default="PASS")

    @property
    def exit_code(self) -> int:
        """1 when a line failed, else 0 (warnings included)."""
        return 1 if self.status == "FAIL" else 0

    def sections(self) -> dict[str, list[Check]]:
        grouped: dict[str, list[Check]] = {}
        for check in self.checks:
            grouped.setdefault(check.section, []).append(check)
        return grouped

    def find(self, section: str, name: str) -> Check | None:
        return next((c for c in self.checks if c.section == section and c.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        counts = {status: sum(check.status == status for check in self.checks) for status in STATUSES}
        return {
            "status": self.status,
            "exit_code": self.exit_code,
            "counts": counts,
            "checks": [dataclasses.asdict(check) for check in self.checks],
        }


def format_report(report: Report) -> str:
    """An aligned table, one block per section; a fix goes on its own line under its check."""
    width = max((len(check.name) for check in report.checks), default=0)
    lines: list[str] = []
    for section, checks in report.sections().items():
        lines.append(section)
        for check in checks:
            lines.append(f"  {check.status}  {check.name:<{width}}  {check.value}")
            if check.fix:
                lines.append(f"  {'':4}  {'':<{width}}  fix: {check.fix}")
        lines.append("")
    counts = report.to_dict()["counts"]
    lines.append(f"{report.status}: {counts['PASS']} pass, {counts['WARN']} warn, {counts['FAIL']} fail")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Context:
    """What the checks are asked about: the config whose data and run folder are checked, the device
    the user means to train on (auto, cpu, cuda) and the output folder (None: the config's run root)."""

    config: Any
    device: Literal["auto", "cpu", "cuda"] = "auto"
    out: Any = None
