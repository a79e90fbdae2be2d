"""The attention core alone: the AMX kernel against the explicit attention (MatmulAttention), forward
and forward + backward, alternating in one process.

    python experiments/attention_kernel.py --shape 128,65,3,64 --shape 32,197,6,64 --shape 32,196,12,32

Each shape is batch,tokens,heads,head_dim (ViT-Ti/4 at 32 px with batch 128, ViT-S/16 and VOLO-D1's
transformer stages at 224 px with batch 32 by default), bf16 qkv as the fused projection gives it.
Both paths run ``--rounds`` times in turn, each timing the median of ``--repeats`` calls after two
untimed ones; the table gives the medians over rounds in ms. Needs a CPU with AMX-BF16.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from timing import median_ms

from vitrain import kernels
from vitrain.models.layers import MatmulAttention


def _paths(qkv: torch.Tensor, grad: torch.Tensor, head_dim: int) -> dict[str, tuple]:
    scale = head_dim**-0.5

    def forward_backward(attend):  # noqa: ANN001, ANN202
        def run() -> None:
            x = qkv.detach().requires_grad_()
            attend(x).backward(grad)

        return run

    return {  # qkv needs no gradient: the forward-only calls record no graph
        "explicit": (
            lambda: MatmulAttention.apply(qkv, head_dim, scale),
            forward_backward(lambda x: MatmulAttention.apply(x, head_dim, scale)),
        ),
        "amx kernel": (
            lambda: kernels.attention(qkv, head_dim, scale),
            forward_backward(lambda x: kernels.attention(x, head_dim, scale)),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", default=None, help="batch,tokens,heads,head_dim")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    compiled = kernels.load()
    if compiled is None or not kernels.paths().amx_tiles:
        raise SystemExit("no AMX-BF16 here (or the kernels did not build): nothing to compare")
    shapes = args.shape or ["128,65,3,64", "32,197,6,64", "32,196,12,32"]
    print(f"{torch.get_num_threads()} threads; ms, median over {args.rounds} rounds")
    print(f"{'batch,tokens,heads,head_dim':>28} {'path':>11} {'forward':>8} {'fwd+bwd':>8}")
    for shape in shapes:
        batch, tokens, heads, head_dim = (int(n) for n in shape.split(","))
        generator = torch.Generator().manual_seed(0)
        qkv = torch.randn(batch, tokens, 3 * heads * head_dim, generator=generator).to(torch.bfloat16)
        grad = torch.randn(batch, tokens, heads * head_dim, generator=generator).to(torch.bfloat16)
        paths = _paths(qkv, grad, head_dim)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, (forward, both) in paths.items():
                times[name].append((median_ms(forward, args.repeats), median_ms(both, args.repeats)))
        for name, samples in times.items():
            forward_ms = statistics.median(s[0] for s in samples)
            both_ms = statistics.median(s[1] for s in samples)
            print(f"{shape:>28} {name:>11} {forward_ms:8.2f} {both_ms:8.2f}")


if __name__ == "__main__":
    main()
