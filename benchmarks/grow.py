"""Time growing a TokenFormer-150M-size model (random weights) on this machine.

    python benchmarks/grow.py [--repeats 3] [--preset tokenformer-150m]

Cases: FFN 3072 → 6144 tokens, Q/K/V and proj 768 → 1536 tokens, both, one extra block, each with
``exact`` (and ``official`` for the FFN case), plus the optimizer carry-over (AdamW moments).
``copy=True`` (the default) copies every tensor; ``copy=False`` shares the tensors that do not
grow with the input model (what the trainer and the CLI use). Each time is the best of
``--repeats`` runs in a warm process: the one-off cost of the first
growth in a process (torch imports its meta-device kernels, ~1-4 s) is printed separately.
The max |Δlogit| on a 1×16 probe batch is printed for each case, and, as the floor growth cannot
beat, the time to write as many bytes of freshly allocated memory.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.grow import grow, grow_with_optimizer, max_logit_change

CASES = [
    ("ffn 3072 → 6144 (exact)", dict(ffn="2x")),
    ("ffn 3072 → 6144 (official)", dict(ffn="2x", strategy="official")),
    ("qkv, proj 768 → 1536 (exact)", dict(qkv="2x", proj="2x")),
    ("qkv, proj, ffn 2x (exact)", dict(qkv="2x", proj="2x", ffn="2x")),
    ("12 → 13 layers (exact)", dict(layers=13)),
]


def best_of(repeats: int, fn) -> tuple[str, object]:
    """Best wall-clock and best CPU time (this process, all threads, page faults included) of
    ``repeats`` calls: on a shared machine the CPU time is the stable number."""
    wall, cpu, result = float("inf"), float("inf"), None
    for _ in range(repeats):
        result = None
        gc.collect()
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return f"{wall:.2f} s ({cpu:.2f} s CPU)", result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tokenformer-150m")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    start = time.perf_counter()
    model = TokenFormerLM(TokenFormerConfig.from_name(args.preset)).eval()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{args.preset}: {model.num_parameters():,} parameters, built in "
          f"{time.perf_counter() - start:.2f} s; torch threads {torch.get_num_threads()}; "
          f"load average {load}")
    start = time.perf_counter()
    tiny = TokenFormerLM(TokenFormerConfig.from_name("tiny"))
    grow(tiny, ffn="2x")
    print(f"first growth in a process (one-off imports): {time.perf_counter() - start:.2f} s")

    # The floor: writing as many fresh bytes as the FFN 2x growth must (its grown tensors), and as
    # a full copy of the grown model must (copy=True).
    grown_ffn = 2 * model.config.num_layers * 2 * model.config.ffn_tokens * model.config.hidden_size
    for label, numel in (("grown FFN tensors", grown_ffn),
                         ("whole grown model", model.num_parameters() + grown_ffn // 2)):
        seconds, _ = best_of(args.repeats, lambda n=numel: torch.empty(n).fill_(1.0))
        print(f"floor: writing {numel * 4 / 1e6:,.0f} MB of fresh memory ({label}): {seconds}")
    print(f"\n| case (best of {args.repeats}) | grown parameters | copy=True | copy=False "
          f"| max abs Δlogit |")
    print("|---|---|---|---|---|")
    for name, kwargs in CASES:
        generator = torch.Generator().manual_seed(0)
        times = []
        for copy in (True, False):
            seconds, grown = best_of(args.repeats, lambda kw=kwargs, g=generator, c=copy: grow(
                model, generator=g, copy=c, **kw))
            times.append(seconds)
        delta, _ = max_logit_change(model, grown, batch_size=1, seq_len=16)
        print(f"| {name} | {grown.num_parameters():,} | {times[0]} | {times[1]} | {delta:.3g} |")
        del grown

    # Optimizer carry-over: AdamW state (exp_avg, exp_avg_sq) as after one step.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in model.parameters():
        p.grad = None
    times = [best_of(args.repeats, lambda c=copy: grow_with_optimizer(
        model, optimizer, ffn="2x", copy=c))[0] for copy in (True, False)]
    print(f"| ffn 2x + AdamW state carried over | | {times[0]} | {times[1]} | |")


if __name__ == "__main__":
    main()
