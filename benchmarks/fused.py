"""Fused vs reference Pattention vs a GELU MLP of the same shapes: time (eager and compiled) and
activation memory.

``benchmarks/pattention.py`` (issue 2) times the eager paths in wall time; this script adds what
the fused path is for: single-thread CPU time (robust on a shared machine, see common.py), the
same comparison under ``torch.compile`` (inductor fuses the Θ passes of the fused Function), the
bytes autograd keeps for the backward, and the peak tensor memory of one forward + backward (from
the profiler's allocation events: exact, unlike the resident set size).

    python benchmarks/fused.py --cpu-time                   # d=384, n=1536, 8×256 tokens
    python benchmarks/fused.py --cpu-time --shapes 384x384 768x3072 --no-compile

Targets (issue 8): fwd+bwd time / MLP <= 1.03x in fp32 and bf16; activation memory <= MLP's.
Prints a markdown section for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_clock_args, apply_clock_args, autocast, command_line, interleaved, machine

from tokenformer.nn.kernels import cpu_theta as kernels
from tokenformer.nn.kernels.fused import fused_pattention
from tokenformer.nn.pattention import Pattention, theta
from tokenformer.nn.profiling import peak_allocated_bytes

# "default": a Pattention module with nothing set (impl="auto": the kernel where it is available).
VARIANTS = ("mlp", "reference", "fused", "kernel", "default")


def forward_fn(variant: str):
    """``f(x, k, v)`` for one variant; the MLP is ``GELU(x·Kᵀ)·V`` (K as W_in, V as W_outᵀ)."""
    def mlp(x, k, v):
        return F.gelu(x @ k.t()) @ v

    def reference(x, k, v):
        return theta(x @ k.t(), "l2_norm_gelu", k.shape[0] ** 0.5) @ v

    def fused(x, k, v):
        return fused_pattention(x, k, v, "l2_norm_gelu", k.shape[0] ** 0.5)

    def kernel(x, k, v):
        return fused_pattention(x, k, v, "l2_norm_gelu", k.shape[0] ** 0.5, kernel=True)

    layers: dict[tuple[int, int], Pattention] = {}  # built once per (K, V), outside the timing

    def default(x, k, v):
        layer = layers.get((id(k), id(v)))
        if layer is None:
            layer = layers[id(k), id(v)] = Pattention(k.shape[1], v.shape[1], k.shape[0],
                                                      device="meta")
            # k and v themselves as the module's parameters (the benchmark reads their grads)
            layer._parameters.update(key_param_tokens=k, value_param_tokens=v)
        return layer(x)

    return {"mlp": mlp, "reference": reference, "fused": fused, "kernel": kernel,
            "default": default}[variant]


def tensors(tokens: int, d: int, n: int):
    torch.manual_seed(0)
    x = torch.randn(tokens, d, requires_grad=True)
    k = (torch.randn(n, d) * 0.02).requires_grad_()
    v = (torch.randn(n, d) * 0.02).requires_grad_()
    return x, k, v, torch.randn(tokens, d)


def step(fn, x, k, v, grad, precision: str) -> None:
    with autocast(precision):
        y = fn(x, k, v)
    y.backward(grad.to(y.dtype))
    x.grad = k.grad = v.grad = None


def saved_bytes(variant: str, tokens: int, d: int, n: int, precision: str) -> int:
    """Bytes of the tensors autograd keeps for the backward, leaves (x, K, V) excluded."""
    x, k, v, _ = tensors(tokens, d, n)
    leaves = {t.untyped_storage().data_ptr() for t in (x, k, v)}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in leaves:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(precision):
        forward_fn(variant)(x, k, v)
    return sum(storages.values())


def peak_bytes(variant: str, tokens: int, d: int, n: int, precision: str) -> int:
    """Peak tensor memory one forward + backward adds (profiler allocation events; the leaves
    x, K, V exist before and are not counted, their float32 gradients are)."""
    x, k, v, grad = tensors(tokens, d, n)
    fn = forward_fn(variant)
    step(fn, x, k, v, grad, precision)  # warm-up: lazy initialisation outside the measurement
    return peak_allocated_bytes(lambda: step(fn, x, k, v, grad, precision))


def profile_table(variant: str, tokens: int, d: int, n: int, precision: str, rows: int) -> str:
    """torch.profiler table (self CPU time) of 5 forward + backward steps."""
    from torch.profiler import profile

    x, k, v, grad = tensors(tokens, d, n)
    fn = forward_fn(variant)
    for _ in range(2):
        step(fn, x, k, v, grad, precision)
    with profile() as prof:
        for _ in range(5):
            step(fn, x, k, v, grad, precision)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows,
                                     max_name_column_width=32)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--shapes", nargs="+", default=["384x1536"], help="d×n pairs")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="print torch.profiler tables of each eager variant instead")
    add_clock_args(parser)
    args = parser.parse_args(argv)
    clock = apply_clock_args(args)
    tokens = args.batch * args.seq
    if args.profile:
        for shape in args.shapes:
            d, n = (int(s) for s in shape.lower().split("x"))
            for precision in args.precisions:
                for variant in VARIANTS:
                    print(f"### {variant}, d={d}, n={n}, {precision}, {tokens} tokens, "
                          f"5 steps ({clock})\n\n```")
                    print(profile_table(variant, tokens, d, n, precision, rows=12) + "```\n")
        return

    print("## Fused Pattention (issue 8)\n")
    print(f"Command: `{command_line()}`  ")
    print(f"Machine: {machine()}; timing: {clock}  ")
    kernel = (f"the C++ Θ kernel (tokenformer.nn.kernels.cpu_theta, {kernels.build_name()})"
              if kernels.available() else
              f"UNAVAILABLE, ran the fused path: {kernels.unavailable_reason()}")
    print(f"Variant `kernel`: {kernel}; `default`: a `Pattention` with nothing set "
          f"(impl auto)  ")
    print(f"Forward + backward (grads of x, K, V) of `Θ(x·Kᵀ)·V` with Θ = l2_norm_gelu vs "
          f"`GELU(x·Kᵀ)·V`, {args.batch}×{args.seq} = {tokens} tokens; min (median) ms over "
          f"{args.rounds} interleaved rounds; ratio of minima to the MLP of the same mode. "
          f"Memory: bytes saved for backward (leaves excluded) and the peak tensor memory one "
          f"step adds (profiler allocation events).\n")
    print("| d | n | dtype | mode | variant | ms | / MLP | saved MB | peak MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        d, n = (int(s) for s in shape.lower().split("x"))
        x, k, v, grad = tensors(tokens, d, n)
        for precision in args.precisions:
            modes = {"eager": {name: forward_fn(name) for name in VARIANTS}}
            if not args.no_compile:
                modes["compiled"] = {name: torch.compile(forward_fn(name))
                                     for name in ("mlp", "fused", "kernel", "default")}
            for mode, fns in modes.items():
                data = (x, k, v, grad, precision)
                t = interleaved({name: (lambda fn=fn, data=data: step(fn, *data))
                                 for name, fn in fns.items()}, args.rounds)
                for name in fns:
                    memory = "| |"
                    if mode == "eager":
                        memory = (f"{saved_bytes(name, tokens, d, n, precision) / 2**20:.1f} | "
                                  f"{peak_bytes(name, tokens, d, n, precision) / 2**20:.1f} |")
                    print(f"| {d} | {n} | {precision} | {mode} | {name} | "
                          f"{1e3 * t[name]['min']:.1f} ({1e3 * t[name]['median']:.1f}) | "
                          f"{t[name]['min'] / t['mlp']['min']:.3f}x | {memory}", flush=True)
    print()


if __name__ == "__main__":
    main()
