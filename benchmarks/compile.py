"""TokenFormerLM training step: eager vs ``torch.compile``, fp32 vs bf16, fused vs reference.

One step = forward with loss, backward, AdamW step. For each precision the eager model (fused
Pattention, then the reference path) and the compiled model are timed interleaved on the same
batch (see common.py for why the minimum is the number to compare). Also reports the graph count
and graph breaks from ``torch._dynamo.explain`` and the recompilations seen while timing.

    python benchmarks/compile.py                       # demo size: preset small, 16 × 256
    python benchmarks/compile.py --preset tiny --batch 4 --seq 64 --rounds 3   # smoke run

Targets (issue 8): compiled / eager < 1.0 in fp32 and bf16; bf16 tokens/s >= 2.5x fp32.
Prints a markdown section for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_clock_args, apply_clock_args, autocast, command_line, interleaved, machine

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.nn.kernels import cpu_theta as kernels
from tokenformer.nn.pattention import set_pattention_impl


def make_step(model: torch.nn.Module, forward, opt: torch.optim.Optimizer, ids: torch.Tensor,
              precision: str, impl: str):
    def step() -> None:
        set_pattention_impl(model, impl)
        with autocast(precision):
            loss = forward(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    add_clock_args(parser)
    args = parser.parse_args(argv)
    clock = apply_clock_args(args)

    torch.manual_seed(0)
    config = TokenFormerConfig.from_name(args.preset)
    model = TokenFormerLM(config)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model)
    tokens = args.batch * args.seq
    # The same model with impl="kernel" (tokenformer.nn.kernels.cpu_theta), a copy with its own
    # optimizer and compiled module, so that switching impls never invalidates a compiled graph.
    with_kernel = kernels.available()
    if with_kernel:
        model_k = copy.deepcopy(model)
        set_pattention_impl(model_k, "kernel")
        opt_k = torch.optim.AdamW(model_k.parameters(), lr=1e-4)
        compiled_k = torch.compile(model_k)

    explain = torch._dynamo.explain(model)(ids, labels=ids)
    explain_k = torch._dynamo.explain(model_k)(ids, labels=ids) if with_kernel else None
    torch._dynamo.reset()
    print("## Compile (issue 8)\n")
    print(f"Command: `{command_line()}`  ")
    print(f"Machine: {machine()}; timing: {clock}  ")
    print(f"Training step (forward + loss, backward, AdamW) of preset `{args.preset}` "
          f"({model.num_parameters() / 1e6:.2f}M parameters) on {args.batch}×{args.seq} tokens; "
          f"min (median) over {args.rounds} interleaved rounds. `torch._dynamo.explain`: "
          f"{explain.graph_count} graph(s), {explain.graph_break_count} graph break(s)"
          + (f"; with impl=kernel {explain_k.graph_count} graph(s), "
             f"{explain_k.graph_break_count} graph break(s)" if with_kernel else
             f"; impl=kernel not timed: {kernels.unavailable_reason()}") + ".\n")
    print("| precision | eager reference ms | eager fused ms | compiled (fused) ms | "
          "compiled / eager fused | eager kernel ms | compiled (kernel) ms | "
          "compiled / eager kernel | compile time s | tokens/s (best) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    best_rate = {}
    for precision in args.precisions:
        steps = {"reference": make_step(model, model, opt, ids, precision, "reference"),
                 "fused": make_step(model, model, opt, ids, precision, "fused"),
                 "compiled": make_step(model, compiled, opt, ids, precision, "fused")}
        if with_kernel:
            steps["kernel"] = make_step(model_k, model_k, opt_k, ids, precision, "kernel")
            steps["compiled kernel"] = make_step(model_k, compiled_k, opt_k, ids, precision,
                                                 "kernel")
            steps["compiled kernel"]()
        start = time.perf_counter()
        steps["compiled"]()  # first call compiles (forward and backward graphs)
        compile_s = time.perf_counter() - start
        t = interleaved(steps, args.rounds, warmup=1)
        best = min(v["min"] for v in t.values())
        best_rate[precision] = tokens / best

        def cell(name: str, t=t) -> str:
            return f"{1e3 * t[name]['min']:.0f} ({1e3 * t[name]['median']:.0f})"

        kernel_cells = (f"{cell('kernel')} | {cell('compiled kernel')} | "
                        f"{t['compiled kernel']['min'] / t['kernel']['min']:.2f}x"
                        if with_kernel else "| |")
        print(f"| {precision} | {cell('reference')} | {cell('fused')} | {cell('compiled')} | "
              f"{t['compiled']['min'] / t['fused']['min']:.2f}x | {kernel_cells} | "
              f"{compile_s:.0f} | {best_rate[precision]:,.0f} |", flush=True)
    counters = torch._dynamo.utils.counters
    recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
    print(f"\nRecompilations while timing: {recompiles} (one graph per precision is expected: "
          f"autocast state is a guard).")
    if {"fp32", "bf16"} <= set(best_rate):
        print(f"bf16 / fp32 tokens/s (best of each): "
              f"{best_rate['bf16'] / best_rate['fp32']:.2f}x (target >= 2.5x).")
    print()


if __name__ == "__main__":
    main()
