"""Measures the sparse study: retrains frontier arms, top-k quality, pruning with fine-tunes.

Every part takes its settings from :mod:`.plan` and returns plain rows (no statistics, no text:
that is :mod:`.report`). Models are evaluated on the held-out split of the embedded corpus with
the trainer's evaluator (fixed windows, ``eval_batches`` × 16 × min(256, context) tokens);
progress goes to stderr.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ...data.corpus import default_dataset
from ...formats.loading import load_model
from ...nn.pattention import Pattention, set_pattention_top_k, theta
from ...ops.pruning import prune
from ...training.config import TrainConfig
from ...training.evaluation import lm_evaluator
from ...training.lm import train
from ...training.loop import fit
from .mlp import prune_mlp
from .plan import (
    FRACTIONS,
    KINDS,
    PRUNED,
    CompareMLP,
    PruneCurve,
    PruneSeeds,
    Quality,
    TrainArms,
    frontier_recipe,
)


def log(message: str) -> None:
    """Progress for the person watching: stderr, so stdout stays the report."""
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ training
def train_arms(plan: TrainArms) -> list[dict[str, Any]]:
    """Train the frontier's arm (``size``, largest budget) with the normal trainer, one run per
    family and seed, into ``OUT/<family>-<size>-seed<s>`` (weights in ``final/``)."""
    rows = []
    for family in plan.families:
        recipe = frontier_recipe(plan.results, family, plan.size)
        budget, frontier_loss = recipe.pop("budget"), recipe.pop("frontier_loss")
        for seed in plan.seeds:
            out = Path(plan.out) / f"{family}-{plan.size}-seed{seed}"
            cfg = TrainConfig.from_dict({**recipe, "seed": seed, "threads": plan.threads,
                                         "out": str(out)})
            result = train(cfg, progress=False, print_fn=log)
            loss = result.final_eval["val_loss"]
            rows.append({"family": family, "seed": seed, "val_loss": loss, "out": str(out),
                         "frontier_loss": frontier_loss.get(seed), "lr": cfg.lr,
                         "steps": cfg.steps, "budget": budget})
            log(f"{family} seed {seed}: val loss {loss:.4f} (frontier "
                f"{rows[-1]['frontier_loss']})")
    return rows


# ------------------------------------------------------------------------------- top-k
def evaluator(model: torch.nn.Module, eval_batches: int, seq_len: int = 256) -> tuple[Any, Any]:
    """The trainer's evaluator on the embedded corpus's held-out split, and that data set."""
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


def quality_of(path: str, eval_batches: int) -> dict[str, Any]:
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


def quality(plan: Quality) -> list[dict[str, Any]]:
    """:func:`quality_of` every model of the plan (one per seed)."""
    return [quality_of(m, plan.eval_batches) for m in plan.models]


# -------------------------------------------------------------------- pruning one model
def finetune(model: torch.nn.Module, steps: int, lr: float, workdir: Path) -> torch.nn.Module:
    """``steps`` steps of the trainer (demo config, constant LR after 10 warmup steps) from
    ``model``, through the command line's ``train --init-from``, as a user would."""
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


def _finetuned_loss(small: torch.nn.Module, steps: int, lr: float, evaluate: Any) -> float:
    """Val loss of ``small`` after :func:`finetune` (in a scratch directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        tuned = finetune(small, steps, lr, Path(tmp))
    with torch.no_grad():
        return evaluate(tuned)["val_loss"]


def prune_curve(plan: PruneCurve) -> list[dict[str, Any]]:
    """Every Pattention (qkv/proj/ffn) of one model pruned by each fraction, criterion and Θ
    factor handling; the first handling also fine-tuned when ``finetune_steps``."""
    model = load_model(plan.model).eval()
    evaluate, dataset = evaluator(model, plan.eval_batches)
    calib = next(iter(dataset.eval_windows("train", 256, 8, max_batches=1)))
    rows = []
    c = model.config
    for frac in PRUNED:
        sizes = {k: max(1, round(getattr(c, f"{k}_tokens") * (1 - frac)))
                 for k in ("qkv", "proj", "ffn")}
        for by in plan.by:
            for scale in plan.scales:
                small = prune(model, **sizes, by=by, calibration=calib, scale=scale).eval()
                with torch.no_grad():
                    loss = evaluate(small)["val_loss"]
                row = {"pruned": frac, "by": by, "scale": scale, "val_loss": loss,
                       "params": small.num_parameters(), "finetuned": None}
                if plan.finetune_steps and scale == plan.scales[0]:
                    row["finetuned"] = _finetuned_loss(small, plan.finetune_steps,
                                                       plan.finetune_lr, evaluate)
                log(f"pruned {frac:.0%} by {by} scale {scale}: {loss:.4f} "
                    f"fine-tuned {row['finetuned']}")
                rows.append(row)
                if frac == 0.0:
                    break
            if frac == 0.0:
                break
    return rows


def compare_mlp(plan: CompareMLP) -> list[dict[str, Any]]:
    """FFN-only pruning: TokenFormer FFN tokens (by contribution, Θ factor held) vs the
    Transformer++ MLP neurons (magnitude), same fractions, same fine-tune recipe."""
    tf, tpp = load_model(plan.tokenformer).eval(), load_model(plan.transformer).eval()
    evaluate, dataset = evaluator(tf, plan.eval_batches)
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
            if plan.finetune_steps:
                tuned = _finetuned_loss(small, plan.finetune_steps, plan.finetune_lr, evaluate)
            rows.append({"pruned": frac, "arch": arch, "val_loss": loss, "finetuned": tuned,
                         "params": small.num_parameters()})
            log(f"{arch} ffn pruned {frac:.0%}: {loss:.4f} fine-tuned {tuned}")
    return rows


# ------------------------------------------------------------------ pruning with seeds
def finetune_wsd(model: torch.nn.Module, run: dict, steps: int, lr: float, dataset: Any
                 ) -> torch.nn.Module:
    """``steps`` steps of ``tokenformer.training.loop.fit`` on ``model`` (in place), fresh AdamW,
    the frontier's schedule family: WSD (10 warmup steps, the last 20 % decaying to 0.1 × ``lr``);
    batch, sequence, weight decay, clipping and data seed of the run's config (``run``), on the
    training batches that follow the run's last step."""
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


def prune_run(path: str, arms: list[str], lr_factor: float, plan: PruneSeeds
              ) -> list[dict[str, Any]]:
    """Every (arm, fraction) of one trained run directory: val loss, and after the fine-tune.
    The unpruned model (fraction 0) gets the same fine-tune, the reference of the tuned rows."""
    run, model, evaluate, dataset, calib = load_run(path, plan.eval_batches)
    rows = []
    for frac in PRUNED:
        for arm in (arms[:1] if frac == 0 else arms):
            small = pruned(model, arm, frac, calib)
            with torch.no_grad():
                loss = evaluate(small)["val_loss"]
            tuned = None
            if plan.finetune_steps:
                small = finetune_wsd(small, run, plan.finetune_steps, lr_factor * run["lr"],
                                     dataset)
                with torch.no_grad():
                    tuned = evaluate(small)["val_loss"]
            rows.append({"arm": "unpruned" if frac == 0 else arm, "pruned": frac,
                         "seed": run["seed"], "params": small.num_parameters(),
                         "val_loss": loss, "finetuned": tuned})
            log(f"{path} {rows[-1]['arm']} {frac:.0%}: {loss:.4f} fine-tuned {tuned}")
    return rows


def finetune_lr_sweep(path: str, arm: str, plan: PruneSeeds) -> dict[str, Any]:
    """Fine-tune LR factor (× the run's tuned LR) for one family: the fine-tuned val loss of
    ``arm`` pruned by ``sweep_fraction`` on one run, at each of ``lr_factors``."""
    run, model, evaluate, dataset, calib = load_run(path, plan.eval_batches)
    losses = {}
    for factor in plan.lr_factors:
        small = finetune_wsd(pruned(model, arm, plan.sweep_fraction, calib), run,
                             plan.finetune_steps, factor * run["lr"], dataset)
        with torch.no_grad():
            losses[factor] = evaluate(small)["val_loss"]
        log(f"sweep {path} {arm} lr × {factor}: {losses[factor]:.4f}")
    best = min(losses, key=losses.get)
    return {"arm": arm, "losses": losses, "chosen": best,
            "at_edge": best in (min(losses), max(losses))}


def prune_seeds(plan: PruneSeeds) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every family's runs pruned by every arm and fraction (rows), the fine-tune's LR factor
    swept first on each family's first run when there are several (sweeps)."""
    sweeps: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for family, (paths, arms) in plan.families().items():
        factor = plan.lr_factors[0]
        if plan.finetune_steps and len(plan.lr_factors) > 1:
            sweeps[family] = finetune_lr_sweep(paths[0], arms[0], plan)
            factor = sweeps[family]["chosen"]
        for path in paths:
            rows += [{**r, "family": family, "lr_factor": factor}
                     for r in prune_run(path, arms, factor, plan)]
    return rows, sweeps
