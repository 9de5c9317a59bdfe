"""Stage ``pattention``: forward + backward of one Pattention (the ``--pattention-impls``: fused,
reference, triton) vs the two-matmul GELU MLP of the same shapes (benchmarks/pattention.py's
``TwoMatmulMLP``) at the FFN shapes of the 150M (d 768, n 3072) and 1.5B (d 1536, n 6144)
models, 8 × 2048 tokens, bf16 autocast, eager and compiled, interleaved; each row ÷ the MLP in
its mode and ÷ the faster of the eager and compiled MLP (the goal: ≤ 1.05). Then, unless
``--no-qkv``, Q/K/V at the first shape's d (n = d) one by one (fused, triton) vs one GEMM
(triton, PyTorch Θ). Each layer is a worker (``workers``): the compiles run at once."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from common import synchronized
from pattention import TwoMatmulMLP

from tokenformer import Pattention
from tokenformer.nn.grouped import grouped_attend

from .base import COMPILE_MODES, StageContext, free_memory
from .workers import Pool, interleave

MLP = "MLP GELU(x·Kᵀ)·V"
QKV_BASE = "Q/K/V one by one, fused"


class QKV(torch.nn.Module):
    """Three Pattentions of one input (an attention block's Q, K, V), one by one or as one
    GEMM (:func:`tokenformer.nn.grouped.grouped_attend`); the outputs summed, so one backward."""

    def __init__(self, d: int, n: int, impl: str, grouped: bool, device: torch.device) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Pattention(d, d, n, impl=impl, device=device)
                                          for _ in range(3))
        self.grouped = grouped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys = grouped_attend(x, list(self.layers)) if self.grouped else [p(x) for p in self.layers]
        return ys[0] + ys[1] + ys[2]


def build_layer(name: str, d: int, n: int, device: torch.device) -> torch.nn.Module:
    """A layer by its row name: ``Pattention IMPL``, the MLP, or a Q/K/V block."""
    if name == MLP:
        return TwoMatmulMLP(d, n).to(device)
    if name.startswith("Pattention "):
        return Pattention(d, d, n, impl=name.split()[1], device=device)
    grouped = "one GEMM" in name
    impl = "triton" if name.endswith("triton") else "fused"
    return QKV(d, n, impl, grouped, device)


def fwd_bwd(module: torch.nn.Module, params: list[torch.Tensor], x: torch.Tensor,
            grad: torch.Tensor) -> Callable[[], None]:
    """One forward + backward under bf16 autocast (gradients of X and the parameters)."""
    def step() -> None:
        for p in (*params, x):
            p.grad = None
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            y = module(x)
        y.backward(grad.to(y.dtype))
    return step


class LayerCandidate:
    """One layer at one shape, eager and compiled (warmed up: compiled) in a worker."""

    def __init__(self, name: str, d: int, n: int, tokens: int, modes: list[str],
                 device: str) -> None:
        self.device = torch.device(device)
        torch.manual_seed(0)
        layer = build_layer(name, d, n, self.device)
        x = torch.randn(tokens, d, device=self.device, requires_grad=True)
        grad = torch.randn(tokens, d, device=self.device)
        start = time.perf_counter()
        self.fns = {mode: synchronized(fwd_bwd(torch.compile(layer) if mode == "compiled"
                                               else layer, list(layer.parameters()), x, grad),
                                       self.device) for mode in modes}
        for fn in self.fns.values():  # compiles
            fn()
        self.info = {"warmup_s": time.perf_counter() - start}

    def time(self, mode: str) -> float:
        start = time.perf_counter()
        self.fns[mode]()
        return time.perf_counter() - start


def pattention_stage(ctx: StageContext) -> dict[str, Any]:
    sizes, args, device = ctx.sizes, ctx.args, ctx.device
    modes = [m for m in COMPILE_MODES if m in args.modes]
    tokens = sizes.pattention_tokens
    shapes = ([tuple(int(v) for v in s.lower().split("x")) for s in args.pattention_shapes]
              if args.pattention_shapes else sizes.pattention_shapes)
    groups = [((d, n), [*(f"Pattention {impl}" for impl in args.pattention_impls), MLP], MLP,
               12 * tokens * d * n) for d, n in shapes]
    if args.qkv:
        d = shapes[0][0]
        groups.append(((d, d), [QKV_BASE, "Q/K/V one by one, triton", "Q/K/V one GEMM, triton",
                                "Q/K/V one GEMM, PyTorch Θ"], QKV_BASE, 3 * 12 * tokens * d * d))
    specs = {(d, n, name): (LayerCandidate, {"name": name, "d": d, "n": n, "tokens": tokens,
                                             "modes": modes, "device": str(device)})
             for (d, n), names, _, _ in groups for name in names}
    r = result([], notes(sizes, args))
    with Pool(specs, processes=ctx.processes, backend=sizes.compile_backend) as pool:
        pool.start(deadline=ctx.deadline - 15, label="pattention")
        r["notes"] += [f"{key[2]} at {key[0]} × {key[1]}: {e}" for key, e in pool.errors().items()]
        for (d, n), names, base, flops in groups:  # one shape at a time, saved as it ends
            calls = {(name, mode): ((d, n, name), "time", (mode,))
                     for name in names if (d, n, name) in pool.ready() for mode in modes}
            times, errors = interleave(pool, calls, sizes.pattention_rounds, warmup=2,
                                       deadline=ctx.deadline - 5)
            r["notes"] += [f"{name} {mode} at {d} × {n}: {e}" for (name, mode), e in errors.items()]
            r["rows"] += shape_rows(times, base, flops, {"d": d, "n": n})
            ctx.save(r)
    free_memory()
    r["notes"] += goals(r["rows"])
    return r


def goals(rows: list[dict[str, Any]]) -> list[str]:
    """Per FFN shape: the fastest Pattention row ÷ the faster MLP against the goal (≤ 1.05)."""
    notes = []
    for d, n in dict.fromkeys((r["d"], r["n"]) for r in rows if r["layer"].startswith("Patt")):
        best = min((r for r in rows if (r["d"], r["n"]) == (d, n) and r["vs_faster_mlp"]
                    and r["layer"].startswith("Pattention")), key=lambda r: r["ms"], default=None)
        if best:
            ratio = best["vs_faster_mlp"]
            notes.append(f"{d} × {n}: the fastest Pattention ({best['layer']}, {best['mode']}) "
                         f"is {ratio:.3f}× the faster MLP ({'met' if ratio <= 1.05 else 'not met'}"
                         f": goal ≤ 1.05)")
    return notes


def shape_rows(times: dict, base: str, flops: float, shape: dict[str, int]
               ) -> list[dict[str, Any]]:
    """One row per (layer, mode): its time, TFLOP/s and its ratios to ``base`` in its mode and
    to the faster mode of ``base``."""
    faster = min((t["min"] for (name, _), t in times.items() if name == base), default=None)
    return [{**shape, "layer": name, "mode": mode, "ms": 1e3 * t["min"],
             "tflops": flops / t["min"] / 1e12,
             "vs_mlp": t["min"] / times[base, mode]["min"] if (base, mode) in times else None,
             "vs_faster_mlp": t["min"] / faster if faster else None}
            for (name, mode), t in times.items()]


def notes(sizes: Any, args: Any) -> list[str]:
    return [f"Forward + backward (dX, dK, dV) on {sizes.pattention_tokens} tokens, bf16 "
            f"autocast, fp32 parameters; best of {sizes.pattention_rounds} interleaved calls after "
            f"2 warm-up (compiles). TFLOP/s from the matmuls' 12·T·d·n. ÷ MLP: in the same mode; "
            f"÷ faster MLP: over the faster of the eager and compiled MLP (goal, issue 43: "
            f"Pattention ≤ 1.05 at 768 × 3072 and 1536 × 6144).",
            "impl=triton: the Triton Θ (tokenformer.nn.kernels.triton_theta); on a machine "
            "without it, it runs the fused path."] + (
           ["Q/K/V rows: the three Q/K/V Pattentions of an attention block (n = d), one by one "
            "or as one GEMM (tokenformer.nn.grouped); ÷ the one-by-one fused time, and the "
            "TFLOP/s of their 3 × 12·T·d·n."] if args.qkv else [])


def result(rows: list[dict[str, Any]], notes_: list[str]) -> dict[str, Any]:
    return {"title": "Pattention vs MLP", "rows": rows, "notes": notes_,
            "columns": [("d", "d", "{}"), ("n", "n", "{}"), ("layer", "layer", "{}"),
                        ("mode", "mode", "{}"), ("ms", "ms", "{:.3f}"),
                        ("tflops", "TFLOP/s", "{:.3g}"), ("vs_mlp", "÷ MLP", "{:.3f}x"),
                        ("vs_faster_mlp", "÷ faster MLP", "{:.3f}x")]}
