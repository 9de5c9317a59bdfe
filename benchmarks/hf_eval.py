"""Speed of evaluation and of Hugging Face generation against our own, on this machine.

    python benchmarks/hf_eval.py [--preset small] [--tokens 65536] [--new-tokens 128] [--threads 1]

* ``evaluate_text`` throughput (scored tokens per second) on the embedded corpus's validation
  text with the default stride (windows overlapping by one token) and with stride = seq_len / 2.
* Greedy decoding of ``--new-tokens`` tokens from a 32-token prompt, batch 1: our
  ``TokenFormerLM.generate`` (pre-allocated KV cache) vs ``transformers`` ``generate()`` on the
  wrapped model (``DynamicCache``), with and without cache; the outputs are checked equal.
* ``convert official`` + ``from_pretrained`` time for a random model of the preset's size.

Random weights (speed does not depend on them). Each timing is the best of ``--repeats`` runs.
Prints a markdown section for benchmarks/RESULTS.md (progress goes to stderr).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, log, machine

import tokenformer.hf as H
from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.data.corpus import default_dataset
from tokenformer.eval.evaluate import evaluate_text
from tokenformer.formats.convert import convert_official
from tokenformer.models.official import save_official


def best_of(repeats: int, fn):
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens", type=int, default=65536, help="validation tokens to score")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 on a shared machine: spinning threads collapse)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    machine_line = machine()  # threads as set above, load average before the run
    rows = []
    torch.manual_seed(0)
    model = TokenFormerLM(TokenFormerConfig.from_name(args.preset)).eval()
    L = model.config.max_seq_len
    log(f"preset {args.preset}: {model.num_parameters():,} parameters, context {L}, "
        f"torch threads {torch.get_num_threads()}")

    val = np.asarray(default_dataset("bytes", progress=False).val[: args.tokens])
    for stride in (L - 1, L // 2):
        t, r = best_of(args.repeats, lambda s=stride: evaluate_text(
            model, val, stride=s, batch_size=args.batch_size, progress=False))
        what = (f"default stride {stride} (windows overlap by one token)" if stride == L - 1
                else f"stride {stride} (>= {L - stride} tokens of context each)")
        rows.append((f"`evaluate_text`, {what}, batch {args.batch_size}",
                     f"{r['tokens']:,} tokens in {t:.2f} s = {r['tokens'] / t:,.0f} tokens/s "
                     f"(loss {r['loss']:.4f})"))
        log(f"evaluate_text stride {stride}: {rows[-1][1]}")

    hf = H.TokenFormerForCausalLM.from_core(model).eval()
    prompt = torch.from_numpy(val[:32].astype(np.int64))[None]
    n = min(args.new_tokens, L - 32)
    eos = model.config.eos_token_id
    t_ours, ours = best_of(args.repeats, lambda: model.generate(prompt, n, eos_token_id=eos))
    n = ours.shape[1] - prompt.shape[1]  # tokens actually generated (eos may stop early)
    rows.append((f"greedy decoding, {prompt.shape[1]}-token prompt, {n} new tokens: "
                 f"`TokenFormerLM.generate`", f"{n / t_ours:.1f} tokens/s"))
    log(f"TokenFormerLM.generate: {rows[-1][1]}")
    for use_cache in (True, False):
        t, theirs = best_of(args.repeats, lambda c=use_cache: hf.generate(
            prompt, max_new_tokens=n, do_sample=False, use_cache=c))
        assert theirs.tolist() == ours.tolist(), "HF greedy output differs from ours"
        what = ("same, transformers `generate()` with `DynamicCache` (identical tokens, asserted)"
                if use_cache else "same, transformers `generate(use_cache=False)`")
        rows.append((what, f"{n / t:.1f} tokens/s ({t / t_ours:.2f}× our time)"))
        log(f"HF generate(use_cache={use_cache}): {rows[-1][1]}")

    with tempfile.TemporaryDirectory() as tmp:
        save_official(model, Path(tmp) / "pytorch_model.bin")
        t_convert, _ = best_of(1, lambda: convert_official(
            Path(tmp) / "pytorch_model.bin", Path(tmp) / "hf",
            num_heads=model.config.num_heads, max_seq_len=L))
        log(f"convert official: {t_convert:.2f} s")
        t_load, _ = best_of(args.repeats, lambda: H.load_hf(Path(tmp) / "hf"))
        log(f"from_pretrained: {t_load:.2f} s")
    rows.append((f"`convert official` (random `{args.preset}` model) / `from_pretrained` of the "
                 f"result", f"{t_convert:.2f} s / {t_load:.2f} s"))

    print("## huggingface / evaluation\n")
    print(f"Command: `{command_line()}`  ")
    print(f"Machine: {machine_line}; timing: wall clock, best of {args.repeats} "
          f"(`convert official`: one run)  ")
    print(f"Scoring throughput of `evaluate_text` on the embedded corpus's validation bytes, "
          f"greedy decoding speed of our `generate` against transformers' `generate()`, and the "
          f"time to convert and load a checkpoint; preset `{args.preset}` "
          f"({model.num_parameters():,} parameters, context {L}, random weights, batch 1 for "
          f"decoding).\n")
    print("| what | result |")
    print("|---|---|")
    for what, result in rows:
        print(f"| {what} | {result} |")


if __name__ == "__main__":
    main()
