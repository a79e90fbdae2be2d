"""What ``precision=auto`` (with ``precision_mode=auto`` and ``performance.cpu_kernels=auto``) picks at each CPU level
this machine can emulate, and the step rates of the candidates it compared: the table of docs/benchmarks.md.

Each level runs in a subprocess of its own with an empty cache of measured choices (the fused kernels' build is
kept: it is torch's cache), for the default recipe's model (batch 256, 32 px, Muon) and for ViT-Ti/4 at 32 px
(batch 128, AdamW). Levels: the CPU as it is, ``avx512-no-bf16`` (ONEDNN_MAX_CPU_ISA=AVX512_CORE
ATEN_CPU_CAPABILITY=avx512 VITRAIN_AMX=off) and ``avx2`` (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
VITRAIN_AMX=off); a level the CPU lacks the flags for is left out.

    .venv/bin/python experiments/auto_choice_levels.py --out records/auto-choice-<date>-<cpu>/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LEVELS = {
    "native": {},
    "avx512-no-bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512", "VITRAIN_AMX": "off"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "VITRAIN_AMX": "off"},
}
NEEDS_FLAG = {"native": None, "avx512-no-bf16": "avx512f", "avx2": "avx2"}
VIT_TI4_32PX = [
    "model.name=vit_tiny_patch16",
    "model.patch_size=4",
    "model.attn_impl=matmul",
    "data.name=synthetic",
    "data.image_size=32",
    "data.synthetic_num_train=1024",
    "train.batch_size=128",
    "optim.name=adamw",
    "precision=auto",
    "precision_mode=auto",
]


def measure_here() -> dict:
    """In the level's subprocess: the measured choice for both models."""
    from vitrain import cpu_features
    from vitrain.config import build_config
    from vitrain.data import describe_source
    from vitrain.hardware import detect_hardware
    from vitrain.recipes import get_recipe
    from vitrain.train.precision_choice import measure_precision

    results = {"cpu_key": cpu_features.cpu_key(), "bf16": cpu_features.bf16_state(), "models": {}}
    for name, config in (
        ("default (fmnist recipe)", get_recipe("fmnist")),
        ("ViT-Ti/4, 32 px, batch 128", build_config(get_recipe("fmnist"), [], VIT_TI4_32PX)),
    ):
        measured = measure_precision(config, describe_source(config.data), detect_hardware("cpu"))
        results["models"][name] = measured.record()
    return results


def run_level(level: str) -> dict | None:
    from vitrain import cpu_features

    flag = NEEDS_FLAG[level]
    if flag is not None and flag not in (cpu_features.cpu_flags() or set()):
        return None
    with tempfile.TemporaryDirectory() as cache:
        environment = {**os.environ, **LEVELS[level], "VITRAIN_CACHE_DIR": cache}
        answer = subprocess.run(
            [sys.executable, __file__, "--child"], env=environment, capture_output=True, text=True, check=True
        )
    return json.loads(answer.stdout.strip().splitlines()[-1])


def table(results: dict) -> str:
    rows = ["| level | model | picked | img/s of each candidate |", "|---|---|---|---|"]
    for level, found in results.items():
        for model, measured in found["models"].items():
            rates = ", ".join(f"{label} {rate:.0f}" for label, rate in measured["img_s"].items())
            skipped = "".join(f"; {label}: {why}" for label, why in measured["skipped"].items())
            rows.append(f"| {level} | {model} | **{measured['chosen']}** | {rates}{skipped} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_here()))
        return
    results = {level: found for level in LEVELS if (found := run_level(level)) is not None}
    print(table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
