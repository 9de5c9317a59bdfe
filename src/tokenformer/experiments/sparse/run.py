"""Parameter tokens as experts (issue 18, docs/sparse.md): what top-k Pattention and pruning cost.

    python benchmarks/sparse.py quality RUN/final [RUN2/final ...]   # Δ val loss vs k/n, sparsity
    python benchmarks/sparse.py prune RUN/final --finetune-steps 100   # val loss vs pruned %
    python benchmarks/sparse.py speed --preset tokenformer-150m        # decode / prefill tok/s
    python benchmarks/sparse.py product-speed --preset small           # train tok/s, equal FLOPs
    python benchmarks/sparse.py product-profile --preset small         # where that time goes
    python benchmarks/sparse.py train --out DIR                        # frontier S2 arms, 3 seeds
    python benchmarks/sparse.py prune-seeds --tokenformer DIR/tokenformer-S2-seed{0,1,2} \
        --transformer DIR/transformer++-S2-seed{0,1,2}                 # pruning, paired by seed
    python benchmarks/sparse.py plot-seeds QUALITY.json PRUNE.json     # plots with seed bands

All with one thread (``--threads``, default 1). ``quality``/``prune``/``prune-seeds`` evaluate on
the held-out split of the embedded corpus (the trainer's evaluator: fixed windows,
``--eval-batches`` × 16 × min(256, context) tokens). Several models (one per seed) give means
with t-based 95 % intervals (tokenformer.experiments.stats). Prints a markdown section for
benchmarks/RESULTS.md and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, interleaved, log, machine

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.loading import load_model
from tokenformer.model import KVCache
from tokenformer.pattention import Pattention, set_pattention_top_k, theta
from tokenformer.prune import prune

FRACTIONS = (1.0, 1 / 2, 1 / 4, 1 / 8, 1 / 16)
PRUNED = (0.0, 0.25, 0.5, 0.75)
FRONTIER = Path(__file__).resolve().parents[1] / "docs/results/frontier-full/results.json"


def frontier_recipe(results: str | Path, family: str, size: str, budget: int = -1) -> dict:
    """The trainer config of one frontier arm at one budget, from its results.json: the run's
    model config, the sweep's chosen LR, the branch's steps and the preset's WSD schedule (a
    single WSD run of the branch's steps is the frontier's stable phase plus that cooldown, step
    for step, with the same batches: ``dataset.batch(step, seed)``)."""
    res = json.loads(Path(results).read_text())
    p = res["preset"]
    branch = res["runs"][f"{family}-{size}/seed0"]["branches"][budget]
    # the trainer builds a baseline as the matched_config of the TokenFormer config
    tf = res["runs"][f"tokenformer-{size}/seed0"]["stages"][0]["config"]
    model = {k: v for k, v in tf.items() if k not in ("name", "eos_token_id")}
    lr = res["sweeps"][f"{family}-{size}"]["chosen"]
    frontier_loss = {r["seed"]: r["branches"][budget]["loss"] for k, r in res["runs"].items()
                     if k.startswith(f"{family}-{size}/")}
    return {"arch": family, "model": model, "seq_len": p["seq_len"],
            "batch_size": p["batch_size"], "steps": branch["steps"], "lr": lr,
            "min_lr": lr * p["min_lr_ratio"], "schedule": "wsd",
            "warmup_steps": p["warmup_steps"], "decay_fraction": p["decay_fraction"],
            "weight_decay": p["weight_decay"], "grad_clip": p["grad_clip"],
            "eval_batches": p["eval_batches"], "eval_interval": 0, "samples": 0,
            "budget": branch["budget"], "frontier_loss": frontier_loss}


def train_frontier(args: argparse.Namespace) -> dict:
    """Train the frontier's arm (``--size``, largest budget) with the normal trainer, one run
    per family and seed, into ``OUT/<family>-<size>-seed<s>`` (weights in ``final/``)."""
    from tokenformer.train import TrainConfig, train

    rows = []
    for family in args.families:
        recipe = frontier_recipe(args.results, family, args.size)
        budget, frontier_loss = recipe.pop("budget"), recipe.pop("frontier_loss")
        for seed in args.seeds:
            out = Path(args.out) / f"{family}-{args.size}-seed{seed}"
            cfg = TrainConfig.from_dict({**recipe, "seed": seed, "threads": args.threads,
                                         "out": str(out)})
            result = train(cfg, progress=False, print_fn=log)
            loss = result.final_eval["val_loss"]
            rows.append({"family": family, "seed": seed, "val_loss": loss, "out": str(out),
                         "frontier_loss": frontier_loss.get(seed), "lr": cfg.lr,
                         "steps": cfg.steps, "budget": budget})
            log(f"{family} seed {seed}: val loss {loss:.4f} (frontier "
                f"{rows[-1]['frontier_loss']})")
    lines = [f"Frontier arm {args.size} at its largest budget, retrained by `tokenformer.train` "
             f"with the recipe of {args.results} (WSD, chosen LR per family).", "",
             "| family | seed | LR | steps | val loss | frontier's val loss |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        fl = f"{r['frontier_loss']:.4f}" if r["frontier_loss"] is not None else "–"
        lines.append(f"| {r['family']} | {r['seed']} | {r['lr']:g} | {r['steps']} | "
                     f"{r['val_loss']:.4f} | {fl} |")
    return {"markdown": "\n".join(lines), "rows": rows}


def evaluator(model: torch.nn.Module, eval_batches: int, seq_len: int = 256):
    from tokenformer.data import default_dataset
    from tokenformer.train import lm_evaluator

    dataset = default_dataset("bytes", progress=False)
    seq = min(seq_len, model.config.max_seq_len)
    return lm_evaluator(dataset, seq, 16, eval_batches, torch.device("cpu")), dataset


@torch.no_grad()
def natural_sparsity(model: torch.nn.Module, ids: torch.Tensor, rel: float = 1e-3
                     ) -> dict[str, float]:
    """Per Pattention: the fraction of Θ entries with |Θ| < rel · (the row's max |Θ|)."""
    out: dict[str, float] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, Pattention):
            def hook(m, args, _o, name=name):
                x = args[0].float().reshape(-1, m.in_features)
                th = theta(x @ m.key_param_tokens.float().t(), m.norm, m.scale, m.eps).abs()
                out[name] = float((th < rel * th.amax(dim=-1, keepdim=True)).float().mean())
            hooks.append(m.register_forward_hook(hook))
    model(ids)
    for h in hooks:
        h.remove()
    return out


KINDS = (("qkv",), ("proj",), ("ffn",), ("qkv", "proj", "ffn"))
SPARSITY_COLUMNS = ("attention.query", "attention.key", "attention.value", "attention.proj",
                    "mlp")


def cell(values: list[float], digits: int = 4, sign: bool = True) -> str:
    """One value as is; several (one per seed) as mean [t-based 95 % interval]."""
    from tokenformer.experiments.stats import t_interval

    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    if len(values) == 1:
        return f.format(values[0])
    ci = t_interval(values)
    return f"{f.format(ci.mean)} [{f.format(ci.low)}, {f.format(ci.high)}]"


def interval(values: list[float]) -> dict:
    """Mean, t-based 95 % interval and p-value (vs 0) of per-seed values, for the JSON."""
    from tokenformer.experiments.stats import t_interval

    ci = t_interval(values)
    return {"mean": ci.mean, "low": ci.low, "high": ci.high, "p": ci.p_value, "values": values}


def quality_of(path: str, eval_batches: int) -> dict:
    """One model: dense val loss, Δ val loss for each (kinds, k/n), Θ's natural sparsity."""
    model = load_model(path).eval()
    evaluate, dataset = evaluator(model, eval_batches)
    with torch.no_grad():
        dense = evaluate(model)["val_loss"]
        deltas = {}
        for kinds in KINDS:
            for f in FRACTIONS[1:]:
                set_pattention_top_k(model, **{k: f for k in kinds})
                key = "+".join(kinds), f
                deltas[key] = evaluate(model)["val_loss"] - dense
                log(f"{path}: {key[0]:>14} k/n={f:<7.4g} Δ {deltas[key]:+.4f}")
            set_pattention_top_k(model)
        seq = min(256, model.config.max_seq_len)
        ids = next(iter(dataset.eval_windows("val", seq, 16, max_batches=1)))
        sparsity = natural_sparsity(model, ids)
    return {"model": path, "config": model.config, "dense": dense, "deltas": deltas,
            "sparsity": sparsity}


def quality(args: argparse.Namespace) -> dict:
    """Δ val loss vs k/n per projection type and Θ's natural sparsity per layer, for each model
    given (one per seed); with several, the mean and its t-based 95 % interval over them."""
    runs = [quality_of(m, args.eval_batches) for m in args.models]
    c, n = runs[0]["config"], len(runs)
    rows = [{"kinds": "+".join(k), "fraction": f,
             **interval([r["deltas"]["+".join(k), f] for r in runs])}
            for k in KINDS for f in FRACTIONS[1:]]
    for r in rows:
        r["delta"] = r["mean"]
    sparsity = {name: interval([r["sparsity"][name] for r in runs]) for name in runs[0]["sparsity"]}
    dense = [r["dense"] for r in runs]
    what = (f"{n} models (seeds), mean [t-based 95 % interval]" if n > 1 else "one model")
    lines = [f"Model{'s' if n > 1 else ''} {', '.join(args.models)}: {c.num_layers} layers, "
             f"d={c.hidden_size}, n = {c.qkv_tokens}/{c.proj_tokens}/{c.ffn_tokens} "
             f"(qkv/proj/ffn); dense val loss {cell(dense, sign=False)} nats/token "
             f"({args.eval_batches}×16×{min(256, c.max_seq_len)} held-out tokens); {what}.", "",
             "| top-k applied to | " + " | ".join(f"k/n = 1/{round(1 / f)}" for f in FRACTIONS[1:])
             + " |", "|---|" + "---:|" * (len(FRACTIONS) - 1)]
    for k in KINDS:
        cells = [cell(r["values"]) for r in rows if r["kinds"] == "+".join(k)]
        lines.append(f"| {'+'.join(k)} | " + " | ".join(cells) + " |")
    lines += ["", "Δ val loss (nats/token) vs dense. Natural sparsity, fraction of |Θ| < 1e-3 × "
              "row max, per layer:", "", "| layer | q | k | v | proj | ffn |",
              "|---|---:|---:|---:|---:|---:|"]
    for i in range(c.num_layers):
        vals = [sparsity[f"layers.{i}.{s}"]["values"] for s in SPARSITY_COLUMNS]
        lines.append(f"| {i} | " + " | ".join(cell(v, 3, sign=False) for v in vals) + " |")
    return {"markdown": "\n".join(lines), "dense": dense[0] if n == 1 else interval(dense),
            "rows": rows, "sparsity": sparsity, "models": args.models}


def finetune(model: torch.nn.Module, steps: int, lr: float, workdir: Path) -> torch.nn.Module:
    """``steps`` steps of the trainer (demo config, constant LR after 10 warmup steps) from
    ``model``, through the CLI's --init-from, as a user would."""
    src, out = workdir / "in", workdir / "out"
    model.save(src)
    cmd = [sys.executable, "-m", "tokenformer", "train", "--config", "demo", "--init-from",
           str(src), "--steps", str(steps), "--lr", str(lr), "--min-lr", str(lr), "--schedule",
           "constant", "--warmup-steps", "10", "--threads", "1", "--out", str(out),
           "--samples", "0", "--eval-interval", "0", "--eval-batches", "1",
           "--checkpoint-interval", "0", "--no-progress", "--arch",
           getattr(model.config, "arch", "tokenformer")]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return load_model(out / "final").eval()


def prune_curve(args: argparse.Namespace) -> dict:
    model = load_model(args.model).eval()
    evaluate, dataset = evaluator(model, args.eval_batches)
    calib = next(iter(dataset.eval_windows("train", 256, 8, max_batches=1)))
    rows = []
    c = model.config
    for frac in PRUNED:
        sizes = {k: max(1, round(getattr(c, f"{k}_tokens") * (1 - frac)))
                 for k in ("qkv", "proj", "ffn")}
        for by in args.by:
            for scale in args.scales:
                small = prune(model, **sizes, by=by, calibration=calib, scale=scale).eval()
                with torch.no_grad():
                    loss = evaluate(small)["val_loss"]
                row = {"pruned": frac, "by": by, "scale": scale, "val_loss": loss,
                       "params": small.num_parameters(), "finetuned": None}
                if args.finetune_steps and scale == args.scales[0]:
                    with tempfile.TemporaryDirectory() as tmp:
                        tuned = finetune(small, args.finetune_steps, args.finetune_lr, Path(tmp))
                    with torch.no_grad():
                        row["finetuned"] = evaluate(tuned)["val_loss"]
                log(f"pruned {frac:.0%} by {by} scale {scale}: {loss:.4f} "
                    f"fine-tuned {row['finetuned']}")
                rows.append(row)
                if frac == 0.0:
                    break
            if frac == 0.0:
                break
    lines = [f"Model {args.model}: every Pattention (qkv/proj/ffn) pruned by the same fraction; "
             f"val loss nats/token ({args.eval_batches}×16×256 held-out tokens); calibration: 8"
             f"×256 training tokens; fine-tune: {args.finetune_steps} trainer steps at constant "
             f"lr {args.finetune_lr} (demo config, batch 16×256).", "",
             "| pruned | by | Θ factor | parameters | val loss | after fine-tune |",
             "|---:|---|---|---:|---:|---:|"]
    for r in rows:
        ft = f"{r['finetuned']:.4f}" if r["finetuned"] is not None else "–"
        lines.append(f"| {r['pruned']:.0%} | {r['by']} | {r['scale']} | {r['params']:,} | "
                     f"{r['val_loss']:.4f} | {ft} |")
    return {"markdown": "\n".join(lines), "rows": rows}


MLP_BY = ("magnitude", "activation")


@torch.no_grad()
def mlp_activations(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per block, the mean |h_i| over the rows of ``ids`` of each MLP hidden unit h (the input
    of ``down``: act(gate)·up for SwiGLU)."""
    out: list[torch.Tensor] = [None] * len(model.layers)
    hooks = [block.mlp.down.register_forward_hook(
        lambda _m, args, _o, i=i: out.__setitem__(i, args[0].detach().float().abs()
                                                 .reshape(-1, args[0].shape[-1]).mean(0)))
        for i, block in enumerate(model.layers)]
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    return out


@torch.no_grad()
def prune_mlp(model: torch.nn.Module, width: int, by: str = "magnitude",
              calibration: torch.Tensor | None = None) -> torch.nn.Module:
    """A Transformer baseline with every MLP cut to its ``width`` most important neurons.
    ``magnitude``: neuron i scores ‖up_i‖·‖down_:,i‖ (× ‖gate_i‖ for SwiGLU), the usual weight
    criterion; ``activation``: mean_x |h_i(x)| · ‖down_:,i‖ over ``calibration`` ids, the
    average size of the neuron's output term (the analogue of TokenFormer's ``contribution``)."""
    import dataclasses

    new = type(model)(dataclasses.replace(model.config, intermediate_size=width))
    state = model.state_dict()
    acts = mlp_activations(model, calibration) if by == "activation" else None
    for i, block in enumerate(model.layers):
        mlp, p = block.mlp, f"layers.{i}.mlp."
        if by == "activation":
            score = acts[i] * mlp.down.weight.norm(dim=0)
        else:
            score = mlp.up.weight.norm(dim=1) * mlp.down.weight.norm(dim=0)
            if mlp.gate is not None:
                score = score * mlp.gate.weight.norm(dim=1)
        keep = score.topk(width).indices.sort().values
        for name in ("up", "gate"):
            for leaf in ("weight", "bias"):
                if f"{p}{name}.{leaf}" in state:
                    state[f"{p}{name}.{leaf}"] = state[f"{p}{name}.{leaf}"][keep]
        state[f"{p}down.weight"] = state[f"{p}down.weight"][:, keep]
    new.load_state_dict(state, strict=True)
    return new.eval()


def compare_mlp(args: argparse.Namespace) -> dict:
    """FFN-only pruning: TokenFormer FFN tokens (by contribution, Θ factor held) vs the
    Transformer++ MLP neurons (magnitude), same fractions, same fine-tune recipe."""
    tf, tpp = load_model(args.tokenformer).eval(), load_model(args.transformer).eval()
    evaluate, dataset = evaluator(tf, args.eval_batches)
    calib = next(iter(dataset.eval_windows("train", 256, 8, max_batches=1)))
    rows = []
    for frac in PRUNED:
        n = round(tf.config.ffn_tokens * (1 - frac))
        w = round(tpp.config.intermediate_size * (1 - frac))
        for arch, small in (("tokenformer", prune(tf, ffn=n, calibration=calib).eval()),
                            ("transformer++", prune_mlp(tpp, w))):
            with torch.no_grad():
                loss = evaluate(small)["val_loss"]
            tuned = None
            if args.finetune_steps:
                with tempfile.TemporaryDirectory() as tmp:
                    tuned_model = finetune(small, args.finetune_steps, args.finetune_lr,
                                           Path(tmp))
                with torch.no_grad():
                    tuned = evaluate(tuned_model)["val_loss"]
            rows.append({"pruned": frac, "arch": arch, "val_loss": loss, "finetuned": tuned,
                         "params": small.num_parameters()})
            log(f"{arch} ffn pruned {frac:.0%}: {loss:.4f} fine-tuned {tuned}")
    lines = [f"FFN-only pruning. TokenFormer {args.tokenformer} (FFN tokens, by contribution, Θ "
             f"factor held) vs Transformer++ {args.transformer} (MLP neurons by magnitude), both "
             f"trained with the same config; val loss nats/token ({args.eval_batches}×16×256 "
             f"held-out tokens); fine-tune {args.finetune_steps} steps at constant lr "
             f"{args.finetune_lr}.", "",
             "| FFN pruned | arch | parameters | val loss | after fine-tune |",
             "|---:|---|---:|---:|---:|"]
    for r in rows:
        ft = f"{r['finetuned']:.4f}" if r["finetuned"] is not None else "–"
        lines.append(f"| {r['pruned']:.0%} | {r['arch']} | {r['params']:,} | "
                     f"{r['val_loss']:.4f} | {ft} |")
    return {"markdown": "\n".join(lines), "rows": rows}


def finetune_wsd(model: torch.nn.Module, run: dict, steps: int, lr: float, dataset
                 ) -> torch.nn.Module:
    """``steps`` steps of ``tokenformer.train.fit`` on ``model`` (in place), fresh AdamW, the
    frontier's schedule family: WSD (10 warmup steps, the last 20 % decaying to 0.1 × ``lr``);
    batch, sequence, weight decay, clipping and data seed of the run's config (``run``), on the
    training batches that follow the run's last step."""
    from tokenformer.train import TrainConfig, fit

    cfg = TrainConfig(arch=run["arch"], seq_len=run["seq_len"], batch_size=run["batch_size"],
                      steps=steps, lr=lr, min_lr=0.1 * lr, schedule="wsd", warmup_steps=10,
                      decay_fraction=0.2, weight_decay=run["weight_decay"],
                      grad_clip=run["grad_clip"], seed=run["seed"], eval_interval=0,
                      samples=0, threads=torch.get_num_threads())

    def batch_fn(step: int) -> dict:
        ids = dataset.batch("train", run["steps"] + step, cfg.batch_size, cfg.seq_len,
                            seed=cfg.seed)
        return {"input_ids": ids, "labels": ids}

    model.train()
    fit(model, batch_fn, cfg, progress=False)
    return model.eval()


def pruned(model: torch.nn.Module, arm: str, frac: float, calib: torch.Tensor
           ) -> torch.nn.Module:
    """``model`` with ``frac`` of the units of ``arm`` removed: "ffn/BY" and "all/BY" prune
    TokenFormer parameter tokens (prune.prune, Θ factor held), "mlp/BY" Transformer MLP
    neurons (prune_mlp)."""
    import copy

    kinds, by = arm.split("/")
    if frac == 0:
        return copy.deepcopy(model)
    if kinds == "mlp":
        width = round(model.config.intermediate_size * (1 - frac))
        return prune_mlp(model, width, by, calib)
    c = model.config
    sizes = {k: round(getattr(c, f"{k}_tokens") * (1 - frac))
             for k in (("ffn",) if kinds == "ffn" else ("qkv", "proj", "ffn"))}
    return prune(model, **sizes, by=by, calibration=calib).eval()


def load_run(path: str, eval_batches: int) -> tuple:
    """A trained run directory: its training config, its final model, the evaluator, the data
    set and a calibration batch (8 training sequences)."""
    run = json.loads((Path(path) / "config.json").read_text())
    model = load_model(Path(path) / "final").eval()
    evaluate, dataset = evaluator(model, eval_batches)
    seq = min(256, model.config.max_seq_len)
    calib = next(iter(dataset.eval_windows("train", seq, 8, max_batches=1)))
    return run, model, evaluate, dataset, calib


def prune_run(path: str, arms: list[str], lr_factor: float, args: argparse.Namespace) -> list:
    """Every (arm, fraction) of one trained run directory: val loss, and after the fine-tune.
    The unpruned model (fraction 0) gets the same fine-tune, the reference of the tuned rows."""
    run, model, evaluate, dataset, calib = load_run(path, args.eval_batches)
    rows = []
    for frac in PRUNED:
        for arm in (arms[:1] if frac == 0 else arms):
            small = pruned(model, arm, frac, calib)
            with torch.no_grad():
                loss = evaluate(small)["val_loss"]
            tuned = None
            if args.finetune_steps:
                small = finetune_wsd(small, run, args.finetune_steps, lr_factor * run["lr"],
                                     dataset)
                with torch.no_grad():
                    tuned = evaluate(small)["val_loss"]
            rows.append({"arm": "unpruned" if frac == 0 else arm, "pruned": frac,
                         "seed": run["seed"], "params": small.num_parameters(),
                         "val_loss": loss, "finetuned": tuned})
            log(f"{path} {rows[-1]['arm']} {frac:.0%}: {loss:.4f} fine-tuned {tuned}")
    return rows


def finetune_lr_sweep(path: str, arm: str, args: argparse.Namespace) -> dict:
    """Fine-tune LR factor (× the run's tuned LR) for one family: the fine-tuned val loss of
    ``arm`` pruned by ``--sweep-fraction`` on one run, at each of ``--lr-factors``."""
    run, model, evaluate, dataset, calib = load_run(path, args.eval_batches)
    losses = {}
    for factor in args.lr_factors:
        small = finetune_wsd(pruned(model, arm, args.sweep_fraction, calib), run,
                             args.finetune_steps, factor * run["lr"], dataset)
        with torch.no_grad():
            losses[factor] = evaluate(small)["val_loss"]
        log(f"sweep {path} {arm} lr × {factor}: {losses[factor]:.4f}")
    best = min(losses, key=losses.get)
    return {"arm": arm, "losses": losses, "chosen": best,
            "at_edge": best in (min(losses), max(losses))}


def prune_seeds(args: argparse.Namespace) -> dict:
    """Pruning with seeds: TokenFormer parameter tokens (FFN only and every kind, each
    ``--by`` criterion) vs the matched Transformer++'s MLP neurons (magnitude, activation), on
    trained runs paired by seed; Δ vs each model's own unpruned loss, with and without a
    fine-tune, mean and t-based 95 % interval over seeds, and the paired cross-family test."""
    from tokenformer.experiments.stats import RULE, describe, paired

    families = {"tokenformer": (args.tokenformer, [f"{k}/{b}" for k in ("ffn", "all")
                                                   for b in args.by]),
                "transformer++": (args.transformer, [f"mlp/{b}" for b in MLP_BY])}
    if args.from_json:  # re-render the report of an earlier run's JSON, measuring nothing
        saved = json.loads(Path(args.from_json).read_text())
        sweeps, rows = saved["sweeps"], saved["rows"]
        for sweep in sweeps.values():
            sweep["losses"] = {float(f): v for f, v in sweep["losses"].items()}
    else:
        sweeps, rows = {}, []
        for family, (paths, arms) in families.items():
            factor = args.lr_factors[0]
            if args.finetune_steps and len(args.lr_factors) > 1:
                sweeps[family] = finetune_lr_sweep(paths[0], arms[0], args)
                factor = sweeps[family]["chosen"]
            for path in paths:
                rows += [{**r, "family": family, "lr_factor": factor}
                         for r in prune_run(path, arms, factor, args)]

    def values(family: str, arm: str, frac: float, key: str, ref_key: str | None = None
               ) -> dict[int, float]:
        """Per seed: ``key`` of the arm minus ``ref_key`` (default ``key``) of the unpruned."""
        ref = {r["seed"]: r[ref_key or key] for r in rows
               if r["family"] == family and r["pruned"] == 0}
        return {r["seed"]: r[key] - ref[r["seed"]] for r in rows
                if r["family"] == family and r["arm"] == arm and r["pruned"] == frac}

    keys = ["val_loss"] + (["finetuned"] if args.finetune_steps else [])
    summary = []
    for family, (_paths, arms) in families.items():
        for frac in PRUNED[1:]:
            for arm in arms:
                entry = {"family": family, "arm": arm, "pruned": frac,
                         "params": next(r["params"] for r in rows if r["family"] == family
                                        and r["arm"] == arm and r["pruned"] == frac)}
                for key in keys:
                    entry[key] = interval([r[key] for r in rows if r["family"] == family
                                           and r["arm"] == arm and r["pruned"] == frac])
                    entry[f"delta_{key}"] = interval(list(values(family, arm, frac,
                                                                 key).values()))
                if "finetuned" in keys:  # the tuned model vs the original unpruned one
                    entry["delta_finetuned_vs_original"] = interval(list(values(
                        family, arm, frac, "finetuned", "val_loss").values()))
                summary.append(entry)
    # the declared questions: TokenFormer's default criterion against both MLP criteria, and
    # against the data-free criteria (value; newest = index order, which carries no meaning
    # in a model trained from scratch: an arbitrary-choice control) within each family
    questions = [("tokenformer", "ffn/contribution", "transformer++", f"mlp/{b}")
                 for b in MLP_BY]
    questions += [("tokenformer", f"{k}/contribution", "tokenformer", f"{k}/{other}")
                  for other in ("value", "newest") for k in ("ffn", "all")
                  if "contribution" in args.by and other in args.by]
    questions.append(("transformer++", "mlp/activation", "transformer++", "mlp/magnitude"))
    tests = []
    for frac in PRUNED[1:]:
        for key in keys:
            for fa, a, fb, b in questions:
                c = paired(f"{fa} {a}", f"{fb} {b}", values(fa, a, frac, key),
                           values(fb, b, frac, key)).to_dict()
                tests.append({**c, "pruned": frac, "key": key})
    base = paired("tokenformer", "transformer++",
                  {r["seed"]: r["val_loss"] for r in rows
                   if r["family"] == "tokenformer" and r["pruned"] == 0},
                  {r["seed"]: r["val_loss"] for r in rows
                   if r["family"] == "transformer++" and r["pruned"] == 0}).to_dict()
    n = len(args.tokenformer)
    unpruned = {f: [r["val_loss"] for r in rows if r["family"] == f and r["pruned"] == 0]
                for f in families}
    lines = [f"{n} seeds per family: TokenFormer runs {', '.join(args.tokenformer)}; "
             f"Transformer++ runs {', '.join(args.transformer)} (paired by seed: same batches). "
             f"Val loss nats/token ({args.eval_batches}×16×128 held-out tokens); calibration 8 "
             f"training sequences. TokenFormer: parameter tokens by `prune(by=...)`, Θ factor "
             f"held, of the FFN only or of every Pattention (all); Transformer++: MLP neurons. "
             f"Fine-tune: {args.finetune_steps} steps of the trainer, WSD (10 warmup steps, "
             f"last 20 % decaying to 0.1×), fresh AdamW, peak LR = factor × the family's tuned "
             f"LR, same batch and weight decay as training, the batches after the run's last.",
             "", f"Unpruned: TokenFormer {cell(unpruned['tokenformer'], sign=False)}, "
             f"Transformer++ {cell(unpruned['transformer++'], sign=False)}; TokenFormer − "
             f"Transformer++ {describe(base)} ({base['verdict']}).", ""]
    for family, sweep in sweeps.items():
        lines.append(f"Fine-tune LR sweep, {family} ({sweep['arm']} at "
                     f"{args.sweep_fraction:.0%}, seed of {families[family][0][0]}): "
                     + ", ".join(f"×{f:g}: {v:.4f}" for f, v in sweep["losses"].items())
                     + f"; chosen ×{sweep['chosen']:g}"
                     + (" (at the grid's edge)" if sweep["at_edge"] else "") + ".")
    lines += ["", "Δ val loss vs the model's own unpruned loss (fine-tuned rows: vs the unpruned "
              "model fine-tuned the same way), mean [95 % interval] over seeds:", "",
              "| pruned | arm | parameters | Δ no fine-tune | Δ after fine-tune | "
              "fine-tuned − unpruned original |", "|---:|---|---:|---:|---:|---:|"]
    for e in summary:
        ft = (f"{cell(e['delta_finetuned']['values'])} | "
              f"{cell(e['delta_finetuned_vs_original']['values'])}" if "finetuned" in e
              else "– | –")
        lines.append(f"| {e['pruned']:.0%} | {e['family']} {e['arm']} | {e['params']:,} | "
                     f"{cell(e['delta_val_loss']['values'])} | {ft} |")
    lines += ["", "Paired by seed: difference of the Δs (a − b; across families each Δ is vs its "
              "own unpruned model):", "",
              "| pruned | fine-tuned | a | b | Δ(a) − Δ(b) | verdict |",
              "|---:|---|---|---|---:|---|"]
    for t in tests:
        lines.append(f"| {t['pruned']:.0%} | {'yes' if t['key'] == 'finetuned' else 'no'} | "
                     f"{t['a']} | {t['b']} | {describe(t)} | {t['verdict']} |")
    lines += ["", RULE]
    return {"markdown": "\n".join(lines), "rows": rows, "summary": summary, "tests": tests,
            "sweeps": sweeps, "unpruned_difference": base}


@torch.no_grad()
def speed(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    config = TokenFormerConfig.from_name(args.preset)
    model = TokenFormerLM(config).eval()
    T, pos = args.prefill, args.position
    prompt = torch.randint(0, config.vocab_size, (1, T))
    cache = KVCache(config.num_layers, config.max_seq_len)
    model(torch.randint(0, config.vocab_size, (1, pos)), past_key_values=cache, use_cache=True)
    token = torch.randint(0, config.vocab_size, (1, 1))
    arms = {"dense": None, **{f"k/n=1/{round(1 / f)}": f for f in args.fractions}}

    def decode(f):
        def run():
            set_pattention_top_k(model, qkv=f, proj=f, ffn=f)
            model(token, past_key_values=cache, use_cache=True)
            cache.lengths = [pos] * config.num_layers
        return run

    def prefill(f):
        def run():
            set_pattention_top_k(model, qkv=f, proj=f, ffn=f)
            model(prompt, logits_to_keep=1)
        return run

    dec = interleaved({a: decode(f) for a, f in arms.items()}, args.rounds)
    pre = interleaved({a: prefill(f) for a, f in arms.items()}, max(2, args.rounds // 4), 1)
    lines = [f"Preset {args.preset} (random weights, fp32), {torch.get_num_threads()} thread; "
             f"top-k applied to every Pattention. Decode: one cached step at position {pos}, "
             f"batch 1, {args.rounds} interleaved rounds; prefill: {T} tokens, batch 1. tokens/s "
             f"from the minimum (median in brackets).", "",
             "| arm | decode tok/s | vs dense | prefill tok/s | vs dense |",
             "|---|---:|---:|---:|---:|"]
    for a in arms:
        d, p = dec[a], pre[a]
        lines.append(f"| {a} | {1 / d['min']:.2f} ({1 / d['median']:.2f}) | "
                     f"{dec['dense']['min'] / d['min']:.2f}x | {T / p['min']:.1f} "
                     f"({T / p['median']:.1f}) | {pre['dense']['min'] / p['min']:.2f}x |")
    return {"markdown": "\n".join(lines), "decode": dec, "prefill": pre}


def matched_k(dense: TokenFormerConfig, ffn_tokens: int) -> int:
    """The product-key k whose FFN forward FLOPs/token (config.projection_flops) come closest to
    ``dense``'s dense FFN at ``ffn_tokens`` = s² product keys."""
    target = dense.projection_flops()[1]
    best = min(range(1, ffn_tokens + 1), key=lambda k: abs(TokenFormerConfig.from_dict(
        {**dense.to_dict(), "ffn_keys": "product", "ffn_tokens": ffn_tokens,
         "ffn_product_k": k}).projection_flops()[1] - target))
    return best


def product_speed(args: argparse.Namespace) -> dict:
    """Train step tokens/s (forward, backward, AdamW) of dense vs product-key FFN TokenFormers
    of equal FFN FLOPs/token, and of the FFN alone, interleaved."""
    dense = TokenFormerConfig.from_name(args.preset)
    arms = {"dense": dense}
    for mult in args.multipliers:
        n = round((dense.ffn_tokens * mult) ** 0.5) ** 2
        k = matched_k(dense, n)
        arms[f"product n={n} ({mult}x) k={k}"] = TokenFormerConfig.from_dict(
            {**dense.to_dict(), "ffn_keys": "product", "ffn_tokens": n, "ffn_product_k": k})
    B, T = args.batch, min(args.seq_len, dense.max_seq_len)
    ids = torch.randint(0, dense.vocab_size, (B, T))
    steps, ffn_steps, info = {}, {}, {}
    for name, config in arms.items():
        torch.manual_seed(0)
        model = TokenFormerLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(B, T, config.hidden_size, requires_grad=True)
        mlp = model.layers[0].mlp

        def step(model=model, opt=opt):
            loss = model(ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        def ffn(mlp=mlp, x=x):
            mlp(x).square().mean().backward()

        steps[name], ffn_steps[name] = step, ffn
        info[name] = (config.num_parameters(), 3 * config.projection_flops()[1])
    whole = interleaved(steps, args.rounds, 1)
    alone = interleaved(ffn_steps, args.rounds, 1)
    lines = [f"Preset {args.preset} (d={dense.hidden_size}, {dense.num_layers} layers, dense "
             f"ffn_tokens {dense.ffn_tokens}); fp32, {torch.get_num_threads()} thread, batch "
             f"{B}×{T}; k chosen so the FFN's forward FLOPs/token match dense "
             f"(config.projection_flops); {args.rounds} interleaved rounds, tokens/s from the "
             f"minimum.", "",
             "| arm | parameters | FFN train FLOPs/token | train step tok/s | vs dense | "
             "FFN fwd+bwd tok/s | vs dense |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name in arms:
        w, a = whole[name]["min"], alone[name]["min"]
        lines.append(f"| {name} | {info[name][0]:,} | {info[name][1]:,.0f} | {B * T / w:,.0f} | "
                     f"{whole['dense']['min'] / w:.2f}x | {B * T / a:,.0f} | "
                     f"{alone['dense']['min'] / a:.2f}x |")
    return {"markdown": "\n".join(lines), "whole": whole, "ffn": alone}


def plot(quality_json: str, prune_json: str, out_dir: str) -> None:
    """docs/img/sparse/{topk,prune}.png from the JSON the quality and prune runs wrote."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    q = json.loads(Path(quality_json).read_text())
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for kinds in ("qkv", "proj", "ffn", "qkv+proj+ffn"):
        rows = [r for r in q["rows"] if r["kinds"] == kinds]
        ax.plot([1.0] + [r["fraction"] for r in rows], [0.0] + [r["delta"] for r in rows],
                marker="o", label=f"top-k on {kinds}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k / n (tokens read per row)")
    ax.set_ylabel("Δ val loss vs dense (nats/token)")
    ax.set_title(f"Top-k Pattention, trained demo model (dense {q['dense']:.3f})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "topk.png", dpi=110)
    r = json.loads(Path(prune_json).read_text())["rows"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for by in dict.fromkeys(x["by"] for x in r if x["pruned"] > 0):
        for scale in dict.fromkeys(x["scale"] for x in r if x["pruned"] > 0):
            rows = [r[0]] + [x for x in r if x["by"] == by and x["scale"] == scale]
            ax.plot([x["pruned"] for x in rows], [x["val_loss"] for x in rows], marker="o",
                    label=f"{by}, {scale}")
        tuned = [r[0]] + [x for x in r if x["by"] == by and x["finetuned"] is not None
                          and x["pruned"] > 0]
        if len(tuned) > 1:
            ax.plot([x["pruned"] for x in tuned], [x["finetuned"] for x in tuned], marker="s",
                    linestyle="--", label=f"{by} + fine-tune")
    ax.set_xlabel("fraction of parameter tokens removed (every Pattention)")
    ax.set_ylabel("val loss (nats/token)")
    ax.set_title("Pruning parameter tokens, trained demo model")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "prune.png", dpi=110)


def plot_seeds(quality_json: str, prune_json: str, out_dir: str, name: str) -> None:
    """OUT/topk_NAME.png (Δ val loss vs k/n) and OUT/prune_NAME.png (Δ val loss vs the
    fraction removed, without and with the fine-tune), means over seeds with their t-based 95 %
    interval as a band, from the JSON of ``quality`` and ``prune-seeds`` on several seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def line(ax, xs, entries, **kw):
        ax.plot(xs, [e["mean"] for e in entries], marker="o", **kw)
        ax.fill_between(xs, [e["low"] for e in entries], [e["high"] for e in entries],
                        alpha=0.12, color=ax.lines[-1].get_color())

    q = json.loads(Path(quality_json).read_text())
    zero = {"mean": 0.0, "low": 0.0, "high": 0.0}
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for kinds in ("qkv", "proj", "ffn", "qkv+proj+ffn"):
        rows = [r for r in q["rows"] if r["kinds"] == kinds]
        line(ax, [1.0] + [r["fraction"] for r in rows], [zero, *rows], label=f"top-k on {kinds}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k / n (tokens read per row)")
    ax.set_ylabel("Δ val loss vs dense (nats/token)")
    ax.set_title(f"Top-k Pattention, {name} model, {len(q['models'])} seeds (band: 95 % CI)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"topk_{name}.png", dpi=110)

    summary = json.loads(Path(prune_json).read_text())["summary"]
    keys = [k for k in ("val_loss", "finetuned") if f"delta_{k}" in summary[0]]
    fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 4.0), sharey=False,
                             squeeze=False)
    styles = {"ffn": "-", "all": ":", "mlp": "--"}
    colors = {"contribution": "C0", "mass": "C1", "value": "C2", "newest": "C3",
              "magnitude": "black", "activation": "C4"}
    for ax, key in zip(axes[0], keys, strict=True):
        for family, arm in dict.fromkeys((e["family"], e["arm"]) for e in summary):
            rows = [e[f"delta_{key}"] for e in summary if e["family"] == family
                    and e["arm"] == arm]
            xs = [0.0] + [e["pruned"] for e in summary if e["family"] == family
                          and e["arm"] == arm]
            line(ax, xs, [zero, *rows], linestyle=styles[arm.split("/")[0]],
                 color=colors[arm.split("/")[1]],
                 label=f"{'TF' if family == 'tokenformer' else 'T++'} {arm}")
        ax.set_xlabel("fraction removed")
        ax.set_ylabel("Δ val loss vs unpruned (nats/token)")
        ax.set_title("no fine-tune" if key == "val_loss" else "after the fine-tune")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"prune_{name}.png", dpi=110)


def product_profile(args: argparse.Namespace) -> dict:
    """Where a product-key FFN's forward+backward time goes (torch.profiler, self CPU time by
    op), for the FLOP-matched arms of ``product-speed``, next to the dense FFN."""
    from torch.profiler import ProfilerActivity, profile

    from tokenformer.product_keys import ProductKeyPattention

    dense = TokenFormerConfig.from_name(args.preset)
    d = dense.hidden_size
    x = torch.randn(args.rows, d, requires_grad=True)
    arms = {f"dense n={dense.ffn_tokens}": Pattention(d, d, dense.ffn_tokens)}
    for mult in args.multipliers:
        n = round((dense.ffn_tokens * mult) ** 0.5) ** 2
        k = matched_k(dense, n)
        arms[f"product n={n} k={k}"] = ProductKeyPattention(d, d, n, k)
    lines = [f"FFN alone (preset {args.preset}: d={d}), {args.rows} rows, forward + backward, "
             f"3 profiled calls after 2 warm-up calls, 1 thread; self CPU time by op (top 6).",
             ""]
    out = {}
    for name, m in arms.items():
        for _ in range(2):
            m(x).square().mean().backward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                m(x).square().mean().backward()
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in events)
        top = [(e.key, e.self_cpu_time_total / total) for e in events[:6]]
        out[name] = {"total_ms": total / 1e3 / 3, "top": top}
        lines.append(f"- **{name}**: {total / 1e3 / 3:.1f} ms per call; "
                     + ", ".join(f"{k} {f:.0%}" for k, f in top))
    return {"markdown": "\n".join(lines), "arms": out}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by the thread's CPU time (robust on a shared machine)")
    parser.add_argument("--json", default=None, help="also write the results here")
    sub = parser.add_subparsers(dest="what", required=True)
    q = sub.add_parser("quality")
    q.add_argument("models", nargs="+", help="model directories (several: one per seed)")
    q.add_argument("--eval-batches", type=int, default=8)
    p = sub.add_parser("prune")
    p.add_argument("model")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--by", nargs="+", default=["contribution", "mass", "value"])
    p.add_argument("--scales", nargs="+", default=["hold", "renorm"])
    p.add_argument("--finetune-steps", type=int, default=0)
    p.add_argument("--finetune-lr", type=float, default=1e-3)
    s = sub.add_parser("speed")
    s.add_argument("--preset", default="tokenformer-150m")
    s.add_argument("--prefill", type=int, default=256)
    s.add_argument("--position", type=int, default=128)
    s.add_argument("--rounds", type=int, default=12)
    s.add_argument("--fractions", type=float, nargs="+", default=[1 / 4, 1 / 16])
    k = sub.add_parser("product-speed")
    k.add_argument("--preset", default="small")
    k.add_argument("--multipliers", type=int, nargs="+", default=[16, 64])
    k.add_argument("--batch", type=int, default=8)
    k.add_argument("--seq-len", type=int, default=256)
    k.add_argument("--rounds", type=int, default=6)
    f = sub.add_parser("product-profile")
    f.add_argument("--preset", default="small")
    f.add_argument("--multipliers", type=int, nargs="+", default=[16, 64])
    f.add_argument("--rows", type=int, default=2048)
    m = sub.add_parser("compare-mlp")
    m.add_argument("tokenformer")
    m.add_argument("transformer")
    m.add_argument("--eval-batches", type=int, default=8)
    m.add_argument("--finetune-steps", type=int, default=0)
    m.add_argument("--finetune-lr", type=float, default=1e-3)
    t = sub.add_parser("train")
    t.add_argument("--out", required=True)
    t.add_argument("--results", default=str(FRONTIER))
    t.add_argument("--size", default="S2")
    t.add_argument("--families", nargs="+", default=["tokenformer", "transformer++"])
    t.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r = sub.add_parser("prune-seeds")
    r.add_argument("--tokenformer", nargs="+", required=True, help="trained run directories")
    r.add_argument("--transformer", nargs="+", required=True,
                   help="the matched Transformer++ runs, same seeds in the same order")
    r.add_argument("--by", nargs="+", default=["contribution", "mass", "value"])
    r.add_argument("--eval-batches", type=int, default=8)
    r.add_argument("--finetune-steps", type=int, default=100)
    r.add_argument("--lr-factors", type=float, nargs="+", default=[0.1, 0.3, 1.0, 3.0],
                   help="fine-tune peak LR factors; several: swept on the first run")
    r.add_argument("--sweep-fraction", type=float, default=0.5)
    r.add_argument("--from-json", default=None,
                   help="re-render the report from this earlier --json output (no measuring)")
    g = sub.add_parser("plot")
    g.add_argument("quality_json")
    g.add_argument("prune_json")
    g.add_argument("--out", default="docs/img/sparse")
    g = sub.add_parser("plot-seeds")
    g.add_argument("quality_json")
    g.add_argument("prune_json")
    g.add_argument("--out", default="docs/img/sparse")
    g.add_argument("--name", default="frontier")
    args = parser.parse_args(argv)
    if args.what == "plot":
        plot(args.quality_json, args.prune_json, args.out)
        return
    if args.what == "plot-seeds":
        plot_seeds(args.quality_json, args.prune_json, args.out, args.name)
        return
    torch.set_num_threads(args.threads)
    if args.cpu_time:
        import time

        import common

        common.CLOCK = time.thread_time
    result = {"quality": quality, "prune": prune_curve, "speed": speed,
              "product-speed": product_speed, "product-profile": product_profile,
              "compare-mlp": compare_mlp, "train": train_frontier,
              "prune-seeds": prune_seeds}[args.what](args)
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in result.items()
                                               if k != "markdown"}, indent=1) + "\n")
    print(f"### Sparse Pattention: {args.what}\n\nCommand: `{command_line()}`  \n"
          f"CPU: {machine()} (cores shared with other jobs)\n\n{result['markdown']}\n")


if __name__ == "__main__":
    main()
