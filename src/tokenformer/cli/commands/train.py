"""``tokenformer train`` and ``tokenformer plot``."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ...errors import CheckpointError, ConfigError
from ...io.outputs import check_output
from ...io.paths import has_regular_file
from ...io.run_folders import FINAL, latest_checkpoint
from ...io.training_state import read_state
from ...models.baselines import TransformerConfig
from ...models.config import TokenFormerConfig
from ...models.persistence import WEIGHTS_NAME
from ...training.config import RUN_CONFIG, TrainConfig, load_config
from ...training.lm import train
from ...training.plot import plot_runs
from ...training.recording import METRICS
from ..options import add_config_flags, config_overrides, describe_field, field_docs

_NESTED = ("model", "baseline", "grow_at")


def _add_overrides(p: argparse.ArgumentParser) -> None:
    """One ``--key`` (and ``--key-with-dashes``) per TrainConfig field and ``--model.KEY`` /
    ``--baseline.KEY`` per model field, each with its type, default and docstring; values are
    parsed by the config loader."""
    group = p.add_argument_group(
        "config overrides (any key of the YAML file; defaults below are TrainConfig's, a "
        "--config file sets its own)")
    docs = field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name in _NESTED:
            continue
        flags = {f"--{f.name}", f"--{f.name.replace('_', '-')}"}
        metavar, help_ = describe_field(f, docs)
        group.add_argument(*sorted(flags), dest=f"set:{f.name}", metavar=metavar,
                           default=argparse.SUPPRESS, help=help_)
    for prefix, cls in (("model", TokenFormerConfig), ("baseline", TransformerConfig)):
        title = ("--model.KEY: the TokenFormer config (defaults: --model.preset's)"
                 if prefix == "model" else
                 "--baseline.KEY: the baseline of --arch transformer or transformer++ (defaults: "
                 "matched to the model's size)")
        nested = p.add_argument_group(title)
        if prefix == "model":
            nested.add_argument("--model.preset", dest="set:model.preset", metavar="NAME",
                                default=argparse.SUPPRESS,
                                help="preset the other model keys start from (default: "
                                     "'small')")
        add_config_flags(nested, cls, prefix)


def _finished(run_dir: Path, steps: int) -> bool:
    """True (and says so) when ``run_dir``'s newest checkpoint already holds all ``steps``."""
    try:
        step = int(read_state(latest_checkpoint(run_dir, quiet=True)).get("step", 0))
    except (CheckpointError, TypeError, ValueError):
        return False  # nothing usable to resume from: train() says so, under the run's lock
    if step < steps:
        return False
    print(f"{run_dir} is finished: {step} of {steps} steps done, nothing to resume; the model "
          f"is {run_dir / FINAL} (to train further: --resume {run_dir} --steps N, N > "
          f"{step})")
    return True


def run_train(args: argparse.Namespace) -> int:
    overrides = config_overrides(args)
    if args.grow_at is not None:
        overrides["grow_at"] = args.grow_at
    if args.resume is not None:
        if args.config is not None:
            raise ConfigError("--resume continues a run with its own config; drop --config")
        run_dir = Path(args.resume)
        if (has_regular_file(run_dir / WEIGHTS_NAME, folder=run_dir)
                and not (run_dir / METRICS).exists()):  # its config.json is a model's
            raise ConfigError(f"--resume {run_dir}: a model folder (what grow, merge or a run's "
                              f"final/ writes), not a training run; continue training from it "
                              f"with --config CONFIG --init-from {run_dir} --out NEW_RUN")
        if not has_regular_file(run_dir / RUN_CONFIG, folder=run_dir):
            raise ConfigError(f"{run_dir} is not a training run directory (no {RUN_CONFIG})")
        overrides["out"] = str(run_dir)
        cfg = load_config(run_dir / RUN_CONFIG, overrides, recorded=True)
        if _finished(run_dir, cfg.steps):
            return 0
    else:
        if args.config is None:
            raise ConfigError("pass --config (a YAML file or a shipped name such as demo), "
                              "or --resume RUN_DIR")
        cfg = load_config(args.config, overrides)
    train(cfg, resume=args.resume is not None, progress=False if args.no_progress else None)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a TokenFormer (or a Transformer baseline) from a YAML config",
        usage="tokenformer train (--config CONFIG | --resume RUN_DIR) [--grow-at STEP:SPEC] "
              "[--no-progress] [--KEY VALUE ...]",
        description="Train from a YAML config (a file, or a shipped name: demo, tiny). Any key "
                    "can be overridden: --lr 3e-4, --model.ffn_tokens 512, --arch transformer. "
                    "Under torchrun the same command trains with DDP or FSDP (--strategy).")
    p.add_argument("--config", default=None, help="YAML file or shipped config name")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue RUN_DIR from its newest checkpoint, bit for bit")
    p.add_argument("--grow-at", action="append", default=None, metavar="STEP:SPEC",
                   help="grow the model after STEP steps, e.g. "
                        "500:qkv=2x,proj=2x,ffn=2x,layers=6,recipe=exact (repeatable); more "
                        "keys: hidden, heads, how, recipe, freeze_old, noise_old, lr, lr_ramp "
                        "(docs/training.md)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_overrides(p)
    p.set_defaults(func=run_train)

    p = sub.add_parser("plot", help="plot training runs' loss against step, tokens, FLOPs, time")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--title", default=None)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")

    def run_plot(args: argparse.Namespace) -> int:
        check_output(args.out, args.runs, command="plot", overwrite=args.overwrite,
                     kind="file")

        print(plot_runs(args.runs, args.out, title=args.title))
        return 0

    p.set_defaults(func=run_plot)
