"""``tokenformer prune``: shrink a model by removing its least important parameter tokens."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from ...data import corpus, datasets
from ...formats.loading import load_model
from ...io import checkpoint as ckpt
from ...io.files import atomic_dir
from ...io.outputs import check_output
from ...io.paths import not_found
from ...ops.pruning import PRUNE_BY, SCALES, needs_calibration, prune, prune_sizes
from .grow import copy_tokenizer

CALIBRATION_BATCH = (8, 256)  # sequences × tokens of the default calibration batch


def calibration_ids(model: torch.nn.Module, data: str = "default", tokenizer: str = "bytes",
                    batch: tuple[int, int] = CALIBRATION_BATCH) -> torch.Tensor:
    """Input ids [B, T] for calibration: evenly spread windows of a prepared dataset's training
    split (``default``: the embedded corpus, prepared with ``tokenizer``)."""
    dataset = (corpus.default_dataset(tokenizer, progress=False) if data == "default"
               else datasets.TokenDataset.open(data))
    dataset.check_vocab(model.config.vocab_size, "train")  # as adapt and train check it
    seq = min(batch[1], model.config.max_seq_len)
    windows = next(iter(dataset.eval_windows("train", seq, batch[0], max_batches=1)))
    return windows


def prune_checkpoint(checkpoint: str | Path, out: str | Path, *, qkv: str | None = None,
                     proj: str | None = None, ffn: str | None = None, by: str = "contribution",
                     scale: str = "hold", data: str = "default", tokenizer: str = "bytes",
                     overwrite: bool = False) -> dict[str, Any]:
    """Load ``checkpoint``, prune it (:func:`tokenformer.prune`, calibrated on ``data``
    when ``by``/``scale`` need it), write the model and its tokenizer files to ``out``
    atomically, with a manifest (as ``grow``). Returns parameter counts and the new config."""
    out, source = Path(out), Path(checkpoint)
    if not source.exists():
        raise not_found(source, "checkpoint")
    # every path it reads is an input: --data pout/mydata with --overwrite must not delete it
    check_output(out, [source, data if data != "default" else None, tokenizer],
                 command="prune", overwrite=overwrite)
    model = load_model(source).eval()  # a folder is checked against its manifest first
    prune_sizes(model.config, qkv, proj, ffn)  # refuse before loading calibration data
    ids = calibration_ids(model, data, tokenizer) if needs_calibration(by, scale) else None
    small = prune(model, qkv=qkv, proj=proj, ffn=ffn, by=by, calibration=ids, scale=scale)
    with atomic_dir(out, overwrite=overwrite, command="prune") as tmp:
        small.save(tmp)
        copy_tokenizer(source, tmp)
        ckpt.write_manifest(tmp)
    return {"out": str(out), "params_before": model.num_parameters(),
            "params_after": small.num_parameters(), "config": small.config.to_dict()}


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
