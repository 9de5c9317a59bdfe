"""Cached decoding: per-token cost at position 10 vs position 1000.

Two measurements:

1. One cached forward step of one token at a given position, interleaved between positions (the
   pre-allocated KV cache is rewound after each step, so every sample sees the same length).
2. ``model.generate`` of ``--new`` tokens from a short prompt, timing every step with a forward
   pre-hook: the cost of the steps around position 10 vs around position 1000 includes every
   Python-side cost of the generation loop (sampling, token concatenation, cache bookkeeping).

    python benchmarks/decode.py                      # preset small with a 1100-token context
    python benchmarks/decode.py --preset medium --rounds 50

Target (issue 8): cost at position 1000 within 1.5x of the cost at position 10.
Prints a markdown section for benchmarks/RESULTS.md.

``--static N``: also ``generate`` N tokens from a 2-token prompt with the dynamic cache, the
static cache and the static cache + compiled step (issues 34 and 43), interleaved, per token and
in tokens/s, at each ``--static-batch`` size (default 1 and 8), after one untimed compiling call
whose time is printed (docs/performance.md, "Static cache and compiled decoding").
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from common import add_clock_args, apply_clock_args, command_line, interleaved, machine

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.models.kv_cache import KVCache


@torch.no_grad()
def step_at(model: TokenFormerLM, position: int):
    """A function decoding one token at ``position`` with a cache filled up to it."""
    config = model.config
    cache = KVCache(config.num_layers, config.max_seq_len)
    prompt = torch.randint(0, config.vocab_size, (1, position))
    model(prompt, past_key_values=cache, use_cache=True)
    token = torch.randint(0, config.vocab_size, (1, 1))

    def step() -> None:
        model(token, past_key_values=cache, use_cache=True)
        cache.lengths = [position] * config.num_layers  # rewind: the next sample is alike
    return step


@torch.no_grad()
def generate_step_times(model: TokenFormerLM, new_tokens: int) -> list[float]:
    """Wall time between consecutive forward calls of ``generate`` (index i = position i + 1)."""
    stamps: list[float] = []
    handle = model.register_forward_pre_hook(lambda *_: stamps.append(common.CLOCK()))
    try:
        model.generate(torch.zeros(1, 1, dtype=torch.long), max_new_tokens=new_tokens)
    finally:
        handle.remove()
    return [b - a for a, b in itertools.pairwise(stamps)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--positions", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--new", type=int, default=1020, help="tokens generated in part 2")
    parser.add_argument("--gen-runs", type=int, default=3, help="generate runs (min is kept)")
    parser.add_argument("--static", type=int, default=0, metavar="N",
                        help="also time generate of N tokens: dynamic vs static vs compiled")
    parser.add_argument("--static-batch", type=int, nargs="+", default=[1, 8], metavar="B",
                        help="batch sizes of --static (default: 1 8)")
    add_clock_args(parser)
    args = parser.parse_args(argv)
    clock = apply_clock_args(args)

    torch.manual_seed(0)
    context = max(max(args.positions), args.new, args.static + 2) + 8
    config = TokenFormerConfig.from_name(args.preset, max_seq_len=context)
    model = TokenFormerLM(config).eval()
    t = interleaved({p: step_at(model, p) for p in args.positions}, args.rounds, warmup=3)
    runs = [generate_step_times(model, args.new) for _ in range(args.gen_runs)]
    first, last = args.positions[0], args.positions[-1]

    def around(pos: int) -> float:  # median over 20 steps centred on ``pos``, best run
        return min(statistics.median(gen[max(0, pos - 10): pos + 10]) for gen in runs)

    print("## Decoding (issue 8)\n")
    print(f"Command: `{command_line()}`  ")
    print(f"Machine: {machine()}; timing: {clock}  ")
    print(f"Preset `{args.preset}` (context raised to {context}), batch 1, fp32, KV cache. "
          f"Step: min (median) over {args.rounds} interleaved rounds. generate: median of the 20 "
          f"steps around the position, best of {args.gen_runs} runs of {args.new} new tokens.\n")
    print("| position | one cached step ms | generate step ms |")
    print("|---|---|---|")
    for p in args.positions:
        print(f"| {p} | {1e3 * t[p]['min']:.2f} ({1e3 * t[p]['median']:.2f}) | "
              f"{1e3 * around(p):.2f} |")
    print(f"\nRatio position {last} / position {first}: one step "
          f"{t[last]['min'] / t[first]['min']:.2f}x, generate {around(last) / around(first):.2f}x "
          f"(target <= 1.5x).\n")
    if args.static:
        static_paths(model, args.static, args.rounds, args.static_batch)


@torch.no_grad()
def static_paths(model: TokenFormerLM, new: int, rounds: int, batches: list[int]) -> None:
    """generate's cost per step with each cache, at each batch size (the same tokens: checked)."""
    paths = {"dynamic": {}, "static": {"cache_implementation": "static"},
             "static + compiled": {"cache_implementation": "static", "compile": True}}
    print(f"generate of {new} tokens from a 2-token prompt (greedy), per step: min (median) over "
          f"{rounds} interleaved rounds; tokens/s of the min; first compiled call: its wall "
          f"time (compile + {new} tokens).\n")
    print("| batch | cache | ms per step | tokens/s | first compiled call |")
    print("|---|---|---|---|---|")
    for batch in batches:
        prompt = torch.randint(0, model.config.vocab_size, (batch, 2))
        start = time.perf_counter()  # wall time: inductor compiles in other processes too
        first = model.generate(prompt, new, **paths["static + compiled"])
        compile_s = time.perf_counter() - start
        for kwargs in paths.values():
            if not torch.equal(model.generate(prompt, new, **kwargs), first):
                raise SystemExit(f"{kwargs}: other tokens than the compiled path's")
        t = interleaved({name: lambda k=kwargs, p=prompt: model.generate(p, new, **k)
                         for name, kwargs in paths.items()}, rounds, warmup=1)
        for name, times in t.items():
            print(f"| {batch} | {name} | {1e3 * times['min'] / new:.2f} "
                  f"({1e3 * times['median'] / new:.2f}) | {batch * new / times['min']:,.0f} | "
                  f"{f'{compile_s:.1f} s' if name == 'static + compiled' else ''} |")
    print()


if __name__ == "__main__":
    main()
