"""``vitrain doctor``: what this machine can do for vitrain, one PASS / WARN / FAIL line per check.

Checks are plain functions ``(Context) -> list[Check]`` listed in :data:`CHECKS` per section; a check
that raises becomes a FAIL line naming the error, so one broken probe never hides the others.
The lines, their values and the JSON fields are described in docs/doctor.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vitrain.doctor import cpu, environment, gpu
from vitrain.doctor.report import Check, Context, Report, format_report

CheckFn = Callable[[Context], list[Check]]
CHECKS: list[tuple[str, CheckFn]] = [
    *((cpu.SECTION, check) for check in cpu.CHECKS),
    *((gpu.SECTION, check) for check in gpu.CHECKS),
    *((environment.SECTION, check) for check in environment.CHECKS),
]
"""(section, check) in report order; a test or a plugin may extend or patch this list."""

DEVICES = ("auto", "cpu", "cuda")


def _run_check(section: str, check: CheckFn, context: Context) -> list[Check]:
    try:
        return list(check(context))
    except Exception as error:  # noqa: BLE001 - reported as a line, never a crash
        message = str(error).strip().splitlines()
        value = f"check crashed: {type(error).__name__}: {message[0] if message else ''}"
        fix = f"a bug or an odd machine: please report this line ({check.__module__}.{check.__name__})"
        return [Check(section, getattr(check, "__name__", "check"), "FAIL", value, fix, {"error": str(error)})]


def run_doctor(
    config=None,
    device: str = "auto",
    out: Path | str | None = None,
    checks: list[tuple[str, CheckFn]] | None = None,
) -> Report:
    """Run every check (default :data:`CHECKS`) for ``config`` (default: the default recipe), the
    device the user means to train on (auto, cpu or cuda) and the folder runs go to (default: the
    config's ``train.out_dir`` root)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {device!r}")
    if config is None:
        from vitrain.recipes import DEFAULT_RECIPE, get_recipe

        config = get_recipe(DEFAULT_RECIPE)
    context = Context(config=config, device=device, out=Path(out) if out is not None else None)
    lines: list[Check] = []
    for section, check in CHECKS if checks is None else checks:
        lines += _run_check(section, check, context)
    return Report(lines)


__all__ = ["CHECKS", "Check", "CheckFn", "Context", "Report", "format_report", "run_doctor"]
