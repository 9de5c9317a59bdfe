"""Seconds per training step of every (family, size) of a ``tokenformer scale`` preset, and the
preset's estimated wall time from them (experiments/frontier/estimates.estimate_seconds).

    python benchmarks/frontier_steps.py --preset full [--cpu-time]
    python benchmarks/frontier_steps.py --preset gpu-code --gpu-ms-per-step 32 --jobs 8
        --contention 1.5   (one command)
    python benchmarks/frontier_steps.py --preset gpu-code --jobs 8
        --measured docs/results/frontier-gpu   (one command)

The LR sweeps' extensions are not known in advance: the estimate adds one extra sweep point per
(family, size) as a margin (with every tuning seed). The chains and the held-out runs are those
of the plan-time predicted envelope (the run follows the one its tuning seeds measure: a chain
may end one size up or down; a size whose LR differs between budgets runs one more stable run
per LR). The stages run one after another (plan.stage_plans), each spread over --jobs workers.
``--gpu-ms-per-step`` measures nothing: every step of every size costs that many milliseconds
(small GPU runs are launch-bound), times ``--contention`` when --jobs > 1 runs share the GPU.
``--measured DIR`` measures nothing either: each (family, size) costs what the runs of a
``scale`` folder DIR (of any preset with the same sizes) measured, the median over its runs of
each run's mean step time at that size (``timing.step_time``); those were measured under the
folder's own ``--jobs``, so give the same --jobs (its contention is in the numbers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from common import (
    add_clock_args,
    apply_clock_args,
    command_line,
    interleaved,
    load_average,
    machine,
)

from tokenformer.experiments.frontier.arms import GROWING_ARMS
from tokenformer.experiments.frontier.configs import arch, model_configs
from tokenformer.experiments.frontier.estimates import estimate_seconds, parallel_seconds
from tokenformer.experiments.frontier.plan import stage_plans, sweep_run, swept_sizes, tuning_seeds
from tokenformer.experiments.frontier.presets import get_preset, size_key
from tokenformer.experiments.frontier.reuse import other_bases
from tokenformer.models.baselines import model_class


def measured_seconds(folder: Path) -> dict[str, float]:
    """Seconds per step of each ``"<family>-<size>"`` the runs of a ``scale`` folder trained:
    the median over runs of each run's mean at that size. A run's family is in its id (``sweep__
    tokenformer-S0__…``, ``tokenformer-S1__seed3``) or is its recipe's (``chain-paper__seed0``)."""
    per_key: dict[str, list[float]] = {}
    for path in sorted((folder / "runs").glob("*.json")):
        result = json.loads(path.read_text())
        parts = path.stem.split("__")
        recipe = next((GROWING_ARMS[p] for p in parts if p in GROWING_ARMS), None)
        scratch = next((p for p in parts if "-S" in p), None)
        family = recipe.family if recipe is not None else (
            scratch.rsplit("-S", 1)[0] if scratch else None)
        if family is None:
            continue
        for size, (steps, seconds) in result["timing"]["step_time"].items():
            if steps:
                per_key.setdefault(size_key(family, size), []).append(seconds / steps)
    if not per_key:
        raise SystemExit(f"error: no run with step times in {folder / 'runs'}")
    return {key: statistics.median(values) for key, values in per_key.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="full")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="training steps per round")
    parser.add_argument("--jobs", type=int, default=2,
                        help="also estimate `scale --jobs N` (runs of a phase over N workers)")
    parser.add_argument("--gpu-ms-per-step", type=float, default=None,
                        help="assume this many ms per step for every size instead of measuring "
                             "(a launch-bound GPU)")
    parser.add_argument("--contention", type=float, default=1.25,
                        help="with --gpu-ms-per-step and --jobs > 1: each run's slowdown from "
                             "sharing the GPU (an assumption)")
    parser.add_argument("--measured", type=Path, default=None, metavar="DIR",
                        help="each size's step time as the runs of this scale folder measured "
                             "it (under its own --jobs: pass the same --jobs)")
    add_clock_args(parser)
    args = parser.parse_args()
    clock = apply_clock_args(args)
    preset = get_preset(args.preset)
    machine_before = machine()  # with the load average at the start
    seconds: dict[str, float] = {}
    ids = torch.randint(0, 256, (preset.batch_size, preset.seq_len))
    measured = measured_seconds(args.measured) if args.measured is not None else None
    for family in dict.fromkeys([*preset.families, *other_bases(preset)]):
        for size, config in model_configs(preset, family, 256).items():
            if measured is not None:
                key = size_key(family, size)
                if key not in measured:
                    print(f"error: {args.measured} has no run of {key}", file=sys.stderr)
                    return 2
                seconds[key] = measured[key]
                continue
            if args.gpu_ms_per_step is not None:
                seconds[size_key(family, size)] = args.gpu_ms_per_step / 1000 * (
                    args.contention if args.jobs > 1 else 1.0)
                continue
            torch.manual_seed(0)
            model = model_class(arch(family))(config)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def step(model=model, opt=opt) -> None:
                for _ in range(args.steps):
                    model(input_ids=ids, labels=ids).loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad(set_to_none=True)

            t = interleaved({"step": step}, args.rounds, warmup=1)["step"]
            seconds[size_key(family, size)] = t["min"] / args.steps
    stages = stage_plans(preset, 256)
    margin = [sweep_run(preset, f, s, 1.0, 256, seed) for f in preset.families
              for s in swept_sizes(preset, f, 256) for seed in tuning_seeds(preset)]
    stages["sweep"] = stages["sweep"] + margin
    times = {name: estimate_seconds(preset, runs, seconds) for name, runs in stages.items()}
    print(f"Command: `{command_line()}`  ")
    print(f"Machine: {machine_before} (at the end: {load_average()}); timing: "
          + (f"MEASURED by the runs in {args.measured} (their --jobs)"
             if measured is not None else
             f"{args.gpu_ms_per_step:g} ms/step ASSUMED for every size (× {args.contention:g} "
             f"with --jobs {args.jobs})" if args.gpu_ms_per_step is not None else
             f"{clock}, min over {args.rounds} rounds of {args.steps} steps") + "  ")
    measures_here = measured is None and args.gpu_ms_per_step is None
    print(f"Preset `{preset.name}`: batch {preset.batch_size} × {preset.seq_len}, "
          f"{preset.dtype}" + (" (this script runs fp32)" if measures_here else "") + "\n")
    print("| family-size | ms/step |\n|---|---|")
    for key, s in seconds.items():
        print(f"| {key} | {1000 * s:.1f} |")
    print("\n| stage | runs | steps | one worker (min) |\n|---|---|---|---|")
    for name, runs in stages.items():
        print(f"| {name} | {len(runs)} | {sum(r.total_steps for r in runs):,} | "
              f"{times[name] / 60:.1f} |")
    print(f"\nEstimated: {sum(times.values()) / 60:.1f} min on one worker (the sweeps incl. "
          f"one extension per size).")
    wall = parallel_seconds(preset, [runs for runs in stages.values() if runs], seconds,
                            args.jobs)
    print(f"With --jobs {args.jobs} (each run one thread, a stage's runs over {args.jobs} "
          f"workers, the stages one after another; needs {args.jobs} idle cores): "
          f"{wall / 60:.1f} min.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
