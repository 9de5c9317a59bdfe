"""Speed of evaluation and of Hugging Face generation against our own, on this machine.

    python benchmarks/hf_eval.py [--preset small] [--tokens 65536] [--new-tokens 128] [--threads 1]

* ``evaluate_text`` throughput (scored tokens per second) on the embedded corpus's validation
  text with the default stride (windows overlapping by one token) and with stride = seq_len / 2.
* Greedy decoding of ``--new-tokens`` tokens from a 32-token prompt, batch 1: our
  ``TokenFormerLM.generate`` (pre-allocated KV cache) vs ``transformers`` ``generate()`` on the
  wrapped model (``DynamicCache``), with and without cache; the outputs are checked equal.
* ``convert official`` + ``from_pretrained`` time for a random model of the preset's size.

Random weights (speed does not depend on them). Each timing is the best of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import tokenformer.hf as H
from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.data import default_dataset
from tokenformer.evaluate import evaluate_text
from tokenformer.official import save_official


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
    torch.manual_seed(0)
    model = TokenFormerLM(TokenFormerConfig.from_name(args.preset)).eval()
    L = model.config.max_seq_len
    print(f"preset {args.preset}: {model.num_parameters():,} parameters, context {L}, "
          f"torch threads {torch.get_num_threads()}")

    val = np.asarray(default_dataset("bytes", progress=False).val[: args.tokens])
    for stride in (L - 1, L // 2):
        t, r = best_of(args.repeats, lambda s=stride: evaluate_text(
            model, val, stride=s, batch_size=args.batch_size, progress=False))
        print(f"evaluate_text stride {stride:>4}: {r['tokens']:,} tokens in {t:.2f} s = "
              f"{r['tokens'] / t:,.0f} tokens/s (loss {r['loss']:.4f})")

    hf = H.TokenFormerForCausalLM.from_core(model).eval()
    prompt = torch.from_numpy(val[:32].astype(np.int64))[None]
    n = min(args.new_tokens, L - 32)
    eos = model.config.eos_token_id
    t_ours, ours = best_of(args.repeats, lambda: model.generate(prompt, n, eos_token_id=eos))
    n = ours.shape[1] - prompt.shape[1]  # tokens actually generated (eos may stop early)
    print(f"TokenFormerLM.generate        : {n / t_ours:8.1f} tokens/s ({n} tokens)")
    for use_cache in (True, False):
        t, theirs = best_of(args.repeats, lambda c=use_cache: hf.generate(
            prompt, max_new_tokens=n, do_sample=False, use_cache=c))
        assert theirs.tolist() == ours.tolist(), "HF greedy output differs from ours"
        print(f"HF generate(use_cache={use_cache!s:<5}) : {n / t:8.1f} tokens/s "
              f"({t / t_ours:.2f}x our time)")

    with tempfile.TemporaryDirectory() as tmp:
        save_official(model, Path(tmp) / "pytorch_model.bin")
        t, _ = best_of(1, lambda: H.convert_official(
            Path(tmp) / "pytorch_model.bin", Path(tmp) / "hf",
            num_heads=model.config.num_heads, max_seq_len=L))
        print(f"convert official              : {t:.2f} s")
        t, _ = best_of(args.repeats, lambda: H.load_hf(Path(tmp) / "hf"))
        print(f"from_pretrained               : {t:.2f} s")


if __name__ == "__main__":
    main()
