"""Vision TokenFormer on scikit-learn's digits: top-1 accuracy and wall-clock (issue 7).

Acceptance: a small TokenFormer-ViT reaches >= 95 % test accuracy within 3 minutes on 2 CPU
cores. Trains through the trainer's loop (``tokenformer vision train`` does the same), then the
parameter-matched standard ViT with the same recipe for comparison.

    python benchmarks/vit_digits.py                      # vit-digits-tiny, then its matched ViT
    python benchmarks/vit_digits.py --seeds 0 1 2 3 --no-baseline
    python benchmarks/vit_digits.py --threads 0            # torch's default thread count
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from tokenformer.commands.vision import DIGITS_TRAIN, train_vision

BUDGET_S = 180.0
TARGET = 0.95


def run(preset: str, arch: str, seed: int, threads: int, steps: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    result = train_vision(preset, "digits", arch=arch, seed=seed, threads=threads, steps=steps,
                          progress=False)
    wall = time.perf_counter() - t0  # everything: data loading, model, training, evaluation
    return result.evaluation.accuracy, wall, result.model.num_parameters()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="vit-digits-tiny")
    parser.add_argument("--steps", type=int, default=DIGITS_TRAIN["steps"])
    parser.add_argument("--threads", type=int, default=DIGITS_TRAIN["threads"],
                        help="torch threads (0: torch's default)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"on {os.cpu_count()} CPUs; threads {args.threads or 'default'}; "
          f"recipe {dict(DIGITS_TRAIN, steps=args.steps)}")
    for arch in ("tokenformer",) + (() if args.no_baseline else ("vit",)):
        accs, walls = [], []
        for seed in args.seeds:
            acc, wall, params = run(args.preset, arch, seed, args.threads, args.steps)
            accs.append(acc)
            walls.append(wall)
            verdict = ""
            if arch == "tokenformer":
                verdict = "PASS" if acc >= TARGET and wall <= BUDGET_S else "FAIL"
            print(f"{arch:<12} {args.preset} ({params:,} params) seed {seed}: top-1 "
                  f"{100 * acc:.2f}%  wall {wall:.1f} s  {verdict}", flush=True)
        if len(accs) > 1:
            print(f"{arch:<12} mean top-1 {100 * statistics.mean(accs):.2f}% "
                  f"(min {100 * min(accs):.2f}%), mean wall {statistics.mean(walls):.1f} s")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
