"""Training throughput: matmul ceilings, then tokens/s and MFU of TokenFormer and of the
FLOP-matched Transformer, fp32 and bf16, all through the real training loop (:func:`fit`).

    python benchmarks/train_throughput.py                # the demo size (preset small, 16 × 256)
    python benchmarks/train_throughput.py --preset medium --steps 30

Targets (issue 4): bf16 >= 2.5x fp32 tokens/s; TokenFormer's FLOP-normalised throughput (achieved
FLOP/s) >= 0.9x the Transformer's.

On a machine shared with other jobs, wall-clock rates measure the contention. ``--clock cpu``
(one thread) divides by the process's CPU time instead, which approximates the rate the same
thread would reach on an idle core.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from tokenformer.baselines import TransformerLM, matched_config
from tokenformer.config import TokenFormerConfig, flops_per_token
from tokenformer.model import TokenFormerLM
from tokenformer.train import TrainConfig, fit

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def matmul_ceiling(dtype: torch.dtype, n: int, reps: int, clock: str) -> float:
    """Best FLOP/s of an n×n @ n×n matmul (2n³ FLOPs) over ``reps`` runs."""
    now = CLOCKS[clock]
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(reps):
        t = now()
        a @ b
        best = min(best, now() - t)
    return 2 * n**3 / best


def train_rate(model: torch.nn.Module, precision: str, batch_size: int, seq_len: int,
               steps: int, warmup: int, clock: str) -> float:
    """Tokens/s of ``steps`` training steps (fwd + bwd + clip + AdamW, the real loop) after
    ``warmup`` steps: the median step on the wall clock, or total CPU time."""
    vocab = model.config.vocab_size

    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        return {"input_ids": ids, "labels": ids}

    cfg = TrainConfig(steps=warmup + steps, batch_size=batch_size, seq_len=seq_len,
                      precision=precision, warmup_steps=1, eval_interval=0)
    warm = fit(model, batch_fn, dataclasses.replace(cfg, steps=warmup), progress=False)
    t = time.process_time()
    result = fit(warm.model, batch_fn, cfg, optimizer=warm.optimizer, start_step=warmup,
                 progress=False)
    if clock == "cpu":
        return steps * batch_size * seq_len / (time.process_time() - t)
    return statistics.median(r["tokens_per_s"] for r in result.records if r["type"] == "train")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="0 = torch's default")
    parser.add_argument("--matmul-n", type=int, default=1024)
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="cpu: divide by process CPU time (forces one thread)")
    args = parser.parse_args()
    if args.clock == "cpu":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)

    ceilings = {p: matmul_ceiling(d, args.matmul_n, 10, args.clock)
                for p, d in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock")
    print(f"matmul ceiling ({args.matmul_n}³): fp32 {ceilings['fp32'] / 1e9:.1f} GFLOP/s, "
          f"bf16 {ceilings['bf16'] / 1e9:.1f} GFLOP/s "
          f"({ceilings['bf16'] / ceilings['fp32']:.2f}x)")

    tf_config = TokenFormerConfig.from_name(args.preset, max_seq_len=args.seq_len)
    configs = {"TokenFormer": tf_config, "Transformer": matched_config(tf_config, "transformer")}
    print(f"\n{args.preset}: batch {args.batch_size} × {args.seq_len}; matched Transformer MLP "
          f"width {configs['Transformer'].intermediate_size}")
    print("| model | non-emb params | train FLOPs/token | precision | tokens/s | GFLOP/s | MFU |")
    print("|---|---|---|---|---|---|---|")
    achieved: dict[tuple[str, str], float] = {}
    rates: dict[tuple[str, str], float] = {}
    for name, config in configs.items():
        per_token = flops_per_token(config, args.seq_len, training=True)["total"]
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            model = (TokenFormerLM if name == "TokenFormer" else TransformerLM)(config)
            rate = train_rate(model, precision, args.batch_size, args.seq_len, args.steps,
                              args.warmup, args.clock)
            rates[name, precision] = rate
            achieved[name, precision] = rate * per_token
            print(f"| {name} | {config.num_parameters(non_embedding=True):,} | {per_token:.4g} | "
                  f"{precision} | {rate:,.0f} | {rate * per_token / 1e9:.2f} | "
                  f"{rate * per_token / ceilings[precision]:.1%} |")
    print()
    for name in configs:
        print(f"{name}: bf16 / fp32 tokens/s = "
              f"{rates[name, 'bf16'] / rates[name, 'fp32']:.2f}x (target >= 2.5x)")
    for precision in ("fp32", "bf16"):
        ratio = achieved["TokenFormer", precision] / achieved["Transformer", precision]
        print(f"{precision}: TokenFormer / Transformer FLOP-normalised throughput = "
              f"{ratio:.2f}x (target >= 0.9x)")


if __name__ == "__main__":
    main()
