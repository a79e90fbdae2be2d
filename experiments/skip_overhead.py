"""What skipping non-finite steps costs per training step: the work a step adds for it (the
finiteness flag of loss and gradient norm, saving and restoring BatchNorm statistics, the skip
counters), timed alone, against the whole step. The figures in docs/reliability.md:

    OMP_NUM_THREADS=1 .venv/bin/python experiments/skip_overhead.py --model localvit_tiny6_patch7 --batch 128
    OMP_NUM_THREADS=1 .venv/bin/python experiments/skip_overhead.py --model vit_tiny6_patch7 --batch 16

(Timing the step before and after the change directly drowned in the noise of a shared 2-core
machine: +-5 % between alternating windows.)
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from vitrain.bench import window_ms
from vitrain.config import precision_policy
from vitrain.models import build_model
from vitrain.train.skips import SkipCounter
from vitrain.train.step import TrainStep, build_grad_scaler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="localvit_tiny6_patch7")
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model(args.model, img_size=args.image_size, in_chans=1, num_classes=10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    policy = precision_policy("fp32", "autocast", "cpu")
    step = TrainStep(model, optimizer, build_grad_scaler(policy), policy, 0.1, 1.0)
    images, labels = torch.randn(args.batch, 1, args.image_size, args.image_size), torch.randint(10, (args.batch,))
    loss, grad_norm = step(images, labels)
    counter = SkipCounter("cpu")

    def added_work():
        if step.batchnorm.buffers:
            step.batchnorm.save()
        skipped = (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).float()
        if step.batchnorm.buffers:
            step.batchnorm.restore_where(skipped)
        counter.add(skipped)

    step_ms = statistics.median(window_ms(lambda: step(images, labels), args.repeats, 3))
    added_ms = statistics.median(window_ms(added_work, args.repeats, 200))
    print(
        json.dumps(
            {
                "model": args.model,
                "batch": args.batch,
                "threads": torch.get_num_threads(),
                "batchnorm_buffers": len(step.batchnorm.buffers),
                "step_ms": round(step_ms, 2),
                "added_ms": round(added_ms, 4),
                "added_fraction": added_ms / step_ms,
            }
        )
    )


if __name__ == "__main__":
    main()
