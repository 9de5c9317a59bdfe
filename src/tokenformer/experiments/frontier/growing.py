"""A chain's growths in the frontier: each recipe's operator at a stage's start (tokens, MLP width,
stacking, cloning), with the old-token options and the Θ-factor anneal it asks for, and the
growth diagnostics (old vs new tokens' norms and their first update)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ...nn.pattention import pattention_kind
from ...ops.growth import grow_with_optimizer
from ...ops.widening import widen_mlp
from ...training.anneal import Anneal
from ...training.freezing import FrozenRows
from . import recipes as recipes_
from . import schedule as schedule_
from .schedule import Run
from .state import Context


def _grow(ctx: Context, run: Run, model: Any, optimizer: Any, stage: schedule_.Stage,
          state: dict[str, Any]) -> tuple[Any, Any]:
    """Grow to ``stage``'s size with the run's recipe and old-token options; the anneal record
    (or None) and the frozen rows (or None) go into ``state``."""
    generator = torch.Generator().manual_seed(run.seed * 1_000_003 + stage.start)
    recipe = recipes_.RECIPES[run.recipe]
    if recipe.shape != "size":  # G_stack or HyperCloning, into the final size
        c = stage.config
        how = ({"layers": c.num_layers, "how": "stack"} if recipe.shape == "stack" else
               {"hidden": c.hidden_size, "heads": c.num_heads, "width_noise": recipe.width_noise,
                # v4's width-scaled Transformer++ doubles its MLP with the hidden size
                **({"ffn": c.intermediate_size} if getattr(model.config, "intermediate_size",
                                                           None) != c.intermediate_size else {})})
        model, optimizer = grow_with_optimizer(
            model, optimizer, new_row_moments=ctx.preset.new_row_moments, generator=generator,
            **how)
        if dataclasses.asdict(model.config) != dataclasses.asdict(stage.config):
            raise AssertionError(f"{run.id}: grown to {model.config}, planned {stage.config}")
        state.update(anneal=None, frozen_rows=None)
        return model.to(ctx.device).train(), optimizer
    if recipe.kind == "widen":
        model, optimizer = widen_mlp(model, optimizer, stage.config.intermediate_size,
                                     recipe.method, generator=generator)
        state.update(anneal=None, frozen_rows=None)
        return model.to(ctx.device).train(), optimizer

    c = stage.config
    model, optimizer = grow_with_optimizer(
        model, optimizer, new_row_moments=ctx.preset.new_row_moments, generator=generator,
        qkv=c.qkv_tokens, proj=c.proj_tokens, ffn=c.ffn_tokens, strategy=recipe.method,
        freeze_old=recipe.freeze_old, noise_old=recipe.noise_old)
    model = model.to(ctx.device).train()
    freeze = FrozenRows.after_growth(model, stage.start)
    state["frozen_rows"] = freeze.to_state() if freeze is not None else None
    state["anneal"] = (Anneal.after_growth(model.config, stage.start,
                                           ctx.preset.anneal_steps).to_state()
                       if recipe.anneal else None)
    return model, optimizer


def _grows_tokens(run: Run) -> bool:
    recipe = recipes_.RECIPES.get(run.recipe or "")
    return recipe is not None and recipe.kind == "chain" and recipe.shape == "size"


def _row_norm(t: Any) -> float:
    return float(t.detach().float().norm(dim=1).mean()) if t.shape[0] else math.nan


def _diagnose_growth(run: Run, model: Any, old_rows: dict[str, int], step: int
                     ) -> dict[str, Any]:
    """Right after a growth of tokens: the old (first ``old_rows``) and new rows' mean L2 norm
    per Pattention kind and tensor, and a copy of the tokens to measure the first step's
    update against (:func:`_finish_diagnosis`)."""
    sizes = schedule_.size_at(run.stages, step - 1).size, schedule_.size_at(run.stages, step).size
    norms: dict[str, list[tuple[float, float]]] = {}
    snap = {}
    for name, m in model.pattentions().items():
        n = old_rows[name]
        for which, t in (("keys", m.key_param_tokens), ("values", m.value_param_tokens)):
            norms.setdefault(f"{pattention_kind(name)}.{which}", []).append(
                (_row_norm(t[:n]), _row_norm(t[n:])))
            snap[f"{name}.{which}"] = (n, t.detach().clone())
    tensors = {k: {"old_norm": sum(a for a, _ in v) / len(v),
                   "new_norm": sum(b for _, b in v) / len(v)} for k, v in norms.items()}
    return {"step": step, "from": sizes[0], "to": sizes[1], "tensors": tensors, "snap": snap}


def _finish_diagnosis(model: Any, pending: dict[str, Any]) -> dict[str, Any]:
    """The mean |Δ| of the first optimizer step after the growth, old and new rows."""
    deltas: dict[str, list[tuple[float, float]]] = {}
    for name, m in model.pattentions().items():
        for which, t in (("keys", m.key_param_tokens), ("values", m.value_param_tokens)):
            n, before = pending["snap"][f"{name}.{which}"]
            d = (t.detach().float() - before.float()).abs()
            deltas.setdefault(f"{pattention_kind(name)}.{which}", []).append(
                (float(d[:n].mean()), float(d[n:].mean()) if d.shape[0] > n else math.nan))
    tensors = {k: {**pending["tensors"][k], "old_update": sum(a for a, _ in v) / len(v),
                   "new_update": sum(b for _, b in v) / len(v)} for k, v in deltas.items()}
    return {"step": pending["step"], "from": pending["from"], "to": pending["to"],
            "tensors": tensors}
