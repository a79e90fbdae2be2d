"""The GPU acceptance run (``make gpu-check``): ``vitrain doctor``, the ``gpu`` tests, then the benchmark set,
everything written into one record folder with a markdown summary.

    python experiments/gpu_check.py                      # on a CUDA machine: records/gpu-check-<date>-<gpu>/
    python experiments/gpu_check.py --device cpu --tiny  # the dry run: every stage at toy sizes on the CPU

Stages (each a subprocess with its own time limit; a failed or timed-out stage is recorded and the next
one runs):

1. ``vitrain doctor --json`` (when this vitrain has it);
2. ``pytest -m gpu`` with a JUnit report (on a machine without CUDA the tests skip, saying why);
3. ``vitrain bench --compare-timm`` for ViT-B/16, ViT-S/16, VOLO-D1 and ResNet-50 (channels-last) at
   224 px in bf16, vitrain's step and timm's measured in one process;
4. ``vitrain bench --ladder`` for ViT-B/16 (fp32 -> bf16 -> fused optimizer -> attention -> compile -> O2
   -> activation checkpointing), JSON and PNG.

``--speed`` runs the speed sweep instead (``records/gpu-speed-<date>-<gpu>/``): bf16 O2 against FP8
(``precision=fp8``, tensorwise and rowwise scaling), compiled, for ViT-B/16 at batch 256 and 512, ViT-L/16 and
VOLO-D1, each model's first row against timm compiled in the same process (ViT-B/16 also against timm eager,
as its ``train.py`` runs by default), every row profiled (kernel categories, top kernels, idle time); then
JPEG decode throughput (``experiments/decode_throughput.py``: Pillow, torchvision on the CPU, nvJPEG, DALI)
and the attention kernels pinned. In the CPU dry run the CUDA-only kernel is replaced by SDPA's math kernel
and one row of each kind runs.

The acceptance run is sized to end within 10 minutes on one H100. The whole speed sweep takes about 15 on
an H200 (each row compiles for 30-120 s): with ``--deadline-s`` the rows past the deadline are reported as
not run, and ``--only`` runs the rest later. Nothing in either needs the internet.
Exit status: 0 when every stage passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Benchmark shapes and windows: the acceptance sizes, or toy ones for the CPU dry run."""

    image_size: int = 224
    batch: int = 256
    resnet_batch: int = 256
    volo_batch: int = 128
    steps: int = 10
    warmup: int = 3
    repeats: int = 3
    profile: int = 3
    ladder_steps: int = 5
    compile_backend: str = "inductor"
    doctor_timeout: int = 60
    pytest_timeout: int = 280
    bench_timeout: int = 60
    ladder_timeout: int = 150
    speed_timeout: int = 150
    decode_images: int = 1024
    speed_rows: tuple[str, ...] | None = None
    """The speed sweep's rows to run (None: all)."""


TINY = Sizes(
    image_size=32,
    batch=2,
    resnet_batch=2,
    volo_batch=2,
    steps=1,
    warmup=1,
    repeats=1,
    profile=1,
    ladder_steps=1,
    compile_backend="eager",
    doctor_timeout=240,  # its CPU probes: 60 s and more where bf16 is emulated (AVX2-only EPYC)
    pytest_timeout=120,
    bench_timeout=120,
    ladder_timeout=240,
    speed_timeout=120,
    decode_images=16,
    # timm compiled and eager beside bf16; FP8 with rowwise scaling at twice the batch, on another model too
    speed_rows=("speed-bf16", "speed-fp8-b2x", "volo-fp8"),
)

# (name, vitrain model, extra bench flags)
MODELS = [
    ("vit_b16", "vit_base_patch16", []),
    ("vit_s16", "vit_small_patch16", []),
    ("volo_d1", "volo_d1", []),
    ("resnet50_cl", "resnet50", ["--set", "performance.channels_last=true"]),
]


@dataclasses.dataclass
class Stage:
    name: str
    argv: list[str]
    timeout_s: int
    status: str = "not run"
    seconds: float = 0.0
    returncode: int | None = None


def vitrain_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "vitrain", *args]


def device_label(device: str) -> str:
    """The folder-name label of the device: the GPU's name, or ``cpu``."""
    if device == "cpu":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no-cuda"
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")


def window_flags(sizes: Sizes) -> list[str]:
    """The bench's measurement windows, and the steps profiled after them."""
    flags = {"--steps": sizes.steps, "--warmup": sizes.warmup, "--repeats": sizes.repeats, "--profile": sizes.profile}
    return [part for flag, value in flags.items() for part in (flag, str(value))]


def bench_stages(out: Path, sizes: Sizes, device: str) -> list[Stage]:
    common = ["--image-size", str(sizes.image_size), "--precision", "bf16", "--set", f"train.device={device}"]
    if device == "cpu":  # the dry run checks the stages, not the CPU kernels (their build is tested apart)
        common += ["--set", "performance.cpu_kernels=native"]
    windows = window_flags(sizes)
    stages = []
    for name, model, extra in MODELS:
        batch = {"resnet50": sizes.resnet_batch, "volo_d1": sizes.volo_batch}.get(model, sizes.batch)
        argv = vitrain_command(
            "bench", "--model", model, "--batch", str(batch), *common, *windows, *extra, "--compare-timm"
        )
        stages.append(Stage(f"bench-{name}", [*argv, "--json", str(out / f"bench-{name}.json")], sizes.bench_timeout))
    ladder = vitrain_command(
        "bench",
        "--model",
        "vit_base_patch16",
        "--batch",
        str(sizes.batch),
        *common,
        "--steps",
        str(sizes.ladder_steps),
        "--warmup",
        str(max(1, sizes.warmup - 1)),
        "--repeats",
        str(sizes.repeats),
        "--compile-backend",
        sizes.compile_backend,
        "--ladder",
        "--json",
        str(out / "ladder-vit_b16.json"),
    )
    stages.append(Stage("ladder-vit_b16", ladder, sizes.ladder_timeout))
    return stages


# The speed sweep, in the order it runs (what the deadline cuts is the last): (name, model, batch as a
# multiple of Sizes.batch, extra bench flags). Every row is bf16 O2 + compile unless its flags say fp8; each
# model's first row is timed against timm compiled in the same process; all rows are profiled after their
# timed windows. ATTENTION is the device's pinned kernel under test (cuDNN's on CUDA).
ATTENTION = "{attention}"
FP8 = ["--precision", "fp8"]
ROWWISE = [*FP8, "--set", "performance.fp8_scaling=rowwise"]
AUTO = ["--set", "model.attn_impl=auto"]
SPEED = [
    ("speed-bf16", "vit_base_patch16", 1, [*AUTO, "--compare-timm", "--timm-eager"]),
    ("speed-fp8", "vit_base_patch16", 1, [*AUTO, *FP8]),
    ("speed-fp8-rowwise", "vit_base_patch16", 1, [*AUTO, *ROWWISE]),
    ("vitl-bf16", "vit_large_patch16", 0.5, [*AUTO, "--compare-timm"]),
    ("vitl-fp8", "vit_large_patch16", 0.5, [*AUTO, *FP8]),
    ("speed-bf16-b2x", "vit_base_patch16", 2, AUTO),
    ("speed-fp8-b2x", "vit_base_patch16", 2, [*AUTO, *FP8]),
    ("volo-bf16", "volo_d1", 0.5, ["--compare-timm"]),
    ("volo-fp8", "volo_d1", 0.5, FP8),
    ("speed-sdpa", "vit_base_patch16", 1, ["--set", "model.attn_impl=sdpa"]),
    ("speed-pinned", "vit_base_patch16", 1, ["--set", f"model.attn_impl={ATTENTION}"]),
]

PINNED_ROWS = ("speed-sdpa", "speed-pinned")
"""The sweep's last rows, the attention kernels pinned, run after the JPEG decode."""


def speed_stages(out: Path, sizes: Sizes, device: str) -> list[Stage]:
    """The speed sweep: bf16 O2 against FP8, compiled whole, for ViT-B/16 (two batches, both FP8 scalings),
    ViT-L/16 and VOLO-D1; then the attention kernels pinned; then JPEG decode on the device."""
    common = ["--image-size", str(sizes.image_size), "--precision", "bf16", "--precision-mode", "o2"]
    common += ["--set", f"train.device={device}", "--compile", "--compile-backend", sizes.compile_backend]
    if device == "cpu":
        common += ["--set", "performance.cpu_kernels=native"]
    common += window_flags(sizes)
    attention = "sdpa_cudnn" if device == "cuda" else "sdpa_math"
    stages = []
    for name, model, multiple, extra in SPEED:
        if sizes.speed_rows is not None and name not in sizes.speed_rows:
            continue
        flags = [flag.replace(ATTENTION, attention) for flag in extra]
        batch = max(1, int(multiple * sizes.batch))
        argv = vitrain_command("bench", "--model", model, "--batch", str(batch), *common, *flags)
        stages.append(Stage(name, [*argv, "--json", str(out / f"{name}.json")], sizes.speed_timeout))
    decode = [sys.executable, str(ROOT / "experiments" / "decode_throughput.py"), "--device", device]
    decode += ["--images", str(sizes.decode_images), "--json", str(out / "decode.json")]
    pinned = sum(stage.name in PINNED_ROWS for stage in stages)
    stages.insert(len(stages) - pinned, Stage("decode", decode, sizes.bench_timeout))
    return stages


def all_stages(out: Path, sizes: Sizes, device: str) -> list[Stage]:
    pytest = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "gpu"), "-m", "gpu", "-q", "-rs"]
    pytest += ["-p", "no:cacheprovider", f"--junitxml={out / 'pytest-gpu.xml'}"]
    return [
        # the benchmarks' data: synthetic (the default recipe's Fashion-MNIST need not be installed)
        Stage(
            "doctor",
            vitrain_command(
                "doctor", "--device", device, "--set", "data.name=synthetic", "--json", str(out / "doctor.json")
            ),
            sizes.doctor_timeout,
        ),
        Stage("pytest-gpu", pytest, sizes.pytest_timeout),
        *bench_stages(out, sizes, device),
    ]


def run_stage(stage: Stage, out: Path, env: dict[str, str], seconds_left: float) -> None:
    """Run one stage, within its own limit and the time left to the whole run."""
    stage.timeout_s = max(1, int(min(stage.timeout_s, seconds_left)))
    start = time.perf_counter()
    log_path = out / f"{stage.name}.log"
    with log_path.open("w") as log:
        log.write("$ " + " ".join(stage.argv) + "\n")
        log.flush()
        try:
            result = subprocess.run(
                stage.argv, stdout=log, stderr=subprocess.STDOUT, timeout=stage.timeout_s, env=env, cwd=ROOT
            )
            stage.returncode = result.returncode
            stage.status = "pass" if result.returncode == 0 else "FAIL"
        except subprocess.TimeoutExpired:
            stage.status = f"TIMEOUT ({stage.timeout_s} s)"
    stage.seconds = time.perf_counter() - start
    print(f"{stage.name:24s} {stage.status:16s} {stage.seconds:7.1f} s", flush=True)


def pytest_counts(path: Path) -> dict[str, int] | None:
    if not path.exists():
        return None
    suites = ElementTree.parse(path).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def mfu_and_memory(record: dict) -> tuple[str, str]:
    """A bench record's MFU (percent) and peak memory (GiB) as table cells."""
    mfu = f"{100 * record['mfu']:.1f} %" if record.get("mfu") is not None else "-"
    memory = f"{record['peak_memory_bytes'] / 2**30:.1f}" if record.get("peak_memory_bytes") else "-"
    return mfu, memory


def bench_rows(out: Path) -> list[str]:
    rows = [
        "| model | batch | vitrain img/s | timm img/s | vitrain / timm | MFU | TFLOP/s | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, model, _ in MODELS:
        result = read_json(out / f"bench-{name}.json")
        if result is None:
            rows.append(f"| {model} ({name}) | - | no result (see bench-{name}.log) | | | | | |")
            continue
        timm = result.get("timm") or {}
        ratio = result["img_s_median"] / timm["img_s_median"] if timm.get("img_s_median") else None
        mfu, memory = mfu_and_memory(result)
        rows.append(
            f"| {model} ({name}) | {result['batch']} | {result['img_s_median']:.1f} | "
            f"{timm.get('img_s_median', float('nan')):.1f} | {f'{ratio:.3f}' if ratio else '-'} | {mfu} | "
            f"{result.get('achieved_tflops', float('nan')):.1f} | {memory} |"
        )
    return rows


def ladder_rows(out: Path) -> list[str]:
    result = read_json(out / "ladder-vit_b16.json")
    if result is None:
        return ["no ladder result (see ladder-vit_b16.log)"]
    rows = ["| rung | img/s | x fp32 | MFU | peak GiB | chosen |", "|---|---|---|---|---|---|"]
    for row in result["rungs"]:
        mfu, memory = mfu_and_memory(row)
        rows.append(
            f"| {row['rung']} | {row['img_s_median']:.1f} | {row['speedup']:.2f} | {mfu} | {memory} | "
            f"{row.get('chosen') or ''} |"
        )
    rows += [f"\nskipped: {row['rung']}: {row['reason']}" for row in result.get("skipped", [])]
    return rows


def timm_rates(out: Path) -> dict[str, dict[str, float]]:
    """Per model, timm's img/s at each batch it was timed at in this sweep (compiled, same process as that row)."""
    rates: dict[str, dict[str, float]] = {}
    for name, model, _, _ in SPEED:
        timm = (read_json(out / f"{name}.json") or {}).get("timm") or {}
        if timm.get("img_s_median"):
            rates.setdefault(model, {})[str(timm.get("batch"))] = timm["img_s_median"]
    return rates


def speed_rows(out: Path) -> list[str]:
    """One row per sweep setting: img/s, MFU (FP8 rows: against the FLOP-weighted peak, and bf16-equivalent),
    and the ratio to timm compiled at the same model and batch, timed in this sweep."""
    rows = [
        "| row | model | batch | precision | attention | img/s | MFU | MFU bf16-equivalent | peak GiB | "
        "vs timm compiled | vs timm eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    timm = timm_rates(out)
    for name, model, _, _ in SPEED:
        result = read_json(out / f"{name}.json")
        if result is None:
            rows.append(f"| {name} | {model} | - | no result (see {name}.log) | | | | | | | |")
            continue
        mfu, memory = mfu_and_memory(result)
        equivalent = result.get("mfu_bf16_equivalent", result.get("mfu"))
        equivalent = f"{100 * equivalent:.1f} %" if equivalent is not None else "-"
        reference = timm.get(model, {}).get(str(result["batch"]))
        ratio = f"{result['img_s_median'] / reference:.3f}" if reference else "-"
        eager = f"{result['ours_over_timm_eager']:.3f}" if "ours_over_timm_eager" in result else "-"
        rows.append(
            f"| {name} | {model} | {result['batch']} | {result.get('precision')} {result.get('precision_mode', '')} | "
            f"{result.get('attn_impl')} | {result['img_s_median']:.1f} | {mfu} | {equivalent} | {memory} | "
            f"{ratio} | {eager} |"
        )
    return rows


def top_kernel_rows(out: Path, names: tuple[str, ...] = ("speed-bf16", "speed-fp8"), count: int = 12) -> list[str]:
    """The profile's top kernels (GPU) or operators (CPU) by time of the named rows, and of timm's."""
    lines = []
    for name in names:
        result = read_json(out / f"{name}.json") or {}
        for label, record in (("vitrain", result), ("timm", result.get("timm"))):
            top = ((record or {}).get("step_breakdown") or {}).get("top")
            if not top:
                continue
            lines += [f"### {name} {label}", "", "| kernel | category | ms/step | calls/step |", "|---|---|---|---|"]
            lines += [
                f"| `{row['name'][:90]}` | {row['category']} | {row['ms']:.2f} | {row['calls']:.0f} |"
                for row in top[:count]
            ]
            lines.append("")
    return lines or ["no profile (see the bench logs)"]


def decode_rows(out: Path) -> list[str]:
    result = read_json(out / "decode.json")
    if result is None:
        return ["no decode result (see decode.log)"]
    return [f"- {row['name']}: {row['img_s']:.0f} img/s ({row['detail']})" for row in result["rows"]]


def breakdown_rows(out: Path, names: list[str]) -> list[str]:
    """Where the step goes (``vitrain bench --profile``) for each record's runs: ms per step and share per
    category, the device's idle time and the FLOP rate of its matmul, attention and convolution kernels."""
    runs = []
    for name in names:
        result = read_json(out / f"{name}.json") or {}
        for label, record in (
            ("vitrain", result),
            ("timm", result.get("timm")),
            ("timm eager", result.get("timm_eager")),
        ):
            if record and record.get("step_breakdown"):
                runs.append((f"{name} {label}", record["step_breakdown"]))
    if not runs:
        return ["no step breakdown (see the bench logs)"]
    sys.path.insert(0, str(ROOT / "src"))  # the stages run from the checkout; so does this table's import
    from vitrain.bench.breakdown import DISPLAY_ORDER

    present = [name for name in DISPLAY_ORDER if any(name in parts["categories_ms"] for _, parts in runs)]
    rows = [
        f"| run | ms/step profiled | {' | '.join(present)} | idle (GPU) or outside operators (CPU) | "
        "matmul/attention/conv TFLOP/s |",
        "|---|---|" + "---|" * (len(present) + 2),
    ]
    for label, parts in runs:
        step = parts["profiled_step_ms"]
        cells = [
            f"{parts['categories_ms'][name]:.2f} ({100 * parts['categories_ms'][name] / step:.0f} %)"
            if name in parts["categories_ms"]
            else "-"
            for name in present
        ]
        tflops = f"{parts['tensor_tflops']:.4g}" if parts.get("tensor_tflops") else "-"
        idle = f"{parts['idle_ms']:.2f} ({100 * parts['idle_ms'] / step:.0f} %)"
        rows.append(f"| {label} | {step:.2f} | {' | '.join(cells)} | {idle} | {tflops} |")
    source = runs[0][1]["source"]
    return rows + ["", f"Times: {source}, {runs[0][1]['profiled_steps']} steps profiled after the timed windows."]


def write_summary(out: Path, stages: list[Stage], device: str, command: str) -> Path:
    doctor = read_json(out / "doctor.json") or {}
    counts = pytest_counts(out / "pytest-gpu.xml")
    speed = any(stage.name.startswith("speed-") for stage in stages)
    lines = [
        f"# GPU {'speed sweep' if speed else 'acceptance run'}: {out.name}",
        "",
        f"Command: `{command}`; date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"device {device_label(device)}; git revision {git_revision()}.",
        "",
        "| stage | status | seconds |",
        "|---|---|---|",
        *(f"| {stage.name} | {stage.status} | {stage.seconds:.1f} |" for stage in stages),
        "",
    ]
    breakdown_names = [row[0] for row in SPEED] if speed else [f"bench-{name}" for name, _, _ in MODELS]
    if speed:
        lines += ["## Speed sweep: bf16 O2 and FP8, compiled (synthetic data)", "", *speed_rows(out), ""]
        lines += ["## JPEG decode on the device", "", *decode_rows(out), ""]
    else:
        lines += [
            f"gpu tests: {counts}" if counts else "gpu tests: no JUnit report",
            "",
            "## Throughput (bf16 autocast, synthetic data, median of the timed windows)",
            "",
            *bench_rows(out),
            "",
            "## Speed ladder, ViT-B/16",
            "",
            *ladder_rows(out),
            "",
        ]
    lines += ["## Where the step goes (`vitrain bench --profile`)", "", *breakdown_rows(out, breakdown_names), ""]
    if speed:
        lines += ["## Top kernels of the profiled steps", "", *top_kernel_rows(out)]
    if doctor:
        lines += ["## doctor", "", "```", json.dumps(doctor, indent=1)[:6000], "```", ""]
    path = out / "summary.md"
    path.write_text("\n".join(lines))
    return path


def git_revision() -> str:
    """``VITRAIN_GIT_REVISION`` when set (a copy of the tree without its .git), else git's."""
    if os.environ.get("VITRAIN_GIT_REVISION"):
        return os.environ["VITRAIN_GIT_REVISION"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy sizes and windows (the CPU dry run)")
    parser.add_argument(
        "--speed", action="store_true", help="the ViT-B/16 speed sweep instead of the acceptance stages"
    )
    parser.add_argument("--out", type=Path, help="record folder (default records/gpu-check-<date>-<device>)")
    parser.add_argument("--only", nargs="*", help="run only these stages (names as in the summary)")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=560.0,
        help="the whole run's limit in seconds; later stages get what is left",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = TINY if args.tiny else Sizes()
    label = f"{datetime.date.today():%Y-%m-%d}-{device_label(args.device)}"
    out = (args.out or ROOT / "records" / f"gpu-{'speed' if args.speed else 'check'}-{label}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH")]))
    stages = (speed_stages if args.speed else all_stages)(out, sizes, args.device)
    if args.only:
        stages = [stage for stage in stages if stage.name in args.only]
    deadline = time.perf_counter() + args.deadline_s
    for stage in stages:
        seconds_left = deadline - time.perf_counter()
        if seconds_left < 5:
            stage.status = "not run (deadline)"
            continue
        run_stage(stage, out, env, seconds_left)
    command = "python experiments/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    summary = write_summary(out, stages, args.device, command.strip())
    print(f"summary: {summary}")
    return 0 if all(stage.status == "pass" for stage in stages) else 1


if __name__ == "__main__":
    sys.exit(main())
