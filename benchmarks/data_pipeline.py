"""Data pipeline speed: preparing the embedded corpus, and drawing batches from it.

    python benchmarks/data_pipeline.py [--tokenizers bytes bpe:4096] [--steps 500]

Each tokenizer is prepared from scratch into a temporary cache (the numbers a first run pays),
then reopened from the cache, then batches are drawn the way the trainer draws them.
Prints a markdown section for benchmarks/RESULTS.md (progress goes to stderr).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, log, machine

from tokenformer.data.corpus import default_dataset, kjv_text
from tokenformer.data.datasets import unigram_entropy

SHAPES = ((16, 256), (64, 256), (8, 1024))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizers", nargs="+", default=["bytes", "bpe:4096"])
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()

    machine_line = machine()  # load average before the run
    rows = []
    start = time.perf_counter()
    text = kjv_text()
    seconds = time.perf_counter() - start
    rows.append(("`kjv_text()` (build the embedded corpus text)",
                 f"{len(text.encode()):,} bytes in {seconds:.2f} s"))
    log(f"kjv_text: {rows[-1][1]}")
    with tempfile.TemporaryDirectory() as cache:
        for spec in args.tokenizers:
            start = time.perf_counter()
            ds = default_dataset(spec, cache_dir=cache, progress=False)
            first = time.perf_counter() - start
            start = time.perf_counter()
            default_dataset(spec, cache_dir=cache, progress=False)
            cached = time.perf_counter() - start
            m = ds.meta
            trains = " (trains the BPE)" if spec.startswith("bpe") else ""
            rows.append((f'`default_dataset("{spec}")`, first use{trains}',
                         f"{first:.2f} s (train {m['train_tokens']:,} / val {m['val_tokens']:,} "
                         f"tokens, {ds.bytes_per_token('val'):.3f} val bytes/token, "
                         f"unigram entropy {unigram_entropy(ds):.3f} nats/token)"))
            log(f"{spec}: {rows[-1][1]}")
            rows.append((f'`default_dataset("{spec}")`, from the cache',
                         f"{cached * 1e3:.1f} ms"))
            log(f"{spec}: cached reopen {rows[-1][1]}")
            per_batch = []
            for batch_size, seq_len in SHAPES:
                start = time.perf_counter()
                for step in range(args.steps):
                    ds.batch("train", step, batch_size, seq_len)
                per_batch.append((time.perf_counter() - start) / args.steps)
                log(f"{spec}: batch {batch_size}x{seq_len}: {per_batch[-1] * 1e6:.1f} us")
            shapes = " / ".join(f"{b}×{s}" for b, s in SHAPES)
            rows.append((f"`batch()` {shapes} ({spec})",
                         " / ".join(f"{p * 1e6:.0f}" for p in per_batch) + " µs ("
                         + " / ".join(f"{b * s / p / 1e6:.0f}"
                                      for (b, s), p in zip(SHAPES, per_batch, strict=True))
                         + " M tokens/s)"))

    print("## data\n")
    print(f"Command: `{command_line()}`  ")
    print(f"Machine: {machine_line}; timing: wall clock  ")
    print(f"Preparing the embedded corpus for each tokenizer from scratch into an empty cache, "
          f"reopening it from the cache, and drawing training batches the way the trainer does "
          f"(mean over {args.steps} draws per shape).\n")
    print("| what | result |")
    print("|---|---|")
    for what, result in rows:
        print(f"| {what} | {result} |")


if __name__ == "__main__":
    main()
