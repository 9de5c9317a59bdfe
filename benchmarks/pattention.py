"""Pattention vs a plain two-matmul MLP of the same shapes: forward + backward time ratio.

Both sides compute ``x·Kᵀ → (Θ | GELU) → ·V`` with K [n, d] and V [n, d]; the only difference is
Θ's row normalisation (``l2_norm_gelu``: a norm over the n scores, a divide and a scale before the
GELU). Repetitions of the two are interleaved (alternating which goes first) and the ratio of the
medians is reported, so slow drift of a shared machine affects both sides alike. Target: <= 1.05x.

    python benchmarks/pattention.py                  # default shapes, fp32 and bf16 autocast
    python benchmarks/pattention.py --reps 15 --shapes 768x3072
    python benchmarks/pattention.py --threads 1 --clock cpu   # on a machine shared with others

Prints a markdown section (machine, command, table) to paste into benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, machine

from tokenformer import Pattention
from tokenformer.nn import pattention as pattention_module


class TwoMatmulMLP(nn.Module):
    """The baseline: ``GELU(x·Kᵀ)·V``, i.e. an MLP with K as W_in and V as W_outᵀ, no biases."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.key_param_tokens = nn.Parameter(torch.randn(n, d) * 0.02)
        self.value_param_tokens = nn.Parameter(torch.randn(n, d) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ self.key_param_tokens.t()) @ self.value_param_tokens


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def step_seconds(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, bf16: bool,
                 clock: Callable[[], float]) -> float:
    """Time of one forward + backward (parameter and input gradients) on ``clock``."""
    for p in module.parameters():
        p.grad = None
    x.grad = None
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
                else contextlib.nullcontext())
    start = clock()
    with autocast:
        y = module(x)
    y.backward(grad.to(y.dtype))
    return clock() - start


def compare(tokens: int, d: int, n: int, bf16: bool, reps: int, warmup: int, impl: str,
            clock: Callable[[], float]) -> dict[str, float]:
    torch.manual_seed(0)
    kwargs = {} if impl == "default" else {"impl": impl}
    pattention, mlp = Pattention(d, d, n, **kwargs), TwoMatmulMLP(d, n)
    x = torch.randn(tokens, d, requires_grad=True)
    grad = torch.randn(tokens, d)
    times: dict[str, list[float]] = {"pattention": [], "mlp": []}
    for rep in range(warmup + reps):
        order = [("pattention", pattention), ("mlp", mlp)]
        if rep % 2:
            order.reverse()
        for name, module in order:
            t = step_seconds(module, x, grad, bf16, clock)
            if rep >= warmup:
                times[name].append(t)
    p, m = statistics.median(times["pattention"]), statistics.median(times["mlp"])
    return {"pattention_ms": 1e3 * p, "mlp_ms": 1e3 * m, "ratio": p / m}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--shapes", nargs="+", default=["384x1536", "768x1536", "768x3072"],
                        help="d×n pairs (hidden size × parameter tokens)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="'cpu' (process CPU time) is robust to other jobs on a shared "
                             "machine; use it with --threads 1")
    parser.add_argument("--impls", nargs="+", default=None,
                        help="Pattention implementations to time (default: every one the "
                             "installed version has besides 'auto', else its only path)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    impls = args.impls or [i for i in getattr(pattention_module, "PATTENTION_IMPLS", ["default"])
                           if i != "auto"]

    tokens = args.batch * args.seq
    print("## Pattention vs MLP (issue 2)\n")
    print(f"Command: `{command_line()}`  ")
    print(f"Machine: {machine()}  ")
    print(f"Forward + backward of `Pattention(d, d, n)` (Θ = l2_norm_gelu) vs "
          f"`GELU(x·Kᵀ)·V` on {args.batch}×{args.seq} = {tokens} tokens; median of "
          f"{args.reps} interleaved repetitions after {args.warmup} warm-up, {args.clock} clock. "
          f"Target <= 1.05x.\n")
    print("| d | n | dtype | Pattention impl | Pattention ms | MLP ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        d, n = (int(v) for v in shape.lower().split("x"))
        for dtype in args.dtypes:
            for impl in impls:
                r = compare(tokens, d, n, dtype == "bf16", args.reps, args.warmup, impl,
                            CLOCKS[args.clock])
                print(f"| {d} | {n} | {dtype}{' autocast' if dtype == 'bf16' else ''} | {impl} | "
                      f"{r['pattention_ms']:.1f} | {r['mlp_ms']:.1f} | {r['ratio']:.3f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
