"""Seconds per training step of every (family, size) of a ``tokenformer scale`` preset, and the
preset's estimated wall time from them (experiments/frontier/plan.estimate_seconds).

    python benchmarks/frontier_steps.py --preset full [--cpu-time]

The LR sweeps' extensions are not known in advance: the estimate adds one extra sweep point per
(family, size) as a margin (with every sweep seed). The chains are those of the plan-time
predicted envelope (the run follows the measured one: a chain may end one size up or down).
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import (
    add_clock_args,
    apply_clock_args,
    command_line,
    interleaved,
    load_average,
    machine,
)

from tokenformer.experiments.frontier.plan import (
    arch,
    estimate_seconds,
    model_configs,
    parallel_seconds,
    plan,
    sweep_plan,
    sweep_run,
    sweep_seeds,
)
from tokenformer.experiments.frontier.presets import family_sizes, get_preset, size_key
from tokenformer.models.baselines import model_class


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="full")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="training steps per round")
    parser.add_argument("--jobs", type=int, default=2,
                        help="also estimate `scale --jobs N` (runs of a phase over N workers)")
    add_clock_args(parser)
    args = parser.parse_args()
    clock = apply_clock_args(args)
    preset = get_preset(args.preset)
    machine_before = machine()  # with the load average at the start
    seconds: dict[str, float] = {}
    ids = torch.randint(0, 256, (preset.batch_size, preset.seq_len))
    for family in preset.families:
        for size, config in model_configs(preset, family, 256).items():
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
    runs = plan(preset, 256)
    sweeps = sweep_plan(preset, 256)
    margin = [sweep_run(preset, f, s, 1.0, 256, seed) for f in preset.families
              for s in family_sizes(preset, f) for seed in sweep_seeds(preset)]
    final = estimate_seconds(preset, runs, seconds)
    sweep = estimate_seconds(preset, sweeps + margin, seconds)
    print(f"Command: `{command_line()}`  ")
    print(f"Machine: {machine_before} (at the end: {load_average()}); timing: "
          f"{clock}, min over {args.rounds} rounds of {args.steps} steps  ")
    print(f"Preset `{preset.name}`: batch {preset.batch_size} × {preset.seq_len}, "
          f"{preset.dtype} (this script runs fp32)\n")
    print("| family-size | ms/step |\n|---|---|")
    for key, s in seconds.items():
        print(f"| {key} | {1000 * s:.1f} |")
    print(f"\nEstimated: LR sweeps {sweep / 60:.1f} min (incl. one extension per size), final "
          f"runs {final / 60:.1f} min, total {(sweep + final) / 60:.1f} min "
          f"({len(sweeps)} + {len(runs)} runs).")
    phases = [sweeps + margin, [r for r in runs if r.kind == "scratch"],
              [r for r in runs if r.kind != "scratch"]]
    wall = parallel_seconds(preset, phases, seconds, args.jobs)
    print(f"With --jobs {args.jobs} (each run one thread, a phase's runs over {args.jobs} "
          f"workers, the phases one after another; needs {args.jobs} idle cores): "
          f"{wall / 60:.1f} min.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
