"""Speed of sparse Pattention (docs/sparse.md): top-k decode/prefill and product-key training.

    python benchmarks/sparse.py speed --preset tokenformer-150m        # decode / prefill tok/s
    python benchmarks/sparse.py product-speed --preset small           # train tok/s, equal FLOPs
    python benchmarks/sparse.py product-profile --preset small         # where that time goes

All with one thread (``--threads``, default 1). Prints a markdown section for
benchmarks/RESULTS.md and writes ``--json``. What top-k and pruning cost in *quality* is an
experiment, not a benchmark: ``tokenformer sparse-study`` (src/tokenformer/experiments/sparse).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, interleaved, machine

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.models.kv_cache import KVCache
from tokenformer.nn.pattention import Pattention, set_pattention_top_k


@torch.no_grad()
def speed(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    config = TokenFormerConfig.from_name(args.preset)
    model = TokenFormerLM(config).eval()
    T, pos = args.prefill, args.position
    prompt = torch.randint(0, config.vocab_size, (1, T))
    cache = KVCache(config.num_layers, config.max_seq_len)
    model(torch.randint(0, config.vocab_size, (1, pos)), past_key_values=cache, use_cache=True)
    token = torch.randint(0, config.vocab_size, (1, 1))
    arms = {"dense": None, **{f"k/n=1/{round(1 / f)}": f for f in args.fractions}}

    def decode(f):
        def run():
            set_pattention_top_k(model, qkv=f, proj=f, ffn=f)
            model(token, past_key_values=cache, use_cache=True)
            cache.lengths = [pos] * config.num_layers
        return run

    def prefill(f):
        def run():
            set_pattention_top_k(model, qkv=f, proj=f, ffn=f)
            model(prompt, logits_to_keep=1)
        return run

    dec = interleaved({a: decode(f) for a, f in arms.items()}, args.rounds)
    pre = interleaved({a: prefill(f) for a, f in arms.items()}, max(2, args.rounds // 4), 1)
    lines = [f"Preset {args.preset} (random weights, fp32), {torch.get_num_threads()} thread; "
             f"top-k applied to every Pattention. Decode: one cached step at position {pos}, "
             f"batch 1, {args.rounds} interleaved rounds; prefill: {T} tokens, batch 1. tokens/s "
             f"from the minimum (median in brackets).", "",
             "| arm | decode tok/s | vs dense | prefill tok/s | vs dense |",
             "|---|---:|---:|---:|---:|"]
    for a in arms:
        d, p = dec[a], pre[a]
        lines.append(f"| {a} | {1 / d['min']:.2f} ({1 / d['median']:.2f}) | "
                     f"{dec['dense']['min'] / d['min']:.2f}x | {T / p['min']:.1f} "
                     f"({T / p['median']:.1f}) | {pre['dense']['min'] / p['min']:.2f}x |")
    return {"markdown": "\n".join(lines), "decode": dec, "prefill": pre}


def matched_k(dense: TokenFormerConfig, ffn_tokens: int) -> int:
    """The product-key k whose FFN forward FLOPs/token (config.projection_flops) come closest to
    ``dense``'s dense FFN at ``ffn_tokens`` = s² product keys."""
    target = dense.projection_flops()[1]
    best = min(range(1, ffn_tokens + 1), key=lambda k: abs(TokenFormerConfig.from_dict(
        {**dense.to_dict(), "ffn_keys": "product", "ffn_tokens": ffn_tokens,
         "ffn_product_k": k}).projection_flops()[1] - target))
    return best


def product_speed(args: argparse.Namespace) -> dict:
    """Train step tokens/s (forward, backward, AdamW) of dense vs product-key FFN TokenFormers
    of equal FFN FLOPs/token, and of the FFN alone, interleaved."""
    dense = TokenFormerConfig.from_name(args.preset)
    arms = {"dense": dense}
    for mult in args.multipliers:
        n = round((dense.ffn_tokens * mult) ** 0.5) ** 2
        k = matched_k(dense, n)
        arms[f"product n={n} ({mult}x) k={k}"] = TokenFormerConfig.from_dict(
            {**dense.to_dict(), "ffn_keys": "product", "ffn_tokens": n, "ffn_product_k": k})
    B, T = args.batch, min(args.seq_len, dense.max_seq_len)
    ids = torch.randint(0, dense.vocab_size, (B, T))
    steps, ffn_steps, info = {}, {}, {}
    for name, config in arms.items():
        torch.manual_seed(0)
        model = TokenFormerLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(B, T, config.hidden_size, requires_grad=True)
        mlp = model.layers[0].mlp

        def step(model=model, opt=opt):
            loss = model(ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        def ffn(mlp=mlp, x=x):
            mlp(x).square().mean().backward()

        steps[name], ffn_steps[name] = step, ffn
        info[name] = (config.num_parameters(), 3 * config.projection_flops()[1])
    whole = interleaved(steps, args.rounds, 1)
    alone = interleaved(ffn_steps, args.rounds, 1)
    lines = [f"Preset {args.preset} (d={dense.hidden_size}, {dense.num_layers} layers, dense "
             f"ffn_tokens {dense.ffn_tokens}); fp32, {torch.get_num_threads()} thread, batch "
             f"{B}×{T}; k chosen so the FFN's forward FLOPs/token match dense "
             f"(config.projection_flops); {args.rounds} interleaved rounds, tokens/s from the "
             f"minimum.", "",
             "| arm | parameters | FFN train FLOPs/token | train step tok/s | vs dense | "
             "FFN fwd+bwd tok/s | vs dense |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name in arms:
        w, a = whole[name]["min"], alone[name]["min"]
        lines.append(f"| {name} | {info[name][0]:,} | {info[name][1]:,.0f} | {B * T / w:,.0f} | "
                     f"{whole['dense']['min'] / w:.2f}x | {B * T / a:,.0f} | "
                     f"{alone['dense']['min'] / a:.2f}x |")
    return {"markdown": "\n".join(lines), "whole": whole, "ffn": alone}


def product_profile(args: argparse.Namespace) -> dict:
    """Where a product-key FFN's forward+backward time goes (torch.profiler, self CPU time by
    op), for the FLOP-matched arms of ``product-speed``, next to the dense FFN."""
    from torch.profiler import ProfilerActivity, profile

    from tokenformer.nn.product_keys import ProductKeyPattention

    dense = TokenFormerConfig.from_name(args.preset)
    d = dense.hidden_size
    x = torch.randn(args.rows, d, requires_grad=True)
    arms = {f"dense n={dense.ffn_tokens}": Pattention(d, d, dense.ffn_tokens)}
    for mult in args.multipliers:
        n = round((dense.ffn_tokens * mult) ** 0.5) ** 2
        k = matched_k(dense, n)
        arms[f"product n={n} k={k}"] = ProductKeyPattention(d, d, n, k)
    lines = [f"FFN alone (preset {args.preset}: d={d}), {args.rows} rows, forward + backward, "
             f"3 profiled calls after 2 warm-up calls, 1 thread; self CPU time by op (top 6).",
             ""]
    out = {}
    for name, m in arms.items():
        for _ in range(2):
            m(x).square().mean().backward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                m(x).square().mean().backward()
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in events)
        top = [(e.key, e.self_cpu_time_total / total) for e in events[:6]]
        out[name] = {"total_ms": total / 1e3 / 3, "top": top}
        lines.append(f"- **{name}**: {total / 1e3 / 3:.1f} ms per call; "
                     + ", ".join(f"{k} {f:.0%}" for k, f in top))
    return {"markdown": "\n".join(lines), "arms": out}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by the thread's CPU time (robust on a shared machine)")
    parser.add_argument("--json", default=None, help="also write the results here")
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--preset", default="tokenformer-150m")
    s.add_argument("--prefill", type=int, default=256)
    s.add_argument("--position", type=int, default=128)
    s.add_argument("--rounds", type=int, default=12)
    s.add_argument("--fractions", type=float, nargs="+", default=[1 / 4, 1 / 16])
    k = sub.add_parser("product-speed")
    k.add_argument("--preset", default="small")
    k.add_argument("--multipliers", type=int, nargs="+", default=[16, 64])
    k.add_argument("--batch", type=int, default=8)
    k.add_argument("--seq-len", type=int, default=256)
    k.add_argument("--rounds", type=int, default=6)
    f = sub.add_parser("product-profile")
    f.add_argument("--preset", default="small")
    f.add_argument("--multipliers", type=int, nargs="+", default=[16, 64])
    f.add_argument("--rows", type=int, default=2048)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.cpu_time:
        import time

        import common

        common.CLOCK = time.thread_time
    result = {"speed": speed, "product-speed": product_speed,
              "product-profile": product_profile}[args.what](args)
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in result.items()
                                               if k != "markdown"}, indent=1) + "\n")
    print(f"### Sparse Pattention: {args.what}\n\nCommand: `{command_line()}`  \n"
          f"CPU: {machine()} (cores shared with other jobs)\n\n{result['markdown']}\n")


if __name__ == "__main__":
    main()
