"""The forecast as a table, a JSON record and a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitrain.report import pyplot


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    minutes, second = divmod(round(seconds), 60)
    hours, minute = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minute:02d} min"
    return f"{minute} min {second:02d} s" if minute else f"{second} s"


def format_forecast(result: dict[str, Any]) -> str:
    inputs = result["inputs"]
    lines = [
        f"forecast: {inputs['model']} at {inputs['image_size']} px, {inputs['layout']}, on {inputs['network']}",
        f"from: {inputs['measured']}",
    ]
    if inputs.get("data"):
        lines.append(f"data: {inputs['data']}")
    epochs = inputs.get("epochs")
    header = "| devices | nodes | global batch | img/s | img/s/device | efficiency | step ms | exposed comm ms "
    header += "| wire MB/step | memory GiB | fits | storage GB/s | IOPS | epoch | "
    header += f"{epochs:g} epochs | limit |" if epochs else "limit |"
    lines += ["", header, "|" + "---|" * (header.count("|") - 1)]
    for row in result["rows"]:
        memory = row["memory_bytes"]
        cells = [
            row["devices"],
            row["nodes"],
            row["global_batch"],
            f"{row['img_s']:.0f}",
            f"{row['img_s_per_device']:.1f}",
            f"{100 * row['efficiency']:.0f} %",
            f"{1e3 * row['step_s']:.1f}",
            f"{1e3 * row['exposed_comm_s']:.1f}",
            f"{row['wire_bytes_per_step'] / 1e6:.0f}",
            "" if memory is None else f"{memory / 2**30:.1f}",
            {True: "yes", False: "NO", None: "?"}[row["fits"]],
            f"{row['storage_gbs']:.2f}" if "storage_gbs" in row else "",
            f"{row['iops'] / 1e3:.1f} K" if "iops" in row else "",
            _duration(row.get("epoch_s")),
        ]
        if epochs:
            cells.append(_duration(row["epoch_s"] * epochs) if "epoch_s" in row else "")
        cells.append(row["limit"])
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    first = next((row for row in result["rows"] if row["limit"] != "compute"), None)
    lines.append("")
    lines.append(
        f"first limit: {first['limit']} at {first['devices']} devices" if first else "first limit: compute throughout"
    )
    return "\n".join(lines)


def plot_forecast(result: dict[str, Any], path: Path, measured: list[dict[str, Any]] | None = None) -> bool:
    """Global img/s against devices (log-log) with the linear ideal and any measured points; scaling
    efficiency below. False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    rows = result["rows"]
    devices = [row["devices"] for row in rows]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(6.5, 6), sharex=True, height_ratios=(2, 1))
    base = rows[0]["img_s"] / rows[0]["devices"]
    top.plot(devices, [base * count for count in devices], linestyle="--", color="gray", label="linear")
    top.plot(devices, [row["img_s"] for row in rows], marker="o", label="forecast")
    if measured:
        top.plot([m["devices"] for m in measured], [m["img_s"] for m in measured], "s", color="black", label="measured")
    top.set_xscale("log", base=2)
    top.set_yscale("log")
    top.set_ylabel("global img/s")
    top.legend()
    top.set_title(f"{result['inputs']['model']}, {result['inputs']['layout']}, {result['inputs']['network']}")
    bottom.plot(devices, [100 * row["efficiency"] for row in rows], marker="o")
    bottom.set_ylabel("scaling efficiency %")
    bottom.set_xlabel("devices")
    bottom.set_ylim(0, 105)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
