"""Training-step throughput of model variants on synthetic batches (forward, backward, AdamW).

Used to choose the default recipe's model and attention kernel; `vitrain bench` will
supersede it. Example (the figures in docs/benchmarks.md):

    .venv/bin/python experiments/step_throughput.py --image-size 28 --in-chans 1 \
        --variant locality_vit_tiny6_patch7:patch_size=7:attn_impl=matmul \
        --variant locality_vit_tiny6_patch7:patch_size=7:attn_impl=sdpa \
        --variant locality_vit_tiny6_patch7:patch_size=4:attn_impl=matmul
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vitrain.config import precision_policy
from vitrain.models import build_model
from vitrain.train.step import TrainStep, apply_precision, build_grad_scaler


def parse_variant(text: str) -> tuple[str, dict]:
    name, *pairs = text.split(":")
    overrides = {}
    for pair in pairs:
        key, value = pair.split("=")
        overrides[key] = int(value) if value.isdigit() else value
    return name, overrides


def measure(name: str, overrides: dict, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = build_model(name, img_size=args.image_size, in_chans=args.in_chans, num_classes=10, **overrides)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    policy = precision_policy(args.precision, args.precision_mode, "cpu")
    low_precision = apply_precision(model, policy)
    step = TrainStep(model, optimizer, build_grad_scaler(policy), policy, 0.1, 1.0, low_precision=low_precision)
    images = torch.randn(args.batch, args.in_chans, args.image_size, args.image_size)
    labels = torch.randint(10, (args.batch,))
    for _ in range(args.warmup):
        step(images, labels)
    rates = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        for _ in range(args.steps):
            loss, _ = step(images, labels)
        loss.item()
        rates.append(args.batch * args.steps / (time.perf_counter() - started))
    return {
        "variant": name,
        **overrides,
        "img_s_median": statistics.median(rates),
        "img_s_min": min(rates),
        "img_s_max": max(rates),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", required=True, help="name[:key=value...]")
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--in-chans", type=int, default=1)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--precision-mode", default="autocast", choices=["autocast", "o2"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for text in args.variant:
        print(
            json.dumps(
                {
                    **measure(*parse_variant(text), args),
                    "batch": args.batch,
                    "precision": args.precision,
                    "precision_mode": args.precision_mode,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
