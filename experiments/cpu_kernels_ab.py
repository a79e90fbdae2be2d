"""Training-step time with PyTorch's ops against the fused CPU kernels, alternating in one process.

    python experiments/cpu_kernels_ab.py --model locality_vit_small_patch16 --image-size 224 --batch 32 \
        --rounds 4 --steps 2 --set model.attn_impl=matmul

Two O2 bf16 training steps are built as ``vitrain bench`` builds them, one with ``performance.cpu_kernels=native``
and one with ``auto`` (the same seed, so the same weights); then, for ``--rounds`` rounds, ``--steps`` steps
of each are timed (one untimed step after each switch). Alternating within one process cancels the drift of
a shared host's speed, which between separate processes was as large as the effect (±5 %). Prints ms per
step per round and the medians.

``--kernel NAME`` compares the ``auto`` step with all kernels against all but that one instead: ``attention``,
``linear_gelu``, ``locality_front`` (their functions return None, so the modules run),
``weight_gradient`` (the linear layers copy an operand feature-major and run oneDNN's product),
``add_layer_norm`` (the residual add and the norm apart), ``bias_in_product`` (``F.linear``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from vitrain import kernels
from vitrain.bench import BenchSettings, bench_overrides
from vitrain.bench.throughput import synthetic_batch
from vitrain.config import Config, Plan, build_config
from vitrain.kernels import converter, depthwise, linear
from vitrain.train import make_plan
from vitrain.train.build import build_training_step
from vitrain.train.step import TrainStep


def _separate_add_layer_norm(x, branch, norm):  # noqa: ANN001, ANN202
    s = x + branch
    return s, norm(s)


def _without_bias_in_product() -> kernels.Paths:
    return dataclasses.replace(kernels.build._decide_paths(), bias_in_product=False)


# what each --kernel switch replaces, in which module of vitrain.kernels, for the arm without it
SWITCHES = {
    "attention": ([converter], "attention", lambda *_, **__: None),
    "linear_gelu": ([converter], "linear_gelu", lambda *_, **__: None),
    "locality_front": ([converter], "locality_front", lambda *_, **__: None),
    "weight_gradient": ([linear, depthwise], "tiled_weight_gradient", lambda weight: False),
    "add_layer_norm": ([converter], "add_layer_norm", _separate_add_layer_norm),
    "bias_in_product": ([kernels.build], "paths", _without_bias_in_product),
}


def _steps(plan: Plan, arms: dict[str, str]) -> dict[str, TrainStep]:
    """One training step per arm, built from ``plan`` with the arm's fused-kernel mode (arms of one mode share one)."""
    built: dict[str, TrainStep] = {}
    for mode in dict.fromkeys(arms.values()):
        step = build_training_step(
            dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime, cpu_kernels=mode))
        )
        step.model.train()
        built[mode] = step
    return {arm: built[mode] for arm, mode in arms.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--image-size", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--kernel", choices=sorted(SWITCHES), default=None)
    args = parser.parse_args()

    settings = BenchSettings(steps=args.steps, warmup=1, repeats=args.rounds)
    overrides = bench_overrides(args.model, args.image_size, args.batch, "bf16", "o2", settings)
    plan = make_plan(build_config(Config(), [], overrides + args.overrides))
    if kernels.load() is None:
        raise SystemExit("the fused CPU kernels could not be built here; nothing to compare")
    modules, attribute, off = SWITCHES[args.kernel] if args.kernel else ([], None, None)
    kernel = getattr(modules[0], attribute) if attribute else None
    arms = {f"without {args.kernel}": "auto", "all": "auto"} if attribute else {"native": "native", "auto": "auto"}
    steps = _steps(plan, arms)
    images, labels = synthetic_batch(plan)
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(args.rounds):
        for arm, samples in times.items():
            step = steps[arm]
            for module in modules:
                setattr(module, attribute, off if arm.startswith("without") else kernel)
            step(images, labels)[0].item()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(images, labels)[0].item()
            samples.append((time.perf_counter() - start) * 1e3 / args.steps)
    for arm, samples in times.items():
        median = statistics.median(samples)
        rounds = ", ".join(f"{sample:.0f}" for sample in samples)
        print(f"{arm:7s} {median:8.1f} ms/step median ({rounds}); {args.batch / median * 1e3:.1f} img/s")
    base, new = times.keys()
    print(f"{new} / {base} img/s: {statistics.median(times[base]) / statistics.median(times[new]):.3f}")


if __name__ == "__main__":
    main()
