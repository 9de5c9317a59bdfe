"""Vision TokenFormer on scikit-learn's digits: top-1 accuracy and wall-clock (issue 7).

Acceptance: a small TokenFormer-ViT reaches >= 95 % test accuracy within 3 minutes on 2 CPU
cores. Trains through the trainer's loop (``tokenformer vision train`` does the same), then the
parameter-matched standard ViT with the same recipe for comparison.

    python benchmarks/vit_digits.py                      # vit-digits-tiny, then its matched ViT
    python benchmarks/vit_digits.py --seeds 0 1 2 3 --no-baseline
    python benchmarks/vit_digits.py --threads 0            # torch's default thread count

Prints a markdown section for benchmarks/RESULTS.md (progress goes to stderr).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, load_average, log, machine

from tokenformer.training.vision import DIGITS_TRAIN, train_vision

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
    machine_line = machine()  # load average before the run
    recipe = dict(DIGITS_TRAIN, steps=args.steps)
    log(f"load average before: {load_average()} on {os.cpu_count()} CPUs; "
        f"threads {args.threads or 'default'}; recipe {recipe}")
    rows, verdicts = [], []
    for arch in ("tokenformer",) + (() if args.no_baseline else ("vit",)):
        accs, walls, params = [], [], 0
        for seed in args.seeds:
            acc, wall, params = run(args.preset, arch, seed, args.threads, args.steps)
            accs.append(acc)
            walls.append(wall)
            verdict = ""
            if arch == "tokenformer":
                verdict = "PASS" if acc >= TARGET and wall <= BUDGET_S else "FAIL"
                verdicts.append(verdict)
            log(f"{arch:<12} {args.preset} ({params:,} params) seed {seed}: top-1 "
                f"{100 * acc:.2f}%  wall {wall:.1f} s  {verdict}")
        name = (f"TokenFormer-ViT `{args.preset}`" if arch == "tokenformer"
                else "standard ViT, parameter-matched")
        wall_cell = (f"{min(walls):.1f}–{max(walls):.1f} s (mean {statistics.mean(walls):.1f} s)"
                     if len(walls) > 1 else f"{walls[0]:.1f} s")
        rows.append(f"| {name} | {params:,} | "
                    + " | ".join(f"{100 * a:.2f} %" for a in accs)
                    + f" | {100 * statistics.mean(accs):.2f} % | {wall_cell} |")
    log(f"load average after: {load_average()}")

    threads = f"{args.threads} torch thread(s)" if args.threads else "torch's default threads"
    print("## Vision (issue 7)\n")
    print(f"Command: `{command_line()}`  ")
    print(f"Machine: {machine_line}; training with {threads}; load average after the run "
          f"{load_average()}  ")
    print(f"Top-1 test accuracy on scikit-learn's digits (fixed split) of `{args.preset}` "
          + ("" if args.no_baseline else "and of a parameter-matched standard ViT with the same "
             "recipe ")
          + f"({args.steps} steps × {recipe['batch_size']} images, AdamW lr {recipe['lr']:g} "
          f"cosine → {recipe['min_lr']:g}), one run per seed; wall-clock covers everything "
          f"(data, model, training, final evaluation).\n")
    print("| model | params | " + " | ".join(f"seed {s}" for s in args.seeds)
          + " | mean | wall-clock per run |")
    print("|---|---|" + "---|" * len(args.seeds) + "---|---|")
    print("\n".join(rows))
    passed = verdicts.count("PASS")
    print(f"\nAcceptance (>= {100 * TARGET:.0f} % within {BUDGET_S:.0f} s per run, "
          f"TokenFormer-ViT): {passed} of {len(verdicts)} seed(s) pass — "
          f"{'PASS' if passed == len(verdicts) else 'FAIL'}.")


if __name__ == "__main__":
    main()
