"""Cost of each elementwise pass the fused Pattention makes over the [L, n] scores, next to the
matmuls, at one shape: the floor of any eager (unfused) implementation (docs/performance.md).

    python benchmarks/theta_passes.py --cpu-time              # L=2048, d=384, n=1536
    python benchmarks/theta_passes.py --cpu-time --shape 2048x384x3072

Prints a markdown section for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_clock_args, apply_clock_args, command_line, interleaved, machine

from tokenformer.nn.kernels import cpu_theta as kernels


def passes(L: int, d: int, n: int, dtype: torch.dtype) -> dict[str, object]:
    """The fused path's operations beyond the MLP's, and the MLP's own, as zero-argument calls."""
    g = torch.Generator().manual_seed(0)
    s, grad = (torch.randn(L, n, generator=g, dtype=dtype) for _ in range(2))
    x, k = torch.randn(L, d, generator=g, dtype=dtype), torch.randn(n, d, generator=g, dtype=dtype)
    row = torch.rand(L, 1, generator=g, dtype=dtype) + 0.5
    buffer = torch.empty_like(s)
    ops = {
        "matmul x·Kᵀ (one of the 6 an MLP step makes)": lambda: x @ k.t(),
        "GELU (MLP too)": lambda: F.gelu(s),
        "GELU backward (MLP too)": lambda: torch.ops.aten.gelu_backward(grad, s),
        "row norm (fused forward)": lambda: torch.linalg.vector_norm(s, dim=-1, keepdim=True),
        "row scale in place (fused forward)": lambda: s.mul_(row),
        "GELU recompute (fused backward)": lambda: torch.ops.aten.gelu.out(s, out=buffer),
        "row dot (fused backward)": lambda: torch.mul(grad, s, out=buffer).sum(-1, keepdim=True),
        "addcmul correction (fused backward)": lambda: grad.addcmul_(s, row),
    }
    if kernels.available():  # the C++ kernel's two passes replace all of the above but matmuls
        scale = n ** 0.5
        norms = kernels.theta_forward(s, scale, 0.0)[1]
        s2, grad2 = s.clone(), grad.clone()  # the backward works in place: its own copies
        ops["Θ kernel forward (norm, scale, GELU: one pass; kernel)"] = \
            lambda: kernels.theta_forward(s, scale, 0.0)
        ops["Θ kernel backward (Θ and dS in place: one pass; kernel)"] = \
            lambda: kernels.theta_backward(grad2, s2, norms, scale, 0.0)
    return ops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="2048x384x1536", help="L×d×n")
    parser.add_argument("--rounds", type=int, default=15)
    add_clock_args(parser)
    args = parser.parse_args(argv)
    clock = apply_clock_args(args)
    L, d, n = (int(v) for v in args.shape.lower().split("x"))
    results = {p: interleaved(passes(L, d, n, dtype), args.rounds)
               for p, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}

    print("## Θ passes (issue 8)\n")
    print(f"Command: `{command_line()}`  ")
    print(f"Machine: {machine()}; timing: {clock}  ")
    print(f"Each operation alone on [{L}, {n}] scores (d = {d}), min over {args.rounds} "
          f"interleaved rounds, ms. The fused Pattention's extra passes over an MLP are the four "
          f"marked 'fused'; 'floor' is their sum against a 6-matmul MLP step. The C++ kernel "
          f"(impl='kernel') replaces GELU, its backward and all four by the two passes marked "
          f"'kernel'.\n")
    print("| operation | fp32 ms | bf16 ms |")
    print("|---|---|---|")
    for name in results["fp32"]:
        print(f"| {name} | {1e3 * results['fp32'][name]['min']:.2f} | "
              f"{1e3 * results['bf16'][name]['min']:.2f} |")
    for p, r in results.items():
        extra = sum(v["min"] for name, v in r.items() if "fused" in name)
        gelu = sum(v["min"] for name, v in r.items() if "MLP too" in name)
        mlp = 6 * r[next(iter(r))]["min"] + gelu
        print(f"\n{p}: extra passes {1e3 * extra:.2f} ms against an MLP step of ≈ "
              f"{1e3 * mlp:.1f} ms (6 matmuls + GELU and its backward): floor ≈ "
              f"{1 + extra / mlp:.3f}x for an eager implementation.", end="")
        kernel = sum(v["min"] for name, v in r.items() if "kernel)" in name)
        if kernel:
            print(f" The kernel's two passes take {1e3 * kernel:.2f} ms where the MLP's GELU "
                  f"and GELU backward take {1e3 * gelu:.2f}: ≈ "
                  f"{1 + (kernel - gelu) / mlp:.3f}x.", end="")
    print("\n")


if __name__ == "__main__":
    main()
