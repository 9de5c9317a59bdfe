"""``tokenformer vision info|train|eval``: the Vision TokenFormer on digits or an image folder.

The library functions are :func:`tokenformer.training.vision.train_vision` and
:func:`tokenformer.eval.vision.evaluate`; this module parses arguments and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import typing
from typing import Any

from ...data.images import ImageFolder
from ...errors import ConfigError
from ...eval.vision import evaluate, save_confusion_png
from ...io.outputs import check_output
from ...models.vit import TokenFormerViTConfig, ViTConfig, load_vision_model
from ...training.config import coerce
from ...training.vision import EVAL_BATCH, open_vision_data, train_vision
from ..options import DeprecatedAppend, add_config_flags, config_overrides, seed


# -------------------------------------------------------------------------------------- info
def vision_info(preset: str, arch: str = "tokenformer") -> str:
    """Sizes, exact parameter count (by part) and training FLOPs per image of a preset."""
    tf = TokenFormerViTConfig.from_name(preset)
    config = tf if arch == "tokenformer" else ViTConfig.matched_to(tf)
    c = config
    if isinstance(c, TokenFormerViTConfig):
        blocks = (f"tokens       qkv {c.qkv_tokens}   proj {c.proj_tokens}   ffn {c.ffn_tokens}"
                  f"   Θ {c.norm}")
    else:
        blocks = f"MLP          {c.intermediate_size} (standard ViT, matched to {preset})"
    return "\n".join([
        f"model        {c.name} ({arch})",
        f"image        {c.image_size}×{c.image_size}×{c.num_channels}, patches "
        f"{c.patch_size}×{c.patch_size} ({c.num_patches}), pool {c.pool}, "
        f"{c.num_classes} classes",
        f"layers       {c.num_layers}   hidden {c.hidden_size}   heads {c.num_heads}",
        blocks,
        f"parameters   {c.num_parameters():,} total = {c.num_layers} × "
        f"{c.block_parameters():,} (blocks) + {c.stem_parameters():,} (patch embedding, "
        f"positions{', class token' if c.pool == 'cls' else ''}, final norm, head)",
        f"FLOPs        {c.training_flops_per_image():.4g} per training image "
        f"({c.training_flops_per_image() / 3:.4g} forward)",
    ])


def _parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """The deprecated ``--set KEY=VALUE`` pairs (a value is JSON where it parses, else a string)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _model_overrides(a: argparse.Namespace) -> dict[str, Any]:
    """``--model.KEY VALUE`` values, each coerced to the vision config field's type."""
    hints = typing.get_type_hints(TokenFormerViTConfig)
    return {key: coerce(value, hints[key], f"model.{key}")
            for key, value in config_overrides(a, "model").items()}


def _train_command(a: argparse.Namespace) -> None:
    overrides = {k: v for k, v in (("steps", a.steps), ("batch_size", a.batch_size),
                                    ("lr", a.lr), ("seed", a.seed), ("threads", a.threads))
                 if v is not None}
    if a.lr is not None:
        overrides["min_lr"] = a.lr / 10  # the default recipe's ratio
    model_overrides = {**_parse_overrides(a.model_set), **_model_overrides(a)}
    if a.data != "digits":
        model_overrides.setdefault("num_classes", len(ImageFolder(a.data, "train").classes))
    run = train_vision(a.preset, a.data, arch=a.arch, out=a.out, max_shift=a.max_shift,
                       model_overrides=model_overrides, workers=_workers(a),
                       progress=False if a.no_progress else None, **overrides)
    fitted = run.fit
    print(f"{run.model.config.name} ({a.arch}, {run.model.num_parameters():,} parameters): "
          f"top-1 {100 * run.evaluation.accuracy:.2f}% on {a.data} "
          f"after {fitted.step} steps, {fitted.elapsed:.1f} s")
    if a.out is not None:
        print(f"run directory {a.out} (final/ checkpoint, metrics.jsonl, results.json)")
        print(f"confusion matrix {run.confusion_png}" if run.confusion_png else
              "confusion matrix PNG skipped: matplotlib is not installed "
              "(pip install 'tokenformer[plot]')")


def _workers(a: argparse.Namespace) -> int:
    """--workers, default: every core but one (decoding is per image; digits ignore it)."""
    if a.workers is not None:
        if a.workers < 0:
            raise ConfigError(f"--workers must be >= 0, got {a.workers}")
        return a.workers
    return 0 if a.data == "digits" else min(8, max(0, (os.cpu_count() or 1) - 1))


def _eval_command(a: argparse.Namespace) -> None:
    if a.confusion_png:
        check_output(a.confusion_png, [a.model, a.data if a.data != "digits" else None],
                     command="vision eval", overwrite=a.overwrite, kind="file",
                     flag="--confusion-png")
    model = load_vision_model(a.model)
    vdata = open_vision_data(a.data, model.config, EVAL_BATCH, workers=_workers(a))
    evaluation = evaluate(model, vdata.eval_batches())
    print(f"top-1 {100 * evaluation.accuracy:.2f}%   loss {evaluation.loss:.4f}")
    if a.confusion_png and not save_confusion_png(evaluation.confusion, vdata.classes,
                                                  a.confusion_png, f"top-1 "
                                                  f"{100 * evaluation.accuracy:.2f}%"):
        print("confusion matrix PNG skipped: matplotlib is not installed")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("vision", help="Vision TokenFormer: presets, training, evaluation")
    vsub = p.add_subparsers(dest="vision_command", metavar="ACTION", required=True,
                            parser_class=type(p))
    presets = ", ".join(TokenFormerViTConfig.PRESETS)

    q = vsub.add_parser("info", help="parameters and FLOPs of a vision preset")
    q.add_argument("preset", help=presets)
    q.add_argument("--arch", choices=("tokenformer", "vit"), default="tokenformer",
                   help="vit: the standard ViT parameter-matched to the preset")
    q.set_defaults(func=lambda a: print(vision_info(a.preset, a.arch)))

    q = vsub.add_parser("train", help="train on digits (embedded) or an image folder")
    q.add_argument("--preset", default="vit-digits-tiny", help=presets)
    q.add_argument("--data", default="digits",
                   help="'digits' or an ImageNet-layout folder (root/{train,val}/<class>/*)")
    q.add_argument("--arch", choices=("tokenformer", "vit"), default="tokenformer")
    q.add_argument("--steps", type=int)
    q.add_argument("--batch-size", type=int)
    q.add_argument("--lr", type=float)
    q.add_argument("--seed", type=seed)
    q.add_argument("--threads", type=int, help="torch threads (default 1; 0: torch's choice)")
    q.add_argument("--max-shift", type=int, default=1, help="digits: random shift in pixels")
    q.add_argument("--set", dest="model_set", action=DeprecatedAppend, default=[],
                   metavar="KEY=VALUE", new="--model.KEY VALUE")
    q.add_argument("--out", default=None, help="run directory (checkpoint, metrics, PNG)")
    q.add_argument("--workers", type=int, default=None,
                   help="image folders: DataLoader processes decoding images ahead (default: "
                        "CPU cores - 1, at most 8; 0: decode in the training process)")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_flags(q.add_argument_group(
        "--model.KEY: the vision config (defaults: --preset's), e.g. --model.pool mean "
        "--model.image_size 64"), TokenFormerViTConfig, "model")
    q.set_defaults(func=_train_command)

    q = vsub.add_parser("eval", help="top-1 accuracy of a trained vision model")
    q.add_argument("model", help="a run's final/ directory (or any saved vision model)")
    q.add_argument("--data", default="digits")
    q.add_argument("--confusion-png", default=None)
    q.add_argument("--overwrite", action="store_true", help="replace an existing PNG")
    q.add_argument("--workers", type=int, default=None,
                   help="image folders: DataLoader processes decoding images (default: CPU "
                        "cores - 1, at most 8)")
    q.set_defaults(func=_eval_command)

