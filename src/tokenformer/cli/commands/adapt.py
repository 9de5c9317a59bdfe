"""``tokenformer adapt`` (train a token adapter), ``tokenformer merge`` and ``adapt-bench``."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ...checkpoints import adapt_checkpoint, merge_checkpoint
from ...errors import ConfigError
from ...experiments.adapt_bench import bench_preset, run_adapt_bench
from ...nn.pattention import KINDS
from ...training.config import TrainConfig
from ..options import comma_list, config_overrides
from ..runs import experiment_folder


def parse_tokens(spec: str) -> dict[str, int]:
    """``"qkv=4,ffn=64"`` → ``{"qkv": 4, "ffn": 64}``; one clear error for anything else."""
    sizes: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        kind, sep, count = part.partition("=")  # isdecimal below, not isdigit: int('²') fails
        if not sep or kind.strip() not in KINDS or not count.strip().isdecimal():
            raise ConfigError(f"--tokens: expected comma-separated KIND=COUNT with KIND one of "
                              f"{', '.join(KINDS)} (e.g. qkv=4,ffn=64), got {spec!r}")
        sizes[kind.strip()] = int(count)
    if not any(sizes.values()):
        raise ConfigError(f"--tokens: an adapter needs at least one count > 0, got {spec!r}")
    return sizes


def run_adapt(args: argparse.Namespace) -> int:
    overrides = config_overrides(args)
    summary = adapt_checkpoint(args.base, args.data, parse_tokens(args.tokens), args.out,
                               name=args.name, overrides=overrides,
                               progress=False if args.no_progress else None,
                               overwrite=args.overwrite)
    share = summary["trainable_parameters"] / summary["base_parameters"]
    print(f"adapter {summary['name']} -> {summary['out']}: "
          f"{summary['trainable_parameters']:,} trainable parameters ({share:.2%} of the base)")
    print(f"val loss on {args.data}: base {summary['val_loss_base']:.4f} -> adapted "
          f"{summary['val_loss_adapted']:.4f} nats/token after {summary['steps']} steps")
    return 0


def run_merge(args: argparse.Namespace) -> int:
    summary = merge_checkpoint(args.base, args.adapter, args.out, overwrite=args.overwrite)
    c = summary["config"]
    print(f"merged {', '.join(summary['adapters'])} into {args.base} -> {summary['out']} "
          f"({summary['parameters']:,} parameters; tokens qkv {c['qkv_tokens']} proj "
          f"{c['proj_tokens']} ffn {c['ffn_tokens']})")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    bench_preset(args.preset, args.seeds, args.budgets, args.threads)  # before --out is made
    with experiment_folder(args.out, [], "adapt-bench"):
        results = run_adapt_bench(args.preset, out=args.out, seeds=args.seeds, budgets=args.budgets,
                                  progress=False if args.no_progress else None,
                                  threads=args.threads, print_fn=print)
    print(json.dumps(results["verdict_lines"], indent=1) if args.json else
          "\n".join(results["verdict_lines"]))
    print(f"report: {Path(args.out) / 'report.md'}")
    return 0


# Trainer keys that do not apply to adapting (the model, data and output are given otherwise;
# growth, checkpoints and samples are not part of an adapter run).
_NOT_FOR_ADAPT = {"arch", "model", "baseline", "data", "tokenizer", "out", "init_from", "grow_at",
                  "growth_lr", "growth_optimizer", "eval_after_growth", "checkpoint_interval",
                  "keep_last", "strategy", "tensorboard", "samples", "sample_tokens",
                  "sample_prompt", "temperature"}


def _add_trainer_overrides(p: argparse.ArgumentParser) -> None:
    """``--lr 1e-2``, ``--steps 500`` ...: one flag per TrainConfig key that applies."""
    group = p.add_argument_group("trainer settings (TrainConfig keys; defaults in docs/adapt.md)")
    for f in dataclasses.fields(TrainConfig):
        if f.name not in _NOT_FOR_ADAPT:
            flags = {f"--{f.name}", f"--{f.name.replace('_', '-')}"}
            group.add_argument(*sorted(flags), dest=f"set:{f.name}", metavar="VALUE",
                               default=argparse.SUPPRESS)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("adapt", help="train a parameter-token adapter on a new domain",
                       description="Attach new parameter tokens to a trained TokenFormer (the "
                                   "base stays frozen and exactly recoverable), train them with "
                                   "the trainer, save the adapter alone. docs/adapt.md.")
    p.add_argument("base", help="base model directory (or official checkpoint)")
    p.add_argument("--data", required=True,
                   help="prepared data directory, 'default' (embedded KJV) or 'code' (embedded "
                        "Jinja2 source)")
    p.add_argument("--tokens", required=True, metavar="qkv=M,proj=M,ffn=M",
                   help="new tokens per Pattention of each kind, e.g. ffn=64 or qkv=8,ffn=32")
    p.add_argument("--name", default="adapter",
                   help="adapter name (letters, digits, _; distinct for adapters stacked together)")
    p.add_argument("--out", required=True, help="adapter directory to write (must not exist)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if an earlier tokenformer adapt wrote it (never a folder "
                        "it did not write)")
    p.add_argument("--no-progress", action="store_true")
    _add_trainer_overrides(p)
    p.set_defaults(func=run_adapt)

    p = sub.add_parser("merge", help="merge token adapters into a plain (grown) model")
    p.add_argument("base", help="base model directory")
    p.add_argument("--adapter", action="append", required=True,
                   help="adapter directory (repeat to stack, applied in order)")
    p.add_argument("--out", required=True, help="model directory to write (must not exist)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if an earlier tokenformer merge wrote it (never a folder "
                        "it did not write)")
    p.set_defaults(func=run_merge)

    p = sub.add_parser("adapt-bench", help="token adapters vs LoRA vs full fine-tuning "
                                           "(docs/adapt.md)")
    p.add_argument("--preset", choices=("quick", "full", "test"), default="quick")
    p.add_argument("--out", required=True, help="output directory (report.md, results.json, "
                                                "plots); partial results there are reused")
    p.add_argument("--seeds", type=int, default=None, help="override the preset's seed count")
    p.add_argument("--budgets", type=comma_list(float, "fractions like 0.01,0.04"),
                   default=None, metavar="F,F,...",
                   help="override the preset's trainable-parameter budgets (fractions of the "
                        "base), e.g. 0.01,0.04,0.16")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_bench)
