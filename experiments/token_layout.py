"""Batch-first against batch-second token layout for a stack of ViT blocks (pycls ran its
ViT batch-second, the layout ``nn.MultiheadAttention`` took natively).

Three ways to run the same blocks (same weights), forward + backward, timed alternately:

- ``batch-first``: our ``Block`` on (B, N, C), as vitrain trains;
- ``batch-second``: the same operations on (N, B, C); only the q/k/v split and the head merge
  permute differently (LayerNorm, the linear layers and the FFN do not care about the layout);
- ``nn.MultiheadAttention``: PyTorch's module with its default (N, B, C) layout and our weights
  copied in, the pycls way.

Before timing, the outputs of the three are checked equal (so the timings compare the same
function). Example (the figures in docs/benchmarks.md):

    python experiments/token_layout.py --model vit_tiny_patch16 --patch-size 4 --image-size 32 --batch 128
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.bench import window_ms
from vitrain.models import build_model
from vitrain.models.layers import Attention, Block


def batch_second_attention(attention: Attention, x: torch.Tensor) -> torch.Tensor:
    """``Attention.forward`` on (N, B, C) tokens."""
    tokens, batch, _ = x.shape
    qkv = attention.qkv(x).reshape(tokens, batch, 3, -1, attention.head_dim).permute(2, 1, 3, 0, 4)
    q, k, v = qkv.unbind(0)
    if attention.impl == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v)
    else:
        out = attention._matmul_attention(q, k, v, 0.0)  # the model's own explicit path
    return attention.proj(out.permute(2, 0, 1, 3).reshape(tokens, batch, -1))


def multihead_attention(block: Block) -> nn.MultiheadAttention:
    """``nn.MultiheadAttention`` (batch second) holding the block's attention weights."""
    attention = block.attn
    dim = attention.qkv.in_features
    module = nn.MultiheadAttention(dim, attention.num_heads)
    with torch.no_grad():
        module.in_proj_weight.copy_(attention.qkv.weight)
        module.in_proj_bias.copy_(attention.qkv.bias)
        module.out_proj.weight.copy_(attention.proj.weight)
        module.out_proj.bias.copy_(attention.proj.bias)
    return module


def run_blocks(
    blocks: list[Block], x: torch.Tensor, attend: Callable[[int, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    for index, block in enumerate(blocks):
        x = x + attend(index, block.norm1(x))
        x = x + block.mlp(block.norm2(x), (0, 0))  # the plain FFN ignores the grid
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit_tiny_patch16", help="a plain ViT/DeiT (FFN = Mlp)")
    parser.add_argument("--patch-size", type=int, default=None)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--depth", type=int, default=None, help="time only the first D blocks")
    parser.add_argument("--attn-impl", choices=["sdpa", "matmul"], default="sdpa")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model(args.model, img_size=args.image_size, patch_size=args.patch_size, attn_impl=args.attn_impl)
    blocks = list(model.blocks)[: args.depth]
    tokens = (args.image_size // model.patch_embed.proj.stride[0]) ** 2
    dim = blocks[0].attn.qkv.in_features
    first = torch.randn(args.batch, tokens, dim, requires_grad=True)
    second = first.detach().transpose(0, 1).contiguous().requires_grad_()
    modules = [multihead_attention(block) for block in blocks]

    variants: dict[str, tuple[torch.Tensor, Callable[[int, torch.Tensor], torch.Tensor]]] = {
        "batch-first (ours)": (first, lambda index, x: blocks[index].attn(x)),
        "batch-second": (second, lambda index, x: batch_second_attention(blocks[index].attn, x)),
        "nn.MultiheadAttention (N, B, C)": (second, lambda index, x: modules[index](x, x, x, need_weights=False)[0]),
    }
    with torch.no_grad():
        reference = run_blocks(blocks, first, variants["batch-first (ours)"][1])
        for name, (inputs, attend) in variants.items():
            out = run_blocks(blocks, inputs, attend)
            out = out if inputs is first else out.transpose(0, 1)
            torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4, msg=f"{name} computes another function")

    def step(inputs: torch.Tensor, attend: Callable[[int, torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        return lambda: run_blocks(blocks, inputs, attend).sum().backward()

    print(
        f"{args.model}, {len(blocks)} blocks, {tokens} tokens, width {dim}, batch {args.batch}, "
        f"attention {args.attn_impl}, fp32, {torch.get_num_threads()} threads; fwd+bwd ms per step"
    )
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(2):  # alternate, so a change in the host's speed hits every variant
        for name, (inputs, attend) in variants.items():
            results[name] += window_ms(step(inputs, attend), args.repeats, args.iterations, warmup=2)
    baseline = statistics.median(results["batch-first (ours)"])
    for name, windows in results.items():
        median = statistics.median(windows)
        print(
            f"{name:34s} {median:8.1f} ms  (min {min(windows):.1f}, max {max(windows):.1f})  x{baseline / median:.3f}"
        )


if __name__ == "__main__":
    main()
