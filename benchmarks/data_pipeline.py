"""Data pipeline speed: preparing the embedded corpus, and drawing batches from it.

    python benchmarks/data_pipeline.py [--tokenizers bytes bpe:4096]

Each tokenizer is prepared from scratch into a temporary cache (the numbers a first run pays),
then reopened from the cache, then batches are drawn the way the trainer draws them.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from tokenformer.data import default_dataset, kjv_text, unigram_entropy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizers", nargs="+", default=["bytes", "bpe:4096"])
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()

    start = time.perf_counter()
    text = kjv_text()
    print(f"kjv_text: {len(text.encode()):,} bytes in {time.perf_counter() - start:.2f} s")
    with tempfile.TemporaryDirectory() as cache:
        for spec in args.tokenizers:
            start = time.perf_counter()
            ds = default_dataset(spec, cache_dir=cache, progress=False)
            first = time.perf_counter() - start
            start = time.perf_counter()
            default_dataset(spec, cache_dir=cache, progress=False)
            cached = time.perf_counter() - start
            m = ds.meta
            print(f"{spec:>10}: prepare {first:6.2f} s, cached reopen {cached * 1e3:6.1f} ms | "
                  f"train {m['train_tokens']:,} val {m['val_tokens']:,} tokens, "
                  f"{ds.bytes_per_token('val'):.3f} bytes/token, "
                  f"unigram entropy {unigram_entropy(ds):.3f} nats/token")
            for batch_size, seq_len in ((16, 256), (64, 256), (8, 1024)):
                start = time.perf_counter()
                for step in range(args.steps):
                    ds.batch("train", step, batch_size, seq_len)
                per = (time.perf_counter() - start) / args.steps
                print(f"{'':>12}batch {batch_size}x{seq_len}: {per * 1e6:7.1f} us "
                      f"({batch_size * seq_len / per / 1e6:.0f} M tokens/s)")


if __name__ == "__main__":
    main()
