"""``tokenformer scale``: the progressive-scaling experiment (grown TokenFormer vs alternatives)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from ..cli import device, positive
from ..errors import ConfigError
from ..grow import NEW_ROW_MOMENTS


def scale(args: argparse.Namespace) -> int:
    import torch

    from ..experiments.scale import describe_plan, get_preset, run_scale

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {}
    if args.arms:
        overrides["arms"] = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    if args.steps:
        try:
            overrides["stage_steps"] = tuple(int(s) for s in args.steps.split(","))
        except ValueError:
            raise ConfigError(f"--steps expects comma-separated integers, got {args.steps!r}"
                              ) from None
    preset = get_preset(args.preset, args.device, new_row_moments=args.new_row_moments,
                        **overrides)
    progress = False if args.no_progress else None
    if args.plan:
        print(describe_plan(preset, seeds=args.seeds, data=args.data, device=args.device,
                            dtype=args.dtype, measure=args.measure, progress=progress))
        return 0
    command = "tokenformer scale " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["scale"] \
        else "tokenformer scale"
    out = args.out or f"runs/scale-{args.preset}"
    with experiment_folder(out, [args.data], "scale"):
        run_scale(preset, seeds=args.seeds, data=args.data, out=out, device=args.device,
                  dtype=args.dtype, progress=progress, command=command)
    return 0


def experiment_folder(out: str, inputs: list[str | None], command: str
                      ) -> contextlib.AbstractContextManager[Path]:
    """The experiment's output folder, checked (not an input, not someone else's folder) and
    held for the run: a rerun resumes it, a concurrent one is refused."""
    from ..outputs import check_run_folder, hold_run_folder

    check_run_folder(out, inputs, command=command,
                     legacy=("results.json", "report.md", ".partial.json", "runs"))
    return hold_run_folder(out, command=command)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scale", help="progressive scaling experiment: grown TokenFormer vs training from scratch, "
                      "the small model trained longer and Transformer baselines",
        description="Train every arm of the progressive-scaling experiment (issue 5) and write "
                    "report.md, results.json and PNG plots into --out. A run interrupted part-way "
                    "resumes when rerun with the same arguments.")
    p.add_argument("--preset", choices=("quick", "full"), default="quick",
                   help="quick: few arms, one seed, <= 15 min on 2 CPU cores (default); full: "
                        "every arm, 3 seeds for the deciding arms, <= 2 h")
    p.add_argument("--seeds", type=positive(int), default=None,
                   help="seeds of the deciding arms (default: the preset's)")
    p.add_argument("--data", default=None,
                   help="prepared dataset directory (default: the embedded corpus, bytes)")
    p.add_argument("--out", default=None, help="output directory (default: runs/scale-PRESET)")
    p.add_argument("--device", type=device, default="cpu",
                   help="cpu or cuda (cuda uses larger sizes)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32", "bfloat16", "float32"),
                   help="training precision (default: the preset's, bf16 autocast)")
    p.add_argument("--arms", default=None,
                   help="comma-separated arms to run (default: the preset's; every arm is "
                        "listed by --plan --preset full)")
    p.add_argument("--steps", default=None,
                   help="steps per chain stage, e.g. 200,100,100 (default: the preset's)")
    p.add_argument("--threads", type=positive(int), default=None, help="torch CPU threads")
    p.add_argument("--new-row-moments", choices=NEW_ROW_MOMENTS, default="zero",
                   help="grown TokenFormer arms that carry AdamW over: start the new rows' second "
                        "moments at zero (default) or at the old rows' mean")
    p.add_argument("--plan", action="store_true",
                   help="print the arms, their steps and FLOPs and a time estimate; train nothing")
    p.add_argument("--measure", action="store_true",
                   help="with --plan: measure each model's throughput here (a few steps each) "
                        "instead of using the reference numbers")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=scale)
