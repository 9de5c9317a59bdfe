"""Why bf16 barely speeds up a demo-size training step on this CPU: the attention kernel.

1. Forward + backward of causal attention at the demo shape (batch 16, 4 heads, 256 tokens,
   head_dim 32) with torch's SDPA kernels (flash, math) and with plain ``bmm`` + float32 softmax,
   in fp32 and bf16.
2. The share of SDPA in a bf16 training step of the demo TokenFormer (``torch.profiler``).

    python benchmarks/attention.py --cpu-time

Prints a markdown section for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    add_clock_args,
    apply_clock_args,
    autocast,
    command_line,
    interleaved,
    machine,
)

from tokenformer import TokenFormerConfig, TokenFormerLM


def attention_calls(B: int, H: int, T: int, D: int, dtype: torch.dtype) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def sdpa(backend):
        def run() -> None:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        return run

    def bmm() -> None:
        scores = (q @ k.transpose(-1, -2) * D ** -0.5).masked_fill(~causal, float("-inf"))
        (torch.softmax(scores.float(), -1).to(dtype) @ v).backward(grad)

    return {"SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION), "SDPA math": sdpa(SDPBackend.MATH),
            "bmm + float32 softmax": bmm}


def sdpa_share(preset: str, batch: int, seq: int) -> float:
    """Fraction of a bf16 training step's self CPU time in SDPA (forward + backward)."""
    from torch.profiler import profile

    torch.manual_seed(0)
    model = TokenFormerLM(TokenFormerConfig.from_name(preset, max_seq_len=seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))

    def step() -> None:
        with autocast("bf16"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    with profile() as prof:
        for _ in range(3):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key) / total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="16x4x256x32", help="batch×heads×tokens×head_dim")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--preset", default="small", help="model for the profile share")
    add_clock_args(parser)
    args = parser.parse_args(argv)
    clock = apply_clock_args(args)
    B, H, T, D = (int(v) for v in args.shape.lower().split("x"))
    times = {p: interleaved(attention_calls(B, H, T, D, dtype), args.rounds)
             for p, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    share = sdpa_share(args.preset, B, T)

    print("## Attention on the CPU (issue 8)\n")
    print(f"Command: `{command_line()}`  ")
    print(f"Machine: {machine()}; timing: {clock}  ")
    print(f"Causal attention forward + backward, batch {B}, {H} heads, {T} tokens, head_dim {D}; "
          f"min over {args.rounds} interleaved rounds, ms.\n")
    print("| implementation | fp32 ms | bf16 ms | bf16 / fp32 time |")
    print("|---|---|---|---|")
    for name in times["fp32"]:
        f32, b16 = times["fp32"][name]["min"], times["bf16"][name]["min"]
        print(f"| {name} | {1e3 * f32:.1f} | {1e3 * b16:.1f} | {b16 / f32:.2f} |")
    print(f"\nIn a bf16 training step of preset `{args.preset}` ({B} × {T} tokens, profiler, "
          f"3 steps) SDPA takes **{share:.0%}** of the self CPU time.\n")


if __name__ == "__main__":
    main()
