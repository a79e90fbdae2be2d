"""The cumulative ablation ladder of pycls's "faster ViT training" chart (Meta AI, 2022): each rung keeps
the previous rungs' settings and adds one technique; throughput is reported relative to the first.

fp32 baseline (for-loop optimizer, SDPA, eager, autocast) -> + low precision (bf16/fp16 autocast)
-> + fused optimizer -> + attention choice (SDPA and the explicit matmul path measured, on CUDA also SDPA
pinned to each of its kernels; the fastest kept) -> + torch.compile (kept for the next rungs only if it measured faster than the rung
before) -> + O2 weights -> + activation checkpointing on
every block (a memory rung: it trades speed for activation memory).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vitrain.bench.throughput import BenchSettings, measure_training_step
from vitrain.config import Plan
from vitrain.report import pyplot

log = logging.getLogger("vitrain")

NOT_KEPT = "not kept: slower than the rung before"

PlanFor = Callable[[list[str]], Plan]
"""Builds the benchmark plan for extra ``--set`` overrides (the bench flags and recipe underneath)."""


@dataclasses.dataclass(frozen=True)
class Rung:
    name: str
    overrides: tuple[str, ...] = ()
    compile: bool = False
    alternatives: tuple[tuple[str, ...], ...] = ()
    """Settings measured side by side at this rung; the fastest is kept for the next rungs."""
    keep_if_faster: bool = False
    """Carried to the next rungs only if this rung measured faster than the one before."""


def ladder_rungs(precision: str, attention: tuple[str, ...], with_compile: bool) -> list[Rung]:
    """The rungs for ``precision``; ``attention``: the ``model.attn_impl`` values the attention rung measures
    side by side (none: no such rung, for models without attention)."""
    low = precision if precision != "fp32" else "bf16"
    rungs = [
        Rung("fp32 baseline", ("precision=fp32", "precision_mode=autocast", "optim.implementation=for-loop")),
        Rung(f"+ {low} autocast", (f"precision={low}",)),
        Rung("+ fused optimizer", ("optim.implementation=fused",)),
    ]
    if attention:
        choices = tuple((f"model.attn_impl={impl}",) for impl in attention)
        rungs.append(Rung("+ attention choice", alternatives=choices))
    if with_compile:
        rungs.append(Rung("+ torch.compile", compile=True, keep_if_faster=True))
    rungs.append(Rung(f"+ {low} O2 weights", ("precision_mode=o2",)))
    rungs.append(Rung("+ activation checkpointing (memory)", ("performance.activation_checkpointing=all",)))
    return rungs


def _measure_alternatives(
    plan_for: PlanFor, kept: list[str], rung: Rung, settings: BenchSettings
) -> tuple[list[tuple[tuple[str, ...], dict[str, Any]]], dict[str, str]]:
    """Each alternative of ``rung`` (or its one setting) measured on top of ``kept``: the records, and
    the reason of each that could not run (one pinned attention kernel this GPU lacks leaves the others)."""
    measured, failed = [], {}
    for extra in rung.alternatives or ((),):
        log.info("ladder rung '%s' %s", rung.name, " ".join(extra))
        # each measurement compiles afresh: graphs an earlier rung left for the same block code are not
        # its own, and its compile time is measured whole
        torch._dynamo.reset()
        try:
            measured.append((extra, measure_training_step(plan_for([*kept, *extra]), settings)))
        except Exception as error:  # noqa: BLE001  (reported in the record, not fatal)
            reason = f"{type(error).__name__}: {error}".splitlines()[0]
            log.warning("ladder rung '%s' %s: %s", rung.name, " ".join(extra) or "skipped", reason)
            failed[" ".join(extra) or rung.name] = reason
    return measured, failed


def run_ladder(plan_for: PlanFor, settings: BenchSettings, rungs: list[Rung]) -> dict[str, Any]:
    """Measure every rung cumulatively; return the records with throughput and memory relative to the first."""
    kept: list[str] = []
    compile_on = False
    rows, skipped = [], []
    for rung in rungs:
        kept += rung.overrides
        compile_on = compile_on or rung.compile
        rung_settings = dataclasses.replace(settings, compile=compile_on, warmup=max(settings.warmup, compile_on))
        measured, failed = _measure_alternatives(plan_for, kept, rung, rung_settings)
        if not measured:  # a rung this model or device cannot take is reported, not fatal
            kept = kept[: len(kept) - len(rung.overrides)]
            compile_on = compile_on and not rung.compile
            skipped.append({"rung": rung.name, "reason": next(iter(failed.values()))})
            continue
        extra, record = max(measured, key=lambda pair: pair[1]["img_s_median"])
        kept += extra
        settings_measured = list(kept) + (["--compile"] if compile_on else [])
        chosen = " ".join(extra) or None
        if rung.keep_if_faster and rows and record["img_s_median"] < rows[-1]["img_s_median"]:
            kept = kept[: len(kept) - len(rung.overrides) - len(extra)]
            compile_on = compile_on and not rung.compile
            chosen = NOT_KEPT
        rows.append(
            {
                "rung": rung.name,
                "settings": settings_measured,
                "chosen": chosen,
                "alternatives": {" ".join(e): r["img_s_median"] for e, r in measured} if rung.alternatives else None,
                **({"failed": failed} if failed else {}),
                **record,
            }
        )
    baseline = rows[0]
    for row in rows:
        row["speedup"] = row["img_s_median"] / baseline["img_s_median"]
        memory, base_memory = row.get("peak_memory_bytes"), baseline.get("peak_memory_bytes")
        row["memory_ratio"] = memory / base_memory if memory and base_memory else None
    return {"rungs": rows, "skipped": skipped}


def format_ladder(result: dict[str, Any]) -> str:
    lines = [f"{'rung':40s} {'img/s':>9s} {'x fp32':>7s} {'MFU':>7s} {'peak MiB':>9s}  chosen"]
    for row in result["rungs"]:
        mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "-"
        memory = f"{row['peak_memory_bytes'] / 2**20:.0f}" if row.get("peak_memory_bytes") else "-"
        chosen = row["chosen"] or ""
        if row["alternatives"]:
            chosen += " (" + ", ".join(f"{name}: {rate:.1f}" for name, rate in row["alternatives"].items()) + ")"
        lines.append(
            f"{row['rung']:40s} {row['img_s_median']:9.1f} {row['speedup']:7.2f} {mfu:>7s} {memory:>9s}  {chosen}"
        )
    lines += [f"skipped: {row['rung']}: {row['reason']}" for row in result["skipped"]]
    return "\n".join(lines)


def plot_ladder(result: dict[str, Any], path: Path, title: str) -> bool:
    """A bar chart of the speed-up per rung (PNG); False when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    rows = result["rungs"]
    figure, axes = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    names = [row["rung"] + (" (not kept)" if row["chosen"] == NOT_KEPT else "") for row in rows][::-1]
    speedups = [row["speedup"] for row in rows][::-1]
    bars = axes.barh(names, speedups, color="tab:blue")
    for bar, value in zip(bars, speedups, strict=True):
        axes.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.2f}x", va="center")
    axes.set_xlabel("training throughput relative to the fp32 baseline")
    axes.set_title(title)
    axes.set_xlim(0, max(speedups) * 1.2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return True
