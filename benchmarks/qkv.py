"""One GEMM for Q, K and V (tokenformer.nn.grouped) vs three Pattentions: forward + backward of
one attention block of a TokenFormer on this machine (docs/performance.md, "One GEMM for Q, K
and V").

    python benchmarks/qkv.py --cpu-time                       # d 768, n 768, 2 × 512 tokens
    python benchmarks/qkv.py --cpu-time --shape 768x768 --tokens 2x256

Prints a markdown section for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_clock_args, apply_clock_args, command_line, interleaved, machine

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.nn.pattention import set_pattention_impl


def block_step(d: int, n: int, batch: int, seq: int, impl: str):
    """(step(grouped) → None): forward + backward of block 0 of a one-layer TokenFormer of width
    ``d`` and ``n`` Q/K/V tokens, its attention's Q/K/V grouped or not."""
    torch.manual_seed(0)
    config = TokenFormerConfig.from_name("small", hidden_size=d, num_heads=max(1, d // 64),
                                         num_layers=1, qkv_tokens=n, proj_tokens=n,
                                         ffn_tokens=4 * n, max_seq_len=max(seq, 128))
    model = TokenFormerLM(config)
    set_pattention_impl(model, impl)
    block = model.layers[0]
    x = torch.randn(batch, seq, d, requires_grad=True)
    positions = torch.arange(seq).expand(batch, seq)

    def step(grouped: bool) -> None:
        block.attention.grouped_qkv = grouped
        out = block.attention(block.input_layernorm(x), model.rotary, positions, None, None)
        out.square().mean().backward()

    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="768x768", help="d×n (the 150M model's Q/K/V)")
    parser.add_argument("--tokens", default="2x512", help="batch×seq")
    parser.add_argument("--impl", default="auto", help="the Pattentions' impl")
    parser.add_argument("--rounds", type=int, default=10)
    add_clock_args(parser)
    args = parser.parse_args(argv)
    clock = apply_clock_args(args)
    d, n = (int(v) for v in args.shape.lower().split("x"))
    batch, seq = (int(v) for v in args.tokens.lower().split("x"))
    step = block_step(d, n, batch, seq, args.impl)
    times = interleaved({"separate": lambda: step(False), "grouped": lambda: step(True)},
                        args.rounds)
    print("## One GEMM for Q, K and V (issue 33)\n")
    print(f"Command: `{command_line()}`  \n{machine()}; {clock}\n")
    print("| Q/K/V | forward + backward ms (min) | median | ÷ separate |")
    print("|---|---|---|---|")
    base = times["separate"]["min"]
    for name, t in times.items():
        print(f"| {name} | {t['min'] * 1e3:.2f} | {t['median'] * 1e3:.2f} | "
              f"{t['min'] / base:.3f}x |")
    print(f"\n* One attention block (Q, K, V, attention, proj) of d {d}, n {n}, {batch}×{seq} "
          f"tokens, fp32, impl={args.impl}; best of {args.rounds} interleaved calls.")


if __name__ == "__main__":
    main()
