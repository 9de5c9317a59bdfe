"""CPU inference: TokenFormer-150M against transformers' GPT-NeoX of Pythia-160M's shape.

Three candidates, timed interleaved in one process, random weights, greedy decoding:

* ``core``: :meth:`tokenformer.TokenFormerLM.generate` of preset ``tokenformer-150m``;
* ``hf``: the same weights behind :class:`tokenformer.hf.TokenFormerForCausalLM` and
  transformers' ``generate`` (a ``DynamicCache``);
* ``neox``: ``transformers.GPTNeoXForCausalLM`` with Pythia-160M's shape (hidden 768, 12 layers,
  12 heads, intermediate 3072, rotary 25 %, vocab 50304, untied embeddings) and ``generate``.

Decode: tokens/s of ``--new`` greedy steps at batch 1 and 8 from a cache already holding
``position`` tokens (filled with random keys and values, rewound after every call so every round
sees the same lengths). Prefill: tokens/s of ``generate(prompt, max_new_tokens=1)`` for a
``--prefill``-token prompt at batch 1 (the prompt's forward pass and the first token). Medians of
interleaved rounds; the ratio is TokenFormer's tokens/s over GPT-NeoX's.

    python benchmarks/inference.py --cpu-time            # what RESULTS.md records
    python benchmarks/inference.py --dtypes bf16 --rounds 3 --profile   # profiler tables too

Target (issue 17): every ratio >= 1.0. TokenFormer-150M does 1.23x (decode) and 1.33x (prefill)
GPT-NeoX's matmul work per token, which the section states and divides out in its last column
(docs/performance.md, "Inference"). Prints a markdown section for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_clock_args, apply_clock_args, command_line, interleaved, log, machine

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.models.kv_cache import KVCache
from tokenformer.nn.pattention import Pattention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CANDIDATES = ("core", "hf", "neox")


def build_models(context: int):
    """(TokenFormer core, its HF wrapper, GPT-NeoX), fp32, eval mode, random weights."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from tokenformer.hf import TokenFormerForCausalLM

    torch.manual_seed(0)
    core = TokenFormerLM(TokenFormerConfig.from_name("tokenformer-150m", max_seq_len=context))
    wrapper = TokenFormerForCausalLM.from_core(core)
    neox_config = GPTNeoXConfig(vocab_size=50304, hidden_size=768, num_hidden_layers=12,
                                num_attention_heads=12, intermediate_size=3072, rotary_pct=0.25,
                                max_position_embeddings=context, tie_word_embeddings=False,
                                use_parallel_residual=True, bos_token_id=None, eos_token_id=None)
    neox = GPTNeoXForCausalLM(neox_config)
    for model in (wrapper, neox):
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
    return core.eval(), wrapper.eval(), neox.eval()


def matmul_macs(models) -> tuple[int, int, int]:
    """Multiply-adds per token outside attention and the output projection: every Pattention's
    K_P and V_P (TokenFormer), every Linear but embed_out (GPT-NeoX); and the output projection
    (the same vocab × hidden in both: tied in TokenFormer, embed_out in GPT-NeoX)."""
    core, _, neox = models
    tokenformer = sum(p.numel() for m in core.modules() if isinstance(m, Pattention)
                      for p in m.parameters())
    head = neox.get_output_embeddings().weight.numel()
    gpt_neox = sum(m.weight.numel() for m in neox.modules()
                   if isinstance(m, torch.nn.Linear)) - head
    assert head == core.word_embeddings.weight.numel()
    return tokenformer, gpt_neox, head


def fill(cache, layers: int, batch: int, heads: int, head_dim: int, position: int,
         dtype: torch.dtype):
    """Put ``position`` random keys/values into every layer of ``cache``."""
    for layer in range(layers):
        kv = torch.randn(2, batch, heads, position, head_dim).to(dtype)
        cache.update(kv[0], kv[1], layer)
    return cache


def decode_fns(models, batch: int, position: int, new: int, dtype: torch.dtype) -> dict:
    """One function per candidate generating ``new`` tokens after ``position`` cached ones."""
    from transformers import DynamicCache

    core, wrapper, neox = models
    c = core.config
    prompt = torch.randint(0, c.vocab_size, (batch, position + 1))
    mask = torch.ones_like(prompt)
    core_cache = fill(KVCache(c.num_layers, c.max_seq_len), c.num_layers, batch, c.num_heads,
                      c.head_dim, position, dtype)
    hf_cache = fill(DynamicCache(config=wrapper.config), c.num_layers, batch, c.num_heads,
                    c.head_dim, position, dtype)
    neox_cache = fill(DynamicCache(config=neox.config), 12, batch, 12, 64, position, dtype)
    kwargs = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}

    def run_core() -> None:
        core.generate(prompt, new, past_key_values=core_cache)
        core_cache.lengths = [position] * c.num_layers

    def run_hf(model, cache) -> None:
        model.generate(prompt, attention_mask=mask, past_key_values=cache, **kwargs)
        cache.crop(position - cache.get_seq_length())  # negative: drop the new tokens

    return {"core": run_core, "hf": lambda: run_hf(wrapper, hf_cache),
            "neox": lambda: run_hf(neox, neox_cache)}


def prefill_fns(models, batch: int, length: int) -> dict:
    core, wrapper, neox = models
    prompt = torch.randint(0, core.config.vocab_size, (batch, length))
    mask = torch.ones_like(prompt)
    kwargs = {"max_new_tokens": 1, "do_sample": False}
    return {"core": lambda: core.generate(prompt, 1),
            "hf": lambda: wrapper.generate(prompt, attention_mask=mask, **kwargs),
            "neox": lambda: neox.generate(prompt, attention_mask=mask, **kwargs)}


def profile(fn, rows: int = 15) -> str:
    from torch.profiler import profile as torch_profile

    fn()
    with torch_profile() as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows,
                                     max_name_column_width=40)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--positions", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--new", type=int, default=8, help="decode steps per timed call")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens (0: skip)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true",
                        help="also print profiler tables (stderr) of core and neox decode")
    add_clock_args(parser)
    args = parser.parse_args(argv)
    clock = apply_clock_args(args)

    context = max(max(args.positions) + args.new + 1, args.prefill + 1, 64)
    models = build_models(context)
    impls = sorted({m.impl for m in models[0].modules() if isinstance(m, Pattention)})
    rows = []
    for name in args.dtypes:
        dtype = DTYPES[name]
        for model in models:
            model.to(dtype)
        # (label, tokens per call, output projections per token, functions)
        cases = [(f"decode b{b} @{p}", b * args.new, 1.0,
                  decode_fns(models, b, p, args.new, dtype))
                 for b in args.batches for p in args.positions]
        if args.prefill:
            cases.append((f"prefill {args.prefill}", args.prefill, 1 / args.prefill,
                          prefill_fns(models, 1, args.prefill)))
        for label, tokens, heads, fns in cases:
            log(f"{name} {label} ...")
            with torch.inference_mode():
                if args.profile and label.startswith("decode"):
                    for who in ("core", "neox"):
                        log(f"### {who}, {name}, {label}\n{profile(fns[who])}")
                t = interleaved(fns, args.rounds, warmup=1)
            rate = {who: tokens / t[who]["median"] for who in CANDIDATES}
            rows.append((name, label, heads, rate))
            log(f"  {rate}")

    print("## Inference (issue 17)\n")
    print(f"Command: `{command_line()}`  ")
    print(f"Machine: {machine()}; timing: {clock}  ")
    print(f"TokenFormer-150M (Pattention impl {', '.join(impls)}) vs `GPTNeoXForCausalLM` of "
          f"Pythia-160M's shape, random weights, greedy. Decode: {args.new} new tokens from a "
          f"cache holding `position` tokens; prefill: a {args.prefill}-token prompt at batch 1 "
          f"and its first token. Tokens/s of the median of {args.rounds} interleaved rounds; "
          f"ratio = TokenFormer / GPT-NeoX.\n")
    ours, theirs, head = matmul_macs(models)
    print(f"Matmul work per token outside attention: TokenFormer {ours / 1e6:.1f}M multiply-adds, "
          f"GPT-NeoX {theirs / 1e6:.1f}M ({ours / theirs:.3f}x), plus the output projection of "
          f"{head / 1e6:.1f}M in both (once per decoded token, once per prompt in prefill): "
          f"TokenFormer does {(ours + head) / (theirs + head):.3f}x GPT-NeoX's work per decoded "
          f"token and {ours / theirs:.3f}x per prefilled one, so at equal efficiency the ratios "
          f"would be {(theirs + head) / (ours + head):.2f}x and {theirs / ours:.2f}x. Last "
          f"column: core / NeoX × that work ratio, i.e. multiply-adds per second relative to "
          f"GPT-NeoX.\n")
    print("| dtype | case | core tok/s | HF wrapper tok/s | GPT-NeoX tok/s | core / NeoX | "
          "wrapper / NeoX | core / NeoX per multiply-add |")
    print("|---|---|---|---|---|---|---|---|")
    for name, label, heads, rate in rows:
        work = (ours + heads * head) / (theirs + heads * head)
        print(f"| {name} | {label} | {rate['core']:.1f} | {rate['hf']:.1f} | "
              f"{rate['neox']:.1f} | {rate['core'] / rate['neox']:.2f}x | "
              f"{rate['hf'] / rate['neox']:.2f}x | {work * rate['core'] / rate['neox']:.2f}x |")
    print()


if __name__ == "__main__":
    main()
