"""Where a training step's time goes, per aten op, on CPU.

    python experiments/op_profile.py --model vit_tiny_patch16 --image-size 32 --batch 128 \
        --precision bf16 --precision-mode o2 --steps 3 --set model.patch_size=4 --set model.attn_impl=matmul

Builds the step exactly as ``vitrain bench`` does (same overrides, same ``build_training_step``),
runs warm-up steps, then times every aten call of ``--steps`` whole steps with a dispatch-mode timer
(wall clock around each call; on CPU the ops are synchronous). ``torch.profiler`` inflates short
elementwise ops several fold on the project's VMs; this timer adds about a microsecond per call.
Prints ms per step by op (and by op and shapes with ``--shapes``), and the share of the step that
the ops account for (the rest is Python and autograd bookkeeping). The fused CPU kernels of
``vitrain.kernels`` are registered ops: they are listed as ``vitrain.<op>``, their time including the
ATen calls they make inside (which the timer does not see on their own).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vitrain.bench import BenchSettings, bench_overrides
from vitrain.bench.throughput import synthetic_batch
from vitrain.config import Config, build_config
from vitrain.train import make_plan
from vitrain.train.build import build_training_step


class OpTimer(TorchDispatchMode):
    def __init__(self, shapes: bool) -> None:
        super().__init__()
        self.shapes = shapes
        self.total: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        elapsed = time.perf_counter() - start
        name = str(func.overloadpacket.__name__)
        key = name if func.namespace == "aten" else f"{func.namespace}.{name}"
        if self.shapes:
            dims = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            key = f"{key} {dims}"
        self.total[key] += elapsed
        self.calls[key] += 1
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--image-size", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--precision-mode", default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--shapes", action="store_true", help="key by op and input shapes")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    settings = BenchSettings(steps=args.steps, warmup=args.warmup, repeats=1)
    overrides = bench_overrides(args.model, args.image_size, args.batch, args.precision, args.precision_mode, settings)
    plan = make_plan(build_config(Config(), [], overrides + args.overrides))
    step = build_training_step(plan)
    step.model.train()
    images, labels = synthetic_batch(plan)
    for _ in range(args.warmup):
        step(images, labels)[0].item()

    start = time.perf_counter()
    for _ in range(args.steps):
        step(images, labels)[0].item()
    untimed_ms = (time.perf_counter() - start) * 1e3 / args.steps

    timer = OpTimer(args.shapes)
    start = time.perf_counter()
    with timer:
        for _ in range(args.steps):
            step(images, labels)[0].item()
    timed_ms = (time.perf_counter() - start) * 1e3 / args.steps

    op_ms = sum(timer.total.values()) * 1e3 / args.steps
    print(f"step {untimed_ms:.1f} ms without the timer, {timed_ms:.1f} ms with it; ops and kernels {op_ms:.1f} ms")
    print(f"{'ms/step':>9} {'share':>6} {'calls':>6}  op")
    for key, seconds in timer.total.most_common(args.top):
        ms = seconds * 1e3 / args.steps
        print(f"{ms:9.2f} {ms / op_ms:6.1%} {timer.calls[key] // args.steps:6d}  {key}")


if __name__ == "__main__":
    main()
