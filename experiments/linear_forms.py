"""The forms of a linear layer's products on CPU, alone: bias in the product or after it, and the
weight gradient from each operand layout.

    python experiments/linear_forms.py --tokens 8320 --width 192 --hidden 768 --repeats 30

Per layer shape (the ViT blocks' qkv, proj, fc1, fc2 at ``--width`` and ``--hidden``), bf16:

- forward: ``F.linear`` with bias, without bias, and oneDNN's linear with the bias inside the
  primitive (``torch.ops.mkldnn._linear_pointwise``, what ``vitrain.kernels.linear`` runs);
- weight gradient over the tokens, from contiguous operands: ``xT @ g`` (input copied feature-major),
  ``gT @ x`` (output gradient copied), and PyTorch's ``g.t() @ x`` on a transposed view;
- the whole weight-and-bias gradient as ``_Linear`` runs it without AMX tiles, for a layer that
  expands (copy ``x``, product, copy back, column sums) and for any other (copy ``g`` with its column
  sums, product); as PyTorch's autograd does (``g.t() @ x`` and ``g.sum(0)``); and on AMX tiles from
  the token-major operands (``weight_gradient``, where the CPU has AMX-BF16; for fc1 also with the
  GELU's backward inside, against ``gelu_backward`` and the tiles apart).

Median milliseconds of ``--repeats`` calls after warm-up; the operands stay in cache between calls,
so a training step, whose operands come from memory, runs each about 1.5-2x slower.
"""

from __future__ import annotations

import argparse
import functools

import timing
import torch
import torch.nn.functional as F

from vitrain import kernels

median_ms = functools.partial(timing.median_ms, warmup=5)


def layer_row(module, tokens: int, fan_in: int, fan_out: int, repeats: int) -> list[float]:  # noqa: ANN001
    x = torch.randn(tokens, fan_in).to(torch.bfloat16)
    weight = (torch.randn(fan_out, fan_in) / fan_in**0.5).to(torch.bfloat16)
    bias = torch.randn(fan_out).to(torch.bfloat16)
    g = torch.randn(tokens, fan_out).to(torch.bfloat16)
    x_t, g_t = x.t().contiguous(), g.t().contiguous()

    def expands() -> None:
        copied, _ = module.transpose_rows(x, False)
        module.transpose_rows(copied @ g, False)
        module.column_sums(g)

    def other() -> None:
        copied, _ = module.transpose_rows(g, True)
        copied @ x

    def pytorch() -> None:
        g.t() @ x
        g.sum(0)

    tiles = kernels.paths().amx_tiles
    h = torch.randn(tokens, fan_out).to(torch.bfloat16)

    def gelu_apart() -> None:
        dh, _ = module.gelu_backward(g, h, True)
        module.weight_gradient(dh, x, False)

    return [
        median_ms(lambda: F.linear(x, weight, bias), repeats),
        median_ms(lambda: F.linear(x, weight), repeats),
        median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], ""), repeats)
        if kernels.paths().bias_in_product  # oneDNN has no bf16 inner product on AVX2-only CPUs
        else float("nan"),
        median_ms(lambda: x_t @ g, repeats),
        median_ms(lambda: g_t @ x, repeats),
        median_ms(lambda: g.t() @ x, repeats),
        median_ms(expands, repeats),
        median_ms(other, repeats),
        median_ms(pytorch, repeats),
        median_ms(lambda: module.weight_gradient(g, x, True), repeats) if tiles else float("nan"),
        median_ms(gelu_apart, repeats) if tiles else float("nan"),
        median_ms(lambda: module.weight_gradient(g, x, True, gelu_input=h), repeats) if tiles else float("nan"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8320)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    module = kernels.load()
    if module is None:
        raise SystemExit("the fused CPU kernels did not build here; see the warning above")
    torch.manual_seed(0)
    shapes = {
        "qkv": (args.width, 3 * args.width),
        "proj": (args.width, args.width),
        "fc1": (args.width, args.hidden),
        "fc2": (args.hidden, args.width),
    }
    print(f"{args.tokens} tokens, bf16, ms (median of {args.repeats})")
    print(
        f"{'layer':>5} {'in->out':>9} | {'F.linear+b':>10} {'no bias':>8} {'b inside':>8} |"
        f" {'xT@g':>6} {'gT@x':>6} {'g.t()@x':>7} | {'expands':>7} {'other':>6} {'PyTorch':>7} {'tiles':>6} |"
        f" {'GELU+tiles apart':>16} {'GELU in tiles':>13}"
    )
    for name, (fan_in, fan_out) in shapes.items():
        row = layer_row(module, args.tokens, fan_in, fan_out, args.repeats)
        cells = [f"{v:{w}.2f}" for v, w in zip(row, (10, 8, 8, 6, 6, 7, 7, 6, 7, 6, 16, 13), strict=True)]
        print(
            f"{name:>5} {f'{fan_in}->{fan_out}':>9} | {' '.join(cells[:3])} | {' '.join(cells[3:6])} |"
            f" {' '.join(cells[6:10])} | {' '.join(cells[10:])}"
        )


if __name__ == "__main__":
    main()
