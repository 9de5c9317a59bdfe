"""``tokenformer prune``: shrink a model by removing its least important parameter tokens."""

from __future__ import annotations

import argparse

from ...checkpoints import prune_checkpoint
from ...ops.pruning import PRUNE_BY, SCALES


def run(args: argparse.Namespace) -> None:
    s = prune_checkpoint(args.model, args.out, qkv=args.qkv, proj=args.proj, ffn=args.ffn,
                         by=args.by, scale=args.scale, data=args.data, tokenizer=args.tokenizer,
                         overwrite=args.overwrite)
    c = s["config"]
    print(f"pruned {args.model} -> {s['out']} (by {args.by}, scale {args.scale})")
    print(f"tokens       qkv {c['qkv_tokens']}   proj {c['proj_tokens']}   ffn {c['ffn_tokens']}")
    print(f"parameters   {s['params_before']:,} -> {s['params_after']:,}")
    print("fine-tune with: tokenformer train --config CONFIG --init-from OUT --steps N")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prune", help="shrink a model by removing its least important parameter "
                                     "tokens (the inverse of grow)")
    p.add_argument("model", help="model directory (ours) or an official checkpoint")
    p.add_argument("out", help="output directory (must not exist)")
    for kind in ("qkv", "proj", "ffn"):
        p.add_argument(f"--{kind}", default=None, metavar="N|Kx",
                       help=f"new {kind} token count, absolute or a multiplier like 0.5x")
    p.add_argument("--by", choices=PRUNE_BY, default="contribution",
                   help="token importance (docs/sparse.md): contribution = mean |Θ|·‖v‖ over a "
                        "calibration batch (default), mass = mean |Θ|, value = ‖v‖, newest = "
                        "undo growth")
    p.add_argument("--scale", choices=SCALES, default="hold",
                   help="Θ's factor: hold (default), follow the new n, or renorm (calibrated)")
    p.add_argument("--data", default="default",
                   help="calibration data: a prepared dataset directory, or default (the "
                        "embedded corpus)")
    p.add_argument("--tokenizer", default="bytes",
                   help="tokenizer of the default corpus (bytes, bpe:VOCAB, tokenizer.json)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if an earlier tokenformer prune wrote it")
    p.set_defaults(func=run)
