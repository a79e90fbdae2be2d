"""Forward + backward time of the convolutional FFNs (``LocalViTMlp``, Borealis ``LocalityMlp``)
and the plain ``Mlp`` at the default recipe's shapes (batch 256, a 4x4 patch grid, width 192,
hidden 384, fp32, training mode), to compare FFN layouts across revisions:

    python experiments/ffn_layout.py                                   # this checkout
    git worktree add /tmp/old REV && PYTHONPATH=/tmp/old/src python experiments/ffn_layout.py   # REV's

Prints the median milliseconds per forward + backward over ``--repeats`` windows; docs/benchmarks.md
records the figures with the device.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from vitrain.bench import window_ms
from vitrain.models.layers import LocalityMlp, Mlp
from vitrain.models.localvit import LocalViTMlp


def time_ms(
    module: torch.nn.Module, tokens: torch.Tensor, grid: tuple[int, int], repeats: int, iterations: int
) -> float:
    """Median ms per forward + backward over ``repeats`` windows, after 3 warm-up calls."""
    return statistics.median(window_ms(lambda: module(tokens, grid).sum().backward(), repeats, iterations, warmup=3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--grid", type=int, default=4)
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    grid = (args.grid, args.grid)
    tokens = torch.randn(args.batch, args.grid * args.grid, args.dim, requires_grad=True)
    print(f"batch {args.batch}, grid {grid}, dim {args.dim}, hidden {args.hidden}, {torch.get_num_threads()} threads")
    for ffn in (LocalViTMlp, LocalityMlp, Mlp):
        module = ffn(args.dim, args.hidden).train()
        print(f"{ffn.__name__:12s} {time_ms(module, tokens, grid, args.repeats, args.iterations):7.2f} ms fwd+bwd")


if __name__ == "__main__":
    main()
