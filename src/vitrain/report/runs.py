"""``vitrain plot``: the learning curves of one or several runs in one figure, read from their metrics.jsonl.

Panels: test top-1 against training seconds and against images seen (EMA weights dashed, where recorded),
evaluation loss, training loss, learning rate, img/s, MFU (where the metrics carry it) and the fraction of
training time spent waiting for data, all against training seconds (evaluation and checkpoints excluded:
the clock of ``train.budget``). Several runs are overlaid, each with its name. PNG and SVG come from
matplotlib; HTML is a page holding the SVG and a table of each run's summary figures.
"""

from __future__ import annotations

import html
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitrain.config import ConfigError
from vitrain.metrics import read_jsonl
from vitrain.report.plots import pyplot

FORMATS = (".png", ".svg", ".html")
SUMMARY_FIELDS = ("final_top1", "best_top1", "final_ema_top1", "epochs", "train_s", "mean_img_s")


@dataclass
class RunCurves:
    """What the figure needs of one run folder."""

    name: str
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, folder: Path, name: str | None = None) -> RunCurves:
        """The run in ``folder``; a folder without ``metrics.jsonl`` is a ConfigError."""
        metrics = Path(folder) / "metrics.jsonl"
        if not metrics.is_file():
            raise ConfigError(
                f"{folder} is not a run folder (no metrics.jsonl); give the folder `vitrain train` wrote "
                "(train.out_dir)"
            )
        records = read_jsonl(metrics)
        summary_path = Path(folder) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        return cls(
            name=name or Path(folder).name,
            train=[record for record in records if record.get("event") == "train"],
            evals=[record for record in records if record.get("event") == "eval"],
            summary=summary,
        )

    def images_per_epoch(self) -> float | None:
        """Training images per epoch (from the summary), to turn epochs into images seen."""
        epochs, images = self.summary.get("epochs"), self.summary.get("images_seen")
        return images / epochs if epochs and images else None


def _series(records: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    points = [(record[x], record[y]) for record in records if record.get(x) is not None and record.get(y) is not None]
    return [point[0] for point in points], [point[1] for point in points]


PANELS = (
    ("evals", "train_s", "top1", "test top-1 (%)"),
    ("evals", "images", "top1", "test top-1 (%)"),
    ("evals", "train_s", "loss", "test loss"),
    ("train", "train_s", "loss", "training loss"),
    ("train", "train_s", "lr", "learning rate"),
    ("train", "train_s", "img_s", "img/s"),
    ("train", "train_s", "mfu", "MFU"),
    ("train", "train_s", "data_wait_frac", "data wait (fraction of time)"),
)
"""(records, x, y, y label) of each panel; x ``images`` is images seen (epochs where the count is unknown)."""


def _plot_panel(axes, runs: list[RunCurves], panel: tuple[str, str, str, str]) -> None:
    kind, x, y, label = panel
    if not any(_series(getattr(run, kind), x if x != "images" else "epoch", y)[1] for run in runs):
        axes.text(0.5, 0.5, f"no {y} in these runs' metrics", ha="center", va="center", transform=axes.transAxes)
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        records = getattr(run, kind)
        per_epoch = run.images_per_epoch() if x == "images" else None
        xs, ys = _series(records, "epoch" if x == "images" else x, y)
        if per_epoch:
            xs = [epoch * per_epoch for epoch in xs]
        axes.plot(xs, ys, color=color, marker="o" if kind == "evals" else None, markersize=3, label=run.name)
        if kind == "evals" and y == "top1":
            ema_xs, ema_ys = _series(records, "epoch" if x == "images" else x, "ema_top1")
            if per_epoch:
                ema_xs = [epoch * per_epoch for epoch in ema_xs]
            if ema_ys:
                axes.plot(ema_xs, ema_ys, color=color, linestyle="--", label=f"{run.name} (EMA weights)")
    known = x != "images" or all(run.images_per_epoch() for run in runs)
    xlabel = {"train_s": "training seconds", "images": "images seen" if known else "epochs"}[x]
    axes.set(xlabel=xlabel, ylabel=label)
    if y == "lr":
        axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    axes.grid(alpha=0.3)


def figure_of(runs: list[RunCurves]):
    """The matplotlib figure of ``runs`` (a ConfigError when matplotlib is not installed)."""
    plt = pyplot()
    if plt is None:
        raise ConfigError("vitrain plot needs matplotlib: pip install 'vitrain[plot]' (or matplotlib)")
    figure, grid = plt.subplots(2, 4, figsize=(18, 8))
    for axes, panel in zip(grid.flat, PANELS, strict=True):
        _plot_panel(axes, runs, panel)
    handles, labels = grid.flat[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="upper center", ncol=min(len(labels), 6), fontsize=9)
    figure.tight_layout(rect=(0, 0, 1, 0.93))
    return figure


def _html_page(runs: list[RunCurves], svg: str) -> str:
    header = "".join(f"<th>{html.escape(name)}</th>" for name in ("run", *SUMMARY_FIELDS))
    rows = "".join(
        "<tr>"
        + f"<td>{html.escape(run.name)}</td>"
        + "".join(f"<td>{_cell(run.summary.get(key))}</td>" for key in SUMMARY_FIELDS)
        + "</tr>"
        for run in runs
    )
    title = html.escape(", ".join(run.name for run in runs))
    return (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>vitrain: {title}</title></head><body>\n"
        f"<h1>{title}</h1>\n<table border='1' cellpadding='4'><tr>{header}</tr>{rows}</table>\n{svg}\n</body></html>\n"
    )


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else html.escape(str(value))


def plot_runs(folders: list[Path], out: Path, names: list[str] | None = None) -> Path:
    """Draw the runs in ``folders`` (named ``names``, default their folder names) into ``out`` (.png, .svg or .html)."""
    out = Path(out)
    if out.suffix.lower() not in FORMATS:
        raise ConfigError(f"--out {out}: write a {', '.join(FORMATS)} file")
    if names is not None and len(names) != len(folders):
        raise ConfigError(f"{len(folders)} runs but {len(names)} names in --names; give one per run or none")
    runs = [RunCurves.read(folder, name) for folder, name in zip(folders, names or [None] * len(folders), strict=True)]
    if not any(run.train or run.evals for run in runs):
        raise ConfigError(f"no training or evaluation records in {', '.join(map(str, folders))}: nothing to plot")
    figure = figure_of(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() == ".html":
        buffer = io.StringIO()
        figure.savefig(buffer, format="svg")
        out.write_text(_html_page(runs, buffer.getvalue()[buffer.getvalue().find("<svg") :]))
    else:
        figure.savefig(out, dpi=110)
    pyplot().close(figure)
    return out
