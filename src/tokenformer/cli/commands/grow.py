"""``tokenformer grow``: grow a checkpoint: parameter tokens, width by duplication, blocks
(identity or stacked)."""

from __future__ import annotations

import argparse

from ...checkpoints import grow_checkpoint
from ...errors import ConfigError, GrowthError
from ...ops.growth import (
    HOWS,
    PLAN_KEYS,
    GrowthOptions,
    as_key,
    recipe_names,
    refuse_unsupported,
    size_lines,
    take_old_recipe_key,
    widen_names,
    widening_refusal,
)
from ..options import comma_list, seed


def run(args: argparse.Namespace) -> None:
    if args.out is not None and args.out_dir is not None and args.out != args.out_dir:
        raise ConfigError(f"two outputs given ({args.out_dir} and --out {args.out}); give one")
    out = args.out or args.out_dir
    if out is None:
        raise ConfigError("give the output directory: tokenformer grow IN OUT (or --out OUT)")
    refuse_unsupported({key: value for key in ("vocab_size",)  # before loading a checkpoint
                        if (value := getattr(args, key)) is not None})
    # --recipe's old name: one warning, refused beside --recipe (as strategy= is in Python)
    given = {k: v for k, v in (("recipe", args.recipe), ("strategy", args.strategy)) if v}
    given = take_old_recipe_key(given, "--strategy", "--recipe", ConfigError, "grow: ")
    args.recipe = given.get("recipe", "exact")
    # The options' fields are this parser's destinations (register below).
    options = GrowthOptions(**{key: getattr(args, key) for key in PLAN_KEYS})
    refusal = widening_refusal(options, _flag)  # the flags alone decide it: before loading
    if refusal is not None:
        raise GrowthError(refusal)
    summary = grow_checkpoint(args.checkpoint, out, options, seed=args.seed,
                              reset_optimizer=args.reset_optimizer, overwrite=args.overwrite,
                              progress=not args.no_progress)
    rel = summary["max_abs_logit_change"] / max(summary["max_abs_logit"], 1e-30)
    optimizer = "none found"
    if summary["optimizer"] and not summary["reset_optimizer"]:
        optimizer = "carried over"
    elif summary["optimizer"]:
        optimizer = ("reset: a fresh optimizer, as --recipe official-released always starts"
                     if not args.reset_optimizer else "reset (--reset-optimizer)")
    parts = []
    if args.hidden is not None:
        noise = f", noise {args.width_noise:g}" if args.width_noise else ""
        parts.append(f"width {args.hidden} by duplication{noise}")
    if args.layers is not None:
        parts.append(f"layers {args.layers} " + ("stacked" if args.how == "stack" else
                                                  f"by inserted blocks ({args.recipe})"))
    if not hasattr(summary["config_before"], "qkv_tokens") and args.ffn is not None:
        how = "duplication" if args.widen == "duplicate" else f"{args.widen} widening"
        parts.append(f"mlp {args.ffn} by {how}")  # a baseline: no parameter tokens
    elif any(getattr(args, kind) is not None for kind in ("qkv", "proj", "ffn")):
        parts.append(f"{args.recipe} tokens")
    print(f"grew {args.checkpoint} -> {summary['out']} ({'; '.join(parts) or 'a copy'})")
    for line in size_lines(summary["config_before"], summary["grown_config"]):
        print(line)
    print(f"max |Δlogit| {summary['max_abs_logit_change']:.3g} on a fixed 2x32 probe batch "
          f"(relative {rel:.3g})")
    print(f"optimizer    {optimizer}")


def _flag(key: str, value: object = None) -> str:
    """A growth option as this command's flags write it: ``--ffn 64``, ``--width-noise`` (the
    key form, ``width-noise=0.1``, with the flag's dashes and a space for its ``=``)."""
    return "--" + as_key(key.replace("_", "-"), value).replace("=", " ", 1)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("grow", help="grow a checkpoint: parameter tokens, width (duplication), "
                                    "blocks (identity or stacked)")
    p.add_argument("checkpoint", help="model directory (ours, or a training checkpoint) or an "
                                      "official checkpoint")
    p.add_argument("out_dir", nargs="?", default=None, metavar="OUT",
                   help="output directory (must not exist); or --out")
    for kind in ("qkv", "proj", "ffn"):
        p.add_argument(f"--{kind}", default=None, metavar="N|Kx",
                       help=f"new {kind} token count, absolute or a multiplier like 2x"
                            + (" (a Transformer baseline: its MLP width, a whole multiple "
                               "unless --widen zero|net2net)"
                               if kind == "ffn" else ""))
    p.add_argument("--hidden", default=None, metavar="N|Kx",
                   help="new hidden size, a whole multiple (2x, 4x, or 1536 from 768): exact "
                        "width growth by duplication (docs/growth.md)")
    p.add_argument("--heads", type=int, default=None, metavar="N",
                   help="heads after --hidden (default and only exact value: r times the old, "
                        "head size kept)")
    p.add_argument("--width-noise", type=float, default=0.0, metavar="STD",
                   help="zero-sum noise on the duplicated units, std relative to each tensor's "
                        "RMS (breaks their symmetry; the function stays exact; default 0, "
                        "HyperCloning used 0.32)")
    p.add_argument("--widen", choices=tuple(widen_names()), default="duplicate",
                   help="a Transformer baseline's MLP growth with --ffn: "
                        + "; ".join(f"{name}: {what}" for name, what in widen_names().items()))
    p.add_argument("--layers", default=None, metavar="N|Kx",
                   help="new total number of blocks (see --how)")
    p.add_argument("--how", choices=HOWS, default="identity",
                   help="new blocks: identity (inserted at --positions; exact under the exact "
                        "recipe) or stack (the trained blocks repeated in order, G_stack)")
    p.add_argument("--positions", type=comma_list(int, "block indices"), default=None,
                   help="comma-separated indices of the new blocks in the grown model "
                        "(default: spread evenly)")
    p.add_argument("--recipe", choices=recipe_names(), default=None,
                   help="how the new tokens and inserted blocks are drawn (default exact; "
                        "docs/growth.md)")
    p.add_argument("--strategy", choices=recipe_names(), default=None,
                   help=argparse.SUPPRESS)  # --recipe's old name, deprecated
    p.add_argument("--seed", type=seed, default=0, help="seed of the new random rows")
    p.add_argument("--reset-optimizer", action="store_true",
                   help="fresh optimizer state instead of carrying it over (the released code)")
    # Accepted only to explain why it cannot be grown.
    p.add_argument("--vocab", dest="vocab_size", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="output directory (must not exist)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the output if an earlier tokenformer grow wrote it (never a "
                        "folder it did not write)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
