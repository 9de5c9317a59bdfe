"""``tokenformer ablate``: the paper's ablations (Θ variants, block-norm weight/bias) rerun here."""

from __future__ import annotations

import argparse

import torch

from ...experiments.ablate import PRESETS, STUDIES, TASKS, run_ablation
from ..options import positive
from ..runs import command_line, experiment_folder


def ablate(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    command = command_line("ablate")

    out = args.out or f"runs/ablate-{args.study}-{args.task}-{args.preset}"
    with experiment_folder(out, [args.data], "ablate"):
        run_ablation(args.study, args.task, args.preset, seeds=args.seeds,
                     variants=args.variants, steps=args.steps, lr=args.lr, data=args.data,
                     out=out,
                     progress=False if args.no_progress else None, command=command)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    variants = "; ".join(f"{s.name}: {', '.join(s.variants)}" for s in STUDIES.values())
    p = sub.add_parser(
        "ablate", help="the paper's ablations: Θ variants or block-norm weight/bias, on the LM "
                       "or the vision model, beside the paper's numbers",
        description="Train every variant of a study with the same budget, initialisation and "
                    "data order per seed, and write report.md, results.json and PNG plots "
                    "(final metric per variant with its spread over seeds, learning curves) "
                    "into --out, with the paper's ImageNet numbers side by side. Each variant "
                    "first gets its own LR: a factor-2 sweep around the preset's LR on a "
                    "tuning seed (100) that is not reported, grown past an edge pick (sweep.png "
                    "and the report's table). A run interrupted part-way resumes when rerun "
                    "with the same arguments.")
    p.add_argument("--study", required=True, choices=tuple(STUDIES),
                   help="theta: nonlinearity × normalisation inside Θ; norm: learnable "
                        "weight/bias in the block LayerNorms")
    p.add_argument("--task", required=True, choices=tuple(TASKS),
                   help="lm: the embedded corpus (validation bits per byte); vision: digits "
                        "(test top-1)")
    p.add_argument("--preset", choices=tuple(PRESETS["lm"]), default="quick",
                   help="quick: a few minutes on 2 CPU cores (default); full: the documented "
                        "run (5 seeds × 400 steps after the LR sweeps)")
    p.add_argument("--seeds", type=positive(int), default=None,
                   help="number of seeds (default: the preset's)")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated subset of the study's variants ({variants})")
    p.add_argument("--steps", type=positive(int), default=None,
                   help="training steps per run (default: the preset's)")
    p.add_argument("--lr", type=positive(float), default=None,
                   help="pin this peak LR for every variant and skip the per-variant LR sweeps "
                        "(default: tune; an untuned comparison may handicap a variant)")
    p.add_argument("--data", default=None,
                   help="--task lm: a prepared dataset directory (default: the embedded corpus)")
    p.add_argument("--out", default=None,
                   help="output directory (default: runs/ablate-STUDY-TASK-PRESET)")
    p.add_argument("--threads", type=positive(int), default=1,
                   help="torch CPU threads (default 1: the small models gain little from a "
                        "second thread, and on a busy machine it spins; run studies side by "
                        "side instead)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=ablate)
