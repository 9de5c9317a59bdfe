"""``tokenformer scale``: the loss-vs-compute frontier (from-scratch envelopes vs growth chains)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ...data.datasets import TokenDataset
from ...errors import ConfigError
from ...experiments.frontier import COMPILE, PRESETS, describe, get_preset, run_frontier
from ...io.files import stop_on_disk_full
from ...training.signals import interrupt_on_signal
from ..options import device, positive
from ..runs import command_line, experiment_folder


def scale(args: argparse.Namespace) -> int:
    if args.jobs > 1 and (args.threads or 1) > 1:
        raise ConfigError("scale: --jobs runs each run with one thread; drop --threads (or "
                          "give --threads 1)")
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {"seeds": args.seeds} if args.seeds else {}
    preset = get_preset(args.preset, **overrides)
    if args.plan:
        vocab = 256  # the embedded corpus is byte-level
        if args.data:
            vocab = TokenDataset.open(args.data).vocab_size
        print(describe(preset, vocab))
        return 0

    out = args.out or f"runs/scale-{args.preset}"
    # finished runs and in-progress states are written atomically as the experiment goes
    kept = (f"finished runs are kept in {Path(out) / 'runs'} and the run in progress at its last "
            f"branch or growth point in {Path(out) / 'state'}")
    with interrupt_on_signal(f"{kept}; rerun the same command to resume"), \
            stop_on_disk_full(out, f"{kept}; free space and rerun the same command to resume"):
        run_frontier(preset, data=args.data, out=out, device=args.device, dtype=args.dtype,
                     progress=False if args.no_progress else None,
                     command=command_line("scale") or "tokenformer scale",
                     hold=lambda out, inputs: experiment_folder(str(out), inputs, "scale"),
                     jobs=args.jobs, compile=args.compile)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scale", help="loss-vs-compute frontier: a finished TokenFormer grown vs every other "
                      "use of the same compute, and growth from scratch vs the best size, "
                      "tuned LRs, one WSD schedule family",
        description="LR sweeps, then one stable WSD run per arm and seed with a cooldown branch "
                    "at each budget; writes results.json, report.md and PNG plots into --out. "
                    "Rerunning the same command resumes an interrupted run.")
    p.add_argument("--preset", choices=tuple(PRESETS), default="quick",
                   help="quick: v5's reuse family in miniature, one seed (about 4 min on 2 CPU "
                        "cores); full: v5 (a finished base grown vs R1-R4, and G1; 8 held-out "
                        "seeds); full-v4, quick-v3: the earlier protocols (v4's recorded run "
                        "resumes); sparse: product-key TokenFormer (16x FFN tokens at equal "
                        "FLOPs) vs dense TokenFormer and Transformer++, 3 seeds; gpu: the v3 "
                        "protocol at GPU sizes (needs --data); gpu-code: v4 on the Python sources "
                        "of torch, transformers and sympy; gpu-v5: v5's reuse family at a 10.5M "
                        "base on those sources (planned, not run)")
    p.add_argument("--seeds", type=positive(int), default=None,
                   help="seeds of every final run (default: the preset's)")
    p.add_argument("--data", default=None,
                   help="prepared dataset directory (default: the embedded corpus, bytes)")
    p.add_argument("--out", default=None, help="output directory (default: runs/scale-PRESET)")
    p.add_argument("--device", type=device, default="cpu",
                   help="cpu or cuda")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32", "bfloat16", "float32"),
                   help="training precision (default: the preset's)")
    p.add_argument("--threads", type=positive(int), default=None, help="torch CPU threads")
    p.add_argument("--jobs", type=positive(int), default=1,
                   help="runs trained at once, each in its own process with one thread (2 on 2 "
                        "idle cores roughly halves a long preset; the numbers equal a "
                        "sequential --threads 1 run's)")
    p.add_argument("--compile", choices=COMPILE, default="off",
                   help="every training step under torch.compile in this mode: default "
                        "(inductor), reduce-overhead (inductor, forward and backward replayed as "
                        "CUDA graphs: a few launches instead of hundreds, for a GPU's small "
                        "runs), "
                        "max-autotune-no-cudagraphs; off: eager. Part of the experiment's "
                        "fingerprint: a folder is resumed in the mode it was started in")
    p.add_argument("--plan", action="store_true",
                   help="print every arm's sizes, growth steps, budgets and FLOPs; train nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    p.set_defaults(func=scale)
