"""A check made after v5's `full` run (not pre-registered): R3 at k = 400 with its LR below the
grid's lower end.

In the run, the base trained on at k = 400 (R3, ``continued@k400``) picked ×⅛ of S0's sweep
pick (0.032) at every X, the lowest factor after two extensions, so it may have been
handicapped where growth beat it (X = 1). This trains ``continued@k400`` at a factor of that
pick from the very base the run used (``runs/full-v5/models``: the tuning seeds' horizon base,
or the held-out seed's base), through the runner's own ``execute``, into a scratch folder, and
prints each X branch's validation loss. At the run's own factor (0.125) it reproduces the run's
record bit for bit (seed 0: 1.5175116502628432, 1.4960892744252843, 1.4681286890375027).

    python benchmarks/v5_r3_lower_lr.py --run runs/full-v5 --out runs/v5-r3 --factor 0.0625 \\
        --seeds 1000 1001          # tuning seeds: on the tuning window
    python benchmarks/v5_r3_lower_lr.py --run runs/full-v5 --out runs/v5-r3 --factor 0.0625 \\
        --seeds 0 1 2 3 4 5 6 7    # held-out seeds: on the scoring window

Results (2026-11-28, AMD EPYC Zen 3): docs/results.md's v5 verdict, "Where the grid limits".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from tokenformer.experiments.frontier import one_run, reuse, state
from tokenformer.experiments.frontier.presets import get_preset, is_tuning_seed
from tokenformer.experiments.frontier.run import _continuation_maker

ARM = "continued@k400"  # R3 at k = 400: its level, sweep pick and tuning bases are the run's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, default=Path("runs/full-v5"))
    parser.add_argument("--out", type=Path, default=Path("runs/v5-r3"))
    parser.add_argument("--factor", type=float, default=0.0625)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1000, 1001])
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the run's workers
    src = args.run.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.out / "models").exists():  # the run's finished bases, read only
        (args.out / "models").symlink_to(src / "models")
    preset = get_preset("full")
    ctx = state.context(preset, None, "cpu", None, False, args.out, print)
    results = json.loads((src / "results.json").read_text())
    runs, tuned = results["runs"], results["tuning"]["reuse"][ARM]
    level = tuned["level"]
    tuning_bases = {int(b.rsplit("seed", 1)[1]): b for b in tuned["bases"]}
    for seed in args.seeds:
        if is_tuning_seed(seed):
            origin = tuning_bases[seed]
            name = f"tune/continued@k400/x{args.factor:g}/seed{seed}"
        else:  # the held-out base with a cooled branch at k = 400
            origin = next(r["id"] for r in runs.values()
                          if r["arm"] == "tokenformer-S0" and r["seed"] == seed
                          and any(b["budget_index"] == level for b in r["branches"]))
            name = f"held/continued@k400/x{args.factor:g}/seed{seed}"
        template = reuse.continuation_run(preset, tuned["arm"], level, seed,
                                          ctx.dataset.vocab_size, origin=origin)
        run, lrs = _continuation_maker(tuned["lr0"])(template, args.factor)
        run = dataclasses.replace(run, id=name)
        result = one_run.execute(ctx, run, lrs)
        for b in result["branches"]:
            x = b["budget"] / preset.budgets[level]
            print(f"{name} lr {lrs[0]:g} X {x:.3g}: loss {b['loss']!r}")


if __name__ == "__main__":
    main()
