"""What the sparse study measures: its grids, arms and declared questions, as settings per part.

Pure data: the top-k fractions and pruned fractions every model is measured at, the pruning arms
of each family, the paired questions asked of them, and the trainer recipe of a frontier arm
(read from a ``tokenformer scale`` results.json). Each part of the study has one settings
dataclass; its field defaults are the command line's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...errors import ConfigError

FRACTIONS = (1.0, 1 / 2, 1 / 4, 1 / 8, 1 / 16)  # top-k: k / n read per row (1: dense)
PRUNED = (0.0, 0.25, 0.5, 0.75)  # fraction of parameter tokens (or MLP neurons) removed
KINDS = (("qkv",), ("proj",), ("ffn",), ("qkv", "proj", "ffn"))  # where top-k is applied
SPARSITY_COLUMNS = ("attention.query", "attention.key", "attention.value", "attention.proj",
                    "mlp")
MLP_BY = ("magnitude", "activation")  # the Transformer++ MLP neuron criteria
# the frontier whose S2 arms the study retrains (docs/sparse.md); a source checkout's file
FRONTIER = Path(__file__).resolve().parents[4] / "docs/results/frontier-full/results.json"


def frontier_recipe(results: str | Path, family: str, size: str, budget: int = -1) -> dict:
    """The trainer config of one frontier arm at one budget, from its results.json: the run's
    model config, the sweep's chosen LR, the branch's steps and the preset's WSD schedule (a
    single WSD run of the branch's steps is the frontier's stable phase plus that cooldown, step
    for step, with the same batches: ``dataset.batch(step, seed)``)."""
    if not Path(results).is_file():
        raise ConfigError(f"{results} does not exist: --results takes the results.json of a "
                          f"`tokenformer scale` run (default {FRONTIER})")
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


# ---------------------------------------------------------------------- settings per part
@dataclass(frozen=True)
class TrainArms:
    """``train``: a frontier arm (``size``, largest budget) retrained by the normal trainer, one
    run per family and seed, into ``out/<family>-<size>-seed<s>`` (weights in ``final/``)."""

    out: str
    results: str = str(FRONTIER)
    size: str = "S2"
    families: tuple[str, ...] = ("tokenformer", "transformer++")
    seeds: tuple[int, ...] = (0, 1, 2)
    threads: int = 1


@dataclass(frozen=True)
class Quality:
    """``quality``: Δ val loss vs k/n per projection type and Θ's natural sparsity, for each
    model given (one per seed)."""

    models: tuple[str, ...]
    eval_batches: int = 8


@dataclass(frozen=True)
class PruneCurve:
    """``prune``: every Pattention of one model pruned by the same fraction, per criterion and
    Θ-factor handling; optionally fine-tuned through the command line's ``train``."""

    model: str
    eval_batches: int = 8
    by: tuple[str, ...] = ("contribution", "mass", "value")
    scales: tuple[str, ...] = ("hold", "renorm")
    finetune_steps: int = 0
    finetune_lr: float = 1e-3


@dataclass(frozen=True)
class CompareMLP:
    """``compare-mlp``: FFN-only pruning, TokenFormer FFN tokens vs Transformer++ MLP neurons."""

    tokenformer: str
    transformer: str
    eval_batches: int = 8
    finetune_steps: int = 0
    finetune_lr: float = 1e-3


@dataclass(frozen=True)
class PruneSeeds:
    """``prune-seeds``: pruning on trained runs paired by seed, TokenFormer parameter tokens
    (FFN only and every kind, each ``by`` criterion) vs the matched Transformer++'s MLP neurons
    (:data:`MLP_BY`), with and without a fine-tune whose LR factor is swept on the first run."""

    tokenformer: tuple[str, ...]
    transformer: tuple[str, ...]  # the matched Transformer++ runs, same seeds in the same order
    by: tuple[str, ...] = ("contribution", "mass", "value")
    eval_batches: int = 8
    finetune_steps: int = 100
    lr_factors: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0)  # fine-tune peak LR × the run's LR
    sweep_fraction: float = 0.5  # the fraction pruned while the LR factor is swept

    def families(self) -> dict[str, tuple[tuple[str, ...], list[str]]]:
        """``{family: (run directories, arms)}``; an arm is ``KINDS/CRITERION``."""
        return {"tokenformer": (self.tokenformer, [f"{k}/{b}" for k in ("ffn", "all")
                                                   for b in self.by]),
                "transformer++": (self.transformer, [f"mlp/{b}" for b in MLP_BY])}

    def questions(self) -> list[tuple[str, str, str, str]]:
        """The declared comparisons (family a, arm a, family b, arm b): TokenFormer's default
        criterion against both MLP criteria, and against the data-free criteria (value;
        newest = index order, which carries no meaning in a model trained from scratch: an
        arbitrary-choice control) within each family."""
        questions = [("tokenformer", "ffn/contribution", "transformer++", f"mlp/{b}")
                     for b in MLP_BY]
        questions += [("tokenformer", f"{k}/contribution", "tokenformer", f"{k}/{other}")
                      for other in ("value", "newest") for k in ("ffn", "all")
                      if "contribution" in self.by and other in self.by]
        questions.append(("transformer++", "mlp/activation", "transformer++", "mlp/magnitude"))
        return questions
