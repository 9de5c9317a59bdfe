"""``tokenformer info`` and ``tokenformer generate``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ...data.tokenizer import resolve_tokenizer
from ...errors import ConfigError
from ...formats.loading import load_model
from ...models.config import PRESETS, TokenFormerConfig, embedding_parameters, flops_per_token
from ...nn.pattention import top_k_request
from ...ops.adapters import load_adapted
from ...ops.growth import parse_growth_request, plan_growth, size_lines
from ..options import device, non_negative_float, positive, seed


def info(spec: str, seq_len: int | None = None, grow: str | None = None) -> str:
    """A human-readable summary of a preset, config file or checkpoint: sizes, parameters, FLOPs
    per token; with ``grow`` (``"hidden=2x,layers=2x,how=stack"``, grow's keyword arguments) the
    sizes before and after that growth, checked as ``tokenformer grow`` checks it."""
    if spec in PRESETS and not Path(spec).exists():
        config = TokenFormerConfig.from_name(spec)
    elif Path(spec).suffix in (".json", ".yaml", ".yml"):  # never a weights file
        config = TokenFormerConfig.load(spec)
    else:
        config = load_model(spec).config
    T = seq_len or config.max_seq_len
    if grow is not None:  # checked first: a refused request prints nothing but its one line
        grown = plan_growth(config, **parse_growth_request(grow))
    fwd, train = flops_per_token(config, T), flops_per_token(config, T, training=True)
    d = config.hidden_size
    if not hasattr(config, "qkv_tokens"):  # a Transformer baseline: no parameter tokens
        lines = [f"model        {config.name} ({config.arch})",
                 f"layers       {config.num_layers}   hidden {d}   heads {config.num_heads}   "
                 f"mlp {config.intermediate_size}",
                 f"parameters   {config.num_parameters():,} total",
                 f"FLOPs/token  {fwd['total']:.4g} forward, {train['total']:.4g} training "
                 f"(context {T})"]
    else:
        lines = _tokenformer_lines(config, T, fwd, train)
    if grow is not None:
        lines += ["", f"growth       {grow}", *size_lines(config, grown, T)]
    return "\n".join(lines)


def _tokenformer_lines(config: TokenFormerConfig, T: int, fwd: dict[str, float],
                       train: dict[str, float]) -> list[str]:
    d = config.hidden_size
    lines = [
        f"model        {config.name}",
        f"layers       {config.num_layers}   hidden {d}   heads {config.num_heads} "
        f"(head_dim {config.head_dim}, rotary dims {config.rotary_dim})",
        f"tokens       qkv {config.qkv_tokens}   proj {config.proj_tokens}   "
        f"ffn {config.ffn_tokens}   Θ {config.norm}",
        f"vocab        {config.vocab_size} (padded {config.padded_vocab_size})   "
        f"context {config.max_seq_len}",
        f"parameters   {config.num_parameters():,} total, "
        f"{config.num_parameters(non_embedding=True):,} non-embedding",
        f"FLOPs/token  {fwd['total']:.4g} forward, {train['total']:.4g} training "
        f"(context {T})",
        "",
        f"{'per layer':<24}{'parameters':>14}{'fwd FLOPs/token':>18}",
    ]
    theta = fwd["attention_pattentions"] / (3 * config.qkv_tokens + config.proj_tokens)
    table = [
        ("Pattention Q, K, V", 3 * 2 * d * config.qkv_tokens, 3 * config.qkv_tokens * theta),
        ("Pattention proj", 2 * d * config.proj_tokens, config.proj_tokens * theta),
        ("Pattention FFN", config.ffn_parameters(), fwd["ffn"]),
        ("token-token attention", 0, fwd["token_attention"]),
        ("layer total", config.block_parameters(), fwd["per_layer"]),
        (f"× {config.num_layers} layers", config.num_layers * config.block_parameters(),
         config.num_layers * fwd["per_layer"]),
        ("embedding / tied head" if config.tie_embeddings else "embedding + head",
         embedding_parameters(config), fwd["head"]),
    ]
    lines += [f"{name:<24}{params:>14,}{flops:>18.4g}" for name, params, flops in table]
    return lines


def generate_text(spec: str, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.8,
                  top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                  tokenizer: str | None = None, device: str = "cpu",
                  adapters: list[str] | None = None, top_k_tokens: str | None = None,
                  cache: str | None = None, compile: bool | None = None) -> str:
    """Load a model (a preset gives a randomly initialised one), with token ``adapters``
    (tokenformer.ops.adapters) stacked on it, and continue ``prompt`` (``top_k_tokens``: sparse
    Pattention for this call, docs/sparse.md). ``cache`` and ``compile``: generate's
    ``cache_implementation`` and ``compile``; None picks :func:`decoding_defaults`' choice."""
    cache, compile = decoding_defaults(device, cache, compile)  # refused before the model loads
    torch.manual_seed(seed)
    model = load_adapted(spec, adapters or []).to(device).eval()
    if top_k_tokens is not None:
        top_k_request(model, top_k_tokens)  # checked before any work on the prompt
    tok = resolve_tokenizer(spec, model.config, tokenizer)
    ids = tok.encode(prompt)
    if not ids:
        raise ConfigError("the prompt is empty")
    room = model.config.max_seq_len - len(ids)
    if room < max_new_tokens and room >= 0:  # generate what fits, and say so
        print(f"note: the model's context is {model.config.max_seq_len} tokens and the prompt "
              f"has {len(ids)}: generating at most {room} new tokens, not {max_new_tokens}",
              file=sys.stderr)
    generator = torch.Generator(device=device).manual_seed(seed)
    if compile:
        print("note: compiling the decoding step first (a minute or so; --no-compile skips it)",
              file=sys.stderr)
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens,
                         do_sample=temperature > 0, temperature=temperature or 1.0, top_k=top_k,
                         top_p=top_p, eos_token_id=tok.eos_token_id, generator=generator,
                         top_k_tokens=top_k_tokens, cache_implementation=cache, compile=compile)
    return tok.decode(out[0].tolist())


def decoding_defaults(device: str | torch.device, cache: str | None,
                      compile: bool | None) -> tuple[str, bool]:
    """The fast path where it pays: on CUDA a static cache and a compiled step captured as a CUDA
    graph (a small model's step is bound by kernel launches there, docs/performance.md); on the
    CPU the dynamic cache, uncompiled (compiling takes longer than it saves for one prompt).
    ``compile`` without a ``cache`` asks for the static one (the only one a step compiles over);
    with ``cache="dynamic"`` it is refused, in the flags' words."""
    if compile and cache == "dynamic":
        raise ConfigError("--compile needs --cache static (a compiled decoding step runs over "
                          "the static cache's fixed shapes): drop --cache dynamic, or --compile")
    cuda = torch.device(device).type == "cuda"
    cache = cache or ("static" if cuda or compile else "dynamic")
    return cache, (cuda and cache == "static") if compile is None else compile


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="parameters and FLOPs per token of a preset or checkpoint")
    p.add_argument("model", help="preset name, config file (.json/.yaml), model directory or "
                   "official checkpoint")
    p.add_argument("--seq-len", type=positive(int), default=None,
                   help="context length for the attention FLOPs (default: the model's)")
    p.add_argument("--grow", default=None, metavar="KEY=VALUE,...",
                   help="also show the sizes after this growth, with tokenformer grow's "
                        "options as keys: hidden, heads, layers, how, qkv, proj, ffn, recipe "
                        "(e.g. hidden=2x,layers=2x,how=stack)")
    p.set_defaults(func=lambda a: print(info(a.model, a.seq_len, a.grow)))

    p = sub.add_parser("generate", help="generate text from a checkpoint (or a random preset)")
    p.add_argument("model", help="model directory, official checkpoint, or preset name")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=positive(int), default=64)
    p.add_argument("--temperature", type=non_negative_float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=positive(int), default=None)
    p.add_argument("--top-p", type=non_negative_float, default=None, help="in (0, 1]")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer.json path or 'bytes'")
    p.add_argument("--device", type=device, default="cpu")
    p.add_argument("--adapter", action="append", default=None, metavar="DIR",
                   help="token adapter trained on this model (repeat to stack; docs/adapt.md)")
    p.add_argument("--top-k-tokens", default=None, metavar="SPEC",
                   help="sparse Pattention: each row reads only its k largest-|Θ| parameter "
                   "tokens; a count or fraction for every Pattention (64, 0.25) or per kind "
                   "(ffn=0.25,qkv=64); default: the model's own (dense). docs/sparse.md")
    p.add_argument("--cache", choices=("static", "dynamic"), default=None,
                   help="KV cache: static (preallocated, what a compiled step needs) or dynamic; "
                   "default: static on CUDA, dynamic elsewhere")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decoding step over a static cache (implies --cache "
                   "static; on CUDA captured as a CUDA graph); default: on with a static cache "
                   "on CUDA. --no-compile turns the fast path's compilation off")
    p.set_defaults(func=lambda a: print(generate_text(
        a.model, a.prompt, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
        top_k=a.top_k, top_p=a.top_p, seed=a.seed, tokenizer=a.tokenizer, device=a.device,
        adapters=a.adapter, top_k_tokens=a.top_k_tokens, cache=a.cache, compile=a.compile)))
