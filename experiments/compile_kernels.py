"""Training-step time of torch.compile and the fused CPU kernels, alone and together, alternating in
one process.

    python experiments/compile_kernels.py --model vit_tiny_patch4 --image-size 32 --batch 64 \
        --set model.attn_impl=matmul

Three O2 bf16 training steps are built as ``vitrain bench`` builds them: ``kernels`` (the converted
model, eager), ``compile`` (PyTorch's ops, each block compiled: ``performance.compile``) and ``compile +
kernels`` (the converted model, each block compiled: the registered ops run inside the compiled
graphs). Every shape is compiled before the clock; then ``--rounds`` rounds time ``--steps`` steps of
each arm in turn, so a shared host's drift falls on all three alike. Prints ms per step, img/s and
each arm's speed relative to ``kernels``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from vitrain.bench import BenchSettings, bench_overrides
from vitrain.bench.throughput import synthetic_batch
from vitrain.config import Config, build_config
from vitrain.train import make_plan
from vitrain.train.build import build_training_step

ARMS = {
    "kernels": ["performance.cpu_kernels=auto", "performance.compile=false"],
    "compile": ["performance.cpu_kernels=native", "performance.compile=true"],
    "compile + kernels": ["performance.cpu_kernels=auto", "performance.compile=true"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--image-size", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    settings = BenchSettings(steps=args.steps, warmup=1, repeats=args.rounds)
    mode = "o2" if args.precision == "bf16" else None
    base = bench_overrides(args.model, args.image_size, args.batch, args.precision, mode, settings)
    steps, batches = {}, {}
    for arm, switches in ARMS.items():
        plan = make_plan(build_config(Config(), [], base + args.overrides + switches))
        steps[arm] = build_training_step(plan)
        steps[arm].model.train()
        batches[arm] = synthetic_batch(plan)
        started = time.perf_counter()
        for _ in range(2):  # compiles forward and backward of every shape
            steps[arm](*batches[arm])[0].item()
        print(f"{arm}: built and warmed in {time.perf_counter() - started:.1f} s", flush=True)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(args.rounds):
        for arm, samples in times.items():
            steps[arm](*batches[arm])[0].item()
            start = time.perf_counter()
            for _ in range(args.steps):
                steps[arm](*batches[arm])[0].item()
            samples.append((time.perf_counter() - start) * 1e3 / args.steps)
    reference = statistics.median(times["kernels"])
    for arm, samples in times.items():
        median = statistics.median(samples)
        rounds = ", ".join(f"{sample:.0f}" for sample in samples)
        print(
            f"{arm:18s} {median:8.1f} ms/step ({rounds}); {args.batch / median * 1e3:7.1f} img/s; "
            f"{reference / median:.3f}x kernels"
        )


if __name__ == "__main__":
    main()
