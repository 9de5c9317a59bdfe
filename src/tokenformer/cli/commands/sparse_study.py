"""``tokenformer sparse-study``: top-k Pattention and pruning parameter tokens (docs/sparse.md)."""

from __future__ import annotations

import argparse
import os

import torch

from ...errors import OutputError
from ...experiments import sparse
from ...experiments.sparse import CompareMLP, PruneCurve, PruneSeeds, Quality, TrainArms
from ...io.outputs import check_creatable, check_not_input
from ..options import positive
from ..runs import command_line

DESCRIPTION = ("One part of the sparse study per subcommand; prints a markdown section "
               "(benchmarks/RESULTS.md) and writes --json. Models are evaluated on the held-out "
               "split of the embedded corpus. The speed of top-k and product keys is "
               "benchmarks/sparse.py's.")


def sparse_study(args: argparse.Namespace) -> int:
    """Measure one part of the study, print it as a RESULTS.md section, save ``--json``."""
    inputs = _inputs(args)
    if args.json:  # a file written after the measurement: refused now, not after it
        check_not_input(args.json, inputs, "--json")
        if os.path.isdir(args.json):
            raise OutputError(f"--json {args.json} is a folder: name the file to write")
        check_creatable(args.json, "--json")
    if getattr(args, "out", None):  # a plot, or train's model folders
        check_not_input(args.out, inputs)
    if args.what == "plot":
        sparse.plot(args.quality_json, args.prune_json, args.out)
        return 0
    if args.what == "plot-seeds":
        sparse.plot_seeds(args.quality_json, args.prune_json, args.out, args.name)
        return 0
    torch.set_num_threads(args.threads)
    part: sparse.Part
    if args.what == "train":
        part = TrainArms(args.out, args.results, args.size, tuple(args.families),
                         tuple(args.seeds), args.threads)
    elif args.what == "quality":
        part = Quality(tuple(args.models), args.eval_batches)
    elif args.what == "prune":
        part = PruneCurve(args.model, args.eval_batches, tuple(args.by), tuple(args.scales),
                          args.finetune_steps, args.finetune_lr)
    elif args.what == "compare-mlp":
        part = CompareMLP(args.tokenformer, args.transformer, args.eval_batches,
                          args.finetune_steps, args.finetune_lr)
    else:  # prune-seeds; --from-json re-renders an earlier run's report, measuring nothing
        part = PruneSeeds(tuple(args.tokenformer), tuple(args.transformer), tuple(args.by),
                          args.eval_batches, args.finetune_steps, tuple(args.lr_factors),
                          args.sweep_fraction)
    result = sparse.measure(part, from_json=getattr(args, "from_json", None) or None)
    if args.json:
        sparse.save_json(result, args.json)
    command = command_line("sparse-study") or f"tokenformer sparse-study {args.what}"
    print(sparse.section(args.what, command, result))
    return 0


# the arguments that name files or folders a part reads (a plot's --out, the --json output and
# train's model --out must never be one of them)
INPUT_ARGS = ("quality_json", "prune_json", "models", "model", "tokenformer", "transformer",
              "from_json", "results")


def _inputs(args: argparse.Namespace) -> list[str]:
    values = [getattr(args, name, None) for name in INPUT_ARGS]
    return [v for value in values if value
            for v in (value if isinstance(value, (list, tuple)) else [value])]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sparse-study", description=DESCRIPTION,
                       help="top-k Pattention and pruning parameter tokens vs a Transformer's "
                            "MLP neurons, on trained models paired by seed (docs/sparse.md)")
    p.add_argument("--threads", type=positive(int), default=1,
                   help="torch CPU threads (default 1)")
    p.add_argument("--json", default=None, help="also write the results here")
    parts = p.add_subparsers(dest="what", required=True, metavar="PART")
    t = parts.add_parser("train", help="retrain a frontier arm per family and seed (weights kept)")
    t.add_argument("--out", required=True)
    t.add_argument("--results", default=TrainArms.results,
                   help="a `tokenformer scale` results.json (default: docs/results/frontier-full)")
    t.add_argument("--size", default=TrainArms.size)
    t.add_argument("--families", nargs="+", default=list(TrainArms.families))
    t.add_argument("--seeds", type=int, nargs="+", default=list(TrainArms.seeds))
    q = parts.add_parser("quality", help="Δ val loss vs k/n per projection type, Θ's sparsity")
    q.add_argument("models", nargs="+", help="model directories (several: one per seed)")
    q.add_argument("--eval-batches", type=int, default=Quality.eval_batches)
    r = parts.add_parser("prune", help="val loss vs the fraction of parameter tokens pruned")
    r.add_argument("model")
    r.add_argument("--eval-batches", type=int, default=PruneCurve.eval_batches)
    r.add_argument("--by", nargs="+", default=list(PruneCurve.by))
    r.add_argument("--scales", nargs="+", default=list(PruneCurve.scales))
    r.add_argument("--finetune-steps", type=int, default=PruneCurve.finetune_steps)
    r.add_argument("--finetune-lr", type=float, default=PruneCurve.finetune_lr)
    m = parts.add_parser("compare-mlp", help="FFN tokens vs Transformer++ MLP neurons pruned")
    m.add_argument("tokenformer")
    m.add_argument("transformer")
    m.add_argument("--eval-batches", type=int, default=CompareMLP.eval_batches)
    m.add_argument("--finetune-steps", type=int, default=CompareMLP.finetune_steps)
    m.add_argument("--finetune-lr", type=float, default=CompareMLP.finetune_lr)
    s = parts.add_parser("prune-seeds", help="pruning on runs paired by seed, with statistics")
    s.add_argument("--tokenformer", nargs="+", required=True, help="trained run directories")
    s.add_argument("--transformer", nargs="+", required=True,
                   help="the matched Transformer++ runs, same seeds in the same order")
    s.add_argument("--by", nargs="+", default=list(PruneSeeds.by))
    s.add_argument("--eval-batches", type=int, default=PruneSeeds.eval_batches)
    s.add_argument("--finetune-steps", type=int, default=PruneSeeds.finetune_steps)
    s.add_argument("--lr-factors", type=float, nargs="+", default=list(PruneSeeds.lr_factors),
                   help="fine-tune peak LR factors; several: swept on the first run")
    s.add_argument("--sweep-fraction", type=float, default=PruneSeeds.sweep_fraction)
    s.add_argument("--from-json", default=None,
                   help="re-render the report from this earlier --json output (no measuring)")
    for name, what in (("plot", "docs/img/sparse/{topk,prune}.png from quality and prune JSON"),
                       ("plot-seeds", "top-k and pruning plots with seed bands")):
        g = parts.add_parser(name, help=what)
        g.add_argument("quality_json")
        g.add_argument("prune_json")
        g.add_argument("--out", default="docs/img/sparse")
        if name == "plot-seeds":
            g.add_argument("--name", default="frontier")
    p.set_defaults(func=sparse_study)
