"""``tokenformer grow``: grow a checkpoint: parameter tokens, width by duplication, blocks
(identity or stacked)."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from ...data.tokenizer import BYTES_MARKER, TOKENIZER_FILE, HFTokenizer
from ...errors import CheckpointError, ConfigError, GrowthError
from ...formats.loading import load_model
from ...io import checkpoint as ckpt
from ...io.files import atomic_dir, atomic_write_text
from ...io.outputs import check_output
from ...io.paths import has_regular_file, not_found, read_json_object
from ...io.training_state import (
    OPTIMIZER_NAME,
    RNG_NAME,
    STATE_NAME,
    has_optimizer_state,
    load_optimizer_state,
    read_rng_state,
    save_optimizer_state,
)
from ...io.tree import save_tree
from ...models.config import flops_per_token
from ...models.memory import check_memory
from ...ops.growth import (
    HOWS,
    PLAN_KEYS,
    GrowthOptions,
    as_key,
    grow_with_optimizer,
    max_logit_change,
    plan_growth,
    recipe_names,
    refuse_unsupported,
    resets_optimizer,
    warn_old_recipe_name,
    widen_names,
    widening_refusal,
)
from ...ops.growth import grow as grow_model
from ...training.optim import rebuild_optimizer
from ..options import comma_list, seed


def grow_checkpoint(checkpoint: str | Path, out: str | Path, options: GrowthOptions, *,
                    seed: int = 0, reset_optimizer: bool = False, overwrite: bool = False,
                    progress: bool = True) -> dict[str, Any]:
    """Load ``checkpoint`` (our model directory or an official checkpoint), grow it by
    ``options`` (:func:`tokenformer.ops.growth.grow`'s request), write ``out``.

    The optimizer state beside the weights (``optimizer.safetensors``, or an earlier version's
    ``optimizer.pt``) is carried over (or reset with ``reset_optimizer``), and the trainer's
    ``trainer_state.json`` (param-group names updated to the grown model, the growth appended to
    ``grown``) and RNG state come along, so training resumes from ``out``; tokenizer files beside
    the input are copied. ``out`` is written atomically, with a manifest, and must not exist
    (``overwrite``: unless an earlier ``grow`` wrote it). Returns parameter counts before/after
    and the max |Δlogit| on a fixed probe batch.
    """
    out, source = Path(out), Path(checkpoint)
    if not source.exists():
        raise not_found(source, "checkpoint")
    check_output(out, [source], command="grow", overwrite=overwrite)
    model = load_model(source)  # a folder is checked against its manifest first
    has_state = source.is_dir() and has_optimizer_state(source)
    trainer_state = _read_trainer_state(source) if has_state else None
    # official-released starts a fresh optimizer whatever --reset-optimizer says: say so, and
    # record it, rather than "carried over"
    reset = reset_optimizer or resets_optimizer(options.recipe)
    carried = has_state and not reset
    # Before any tensor is made: the whole request checked, then the memory for the grown
    # weights, a working copy, and two moments if carried.
    planned = plan_growth(model.config, options)
    check_memory(planned, 4 if carried else 2, "the grown model")
    kwargs = dict(generator=torch.Generator().manual_seed(seed), copy=False,
                  progress=progress)  # the input model is only read
    optimizer = None
    if has_state:
        optimizer = _optimizer_from_checkpoint(model, source)
        grown, optimizer = grow_with_optimizer(model, optimizer, options, reset_optimizer=reset,
                                               **kwargs)
    else:
        grown = grow_model(model, options, **kwargs)
    delta, largest = max_logit_change(model, grown)
    if not (math.isfinite(delta) and math.isfinite(largest)):
        width_noise = options.width_noise
        noise = f" (--width-noise {width_noise:g}: lower it)" if width_noise else ""
        raise GrowthError(f"the grown model's logits are NaN or infinite on a fixed probe batch "
                          f"(max |Δlogit| {delta:g}){noise}; nothing written to {out}")
    with atomic_dir(out, overwrite=overwrite, command="grow") as tmp:
        grown.save(tmp)
        if optimizer is not None:
            save_optimizer_state(tmp, optimizer)
            if trainer_state is not None:
                _write_trainer_state(source, trainer_state, tmp, grown, optimizer, {
                    "from": str(source), **options.recorded(), "seed": seed,
                    "reset_optimizer": reset})
        copy_tokenizer(source, tmp)
        ckpt.write_manifest(tmp)
    return {"out": str(out), "params_before": model.num_parameters(),
            "params_after": grown.num_parameters(), "max_abs_logit_change": delta,
            "max_abs_logit": largest, "optimizer": optimizer is not None,
            "reset_optimizer": reset, "recipe": options.recipe, "how": options.how,
            "config_before": model.config, "config": grown.config.to_dict(),
            "grown_config": grown.config}


def _read_trainer_state(source: Path) -> dict[str, Any] | None:
    """The trainer state beside the weights (None: none), its growth history checked before any
    work: a list of growth records (one JSON object per earlier ``grow``)."""
    state_file = source / STATE_NAME
    if not has_regular_file(state_file, folder=source):
        return None
    state = read_json_object(state_file)
    grown = state.get("grown", [])
    if not (isinstance(grown, list) and all(isinstance(g, dict) for g in grown)):
        raise CheckpointError(f"{state_file}: grown is {grown!r}, expected a list of growth "
                              f"records (one object per earlier tokenformer grow); restore the "
                              f"file from the run or grow that wrote it")
    return state


def _write_trainer_state(source: Path, state: dict[str, Any], out: Path,
                         model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         growth: dict[str, Any]) -> None:
    """``state`` (:func:`_read_trainer_state`) with the grown param-group names and ``growth``
    appended to ``grown``, and the RNG state, into ``out``."""
    names = {id(p): n for n, p in model.named_parameters()}
    state["param_groups"] = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    state["grown"] = [*state.get("grown", []), growth]
    atomic_write_text(out / STATE_NAME, json.dumps(state, indent=2) + "\n")
    rng = read_rng_state(source)  # re-written: an earlier version's rng.pt becomes ours
    if rng is not None:
        save_tree(out / RNG_NAME, rng)


def copy_tokenizer(source: Path, target: Path) -> None:
    """Copy the tokenizer files saved beside a model directory (none for a checkpoint file), so
    a model derived from it (grown, pruned, merged) keeps its tokenizer. Each must be a regular
    file inside the folder (a link is refused, never followed: docs/reliability.md) that parses:
    an output is never given a tokenizer nothing can load."""
    if not source.is_dir():
        return
    for name in (TOKENIZER_FILE, BYTES_MARKER, "tokenizer_config.json",
                 "special_tokens_map.json"):
        if has_regular_file(source / name, "tokenizer file", folder=source):
            if name == TOKENIZER_FILE:
                HFTokenizer(source / name, folder=source)
            else:
                read_json_object(source / name)
            shutil.copy2(source / name, target / name)


def _optimizer_from_checkpoint(model: torch.nn.Module, directory: Path) -> torch.optim.Optimizer:
    """An AdamW over ``model`` holding the saved state, its groups named as
    :func:`_group_names` finds them (:func:`tokenformer.training.optim.rebuild_optimizer`)."""
    state = load_optimizer_state(directory)
    names = _group_names(state["param_groups"], directory,
                         [n for n, _ in model.named_parameters()])
    return rebuild_optimizer(model, names, state, directory / OPTIMIZER_NAME)


def _group_names(groups: list[dict[str, Any]], directory: Path,
                 model_names: list[str]) -> list[list[str]]:
    """Parameter names of each saved param group: from the state dict (optimizers built from
    ``named_parameters``), else from the trainer's state file, else, for a single group covering
    every parameter, the model's own order."""
    if all("param_names" in g for g in groups):
        return [list(g["param_names"]) for g in groups]
    state_file = directory / STATE_NAME
    if has_regular_file(state_file, folder=directory):
        value = read_json_object(state_file).get("param_groups")
        if (isinstance(value, list) and len(value) == len(groups)
                and all(isinstance(g, list) for g in value)):
            return [list(g) for g in value]
    if len(groups) == 1 and len(groups[0]["params"]) == len(model_names):
        return [model_names]
    raise CheckpointError(f"{directory / OPTIMIZER_NAME} has {len(groups)} parameter "
                          f"groups but does not name their parameters; pass --reset-optimizer "
                          f"to grow without carrying it over")


def size_lines(before: Any, after: Any, seq_len: int | None = None) -> list[str]:
    """Shape, parameters and FLOPs per token of a model before and after a growth, one line each
    (``tokenformer grow`` and ``tokenformer info --grow``); any LM config, TokenFormer or
    baseline."""
    def change(a: Any, b: Any) -> str:
        return f"{a} -> {b}" if a != b else f"{a}"

    shape = [("layers", "num_layers"), ("hidden", "hidden_size"), ("heads", "num_heads")]
    shape += ([("qkv", "qkv_tokens"), ("proj", "proj_tokens"), ("ffn", "ffn_tokens")]
              if hasattr(before, "qkv_tokens") else [("mlp", "intermediate_size")])
    lines = ["shape        " + "   ".join(
        f"{label} {change(getattr(before, key), getattr(after, key))}" for label, key in shape)]
    n0, n1 = before.num_parameters(), after.num_parameters()
    lines.append(f"parameters   {n0:,} -> {n1:,} (x{n1 / n0:.3g})")
    for mode, training in (("forward", False), ("training", True)):
        f0 = flops_per_token(before, seq_len, training)["total"]
        f1 = flops_per_token(after, seq_len, training)["total"]
        lines.append(f"FLOPs/token  {f0:.4g} -> {f1:.4g} {mode} (x{f1 / f0:.3g}, context "
                     f"{seq_len or before.max_seq_len})")
    return lines


def run(args: argparse.Namespace) -> None:
    if args.out is not None and args.out_dir is not None and args.out != args.out_dir:
        raise ConfigError(f"two outputs given ({args.out_dir} and --out {args.out}); give one")
    out = args.out or args.out_dir
    if out is None:
        raise ConfigError("give the output directory: tokenformer grow IN OUT (or --out OUT)")
    refuse_unsupported({key: value for key in ("vocab_size",)  # before loading a checkpoint
                        if (value := getattr(args, key)) is not None})
    if args.strategy is not None:  # --recipe's old name
        warn_old_recipe_name("--strategy", "--recipe")
        args.recipe = args.strategy if args.recipe is None else args.recipe
    args.recipe = args.recipe or "exact"
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
