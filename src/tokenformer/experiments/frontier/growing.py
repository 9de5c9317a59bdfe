"""A chain's growths in the frontier, as the growth events that ``fit`` applies
(:mod:`tokenformer.training.growth`, the one way a run grows): each arm's growth into a stage as
a :class:`~tokenformer.training.growth_events.GrowthEvent`, whose spec is the one ``tokenformer
train --grow-at`` takes (:func:`grow_at`), the run-wide growth options that go with it
(:func:`growth_settings`), and the growth diagnostics (old vs new tokens' norms and their first
update)."""

from __future__ import annotations

import math
from typing import Any

from ...nn.pattention import pattention_kind
from ...ops.growth import OLD_RECIPE_KEY, old_tokens
from ...training.growth_events import GrowthEvent
from . import schedule as schedule_
from .arms import GROWING_ARMS
from .presets import Preset
from .schedule import Run

# What a growth changes in a model's config (the rest, e.g. Θ's factors, follows the recipe): a
# model of a stage's sizes has grown into that stage.
SIZE_FIELDS = ("num_layers", "hidden_size", "num_heads", "intermediate_size", "qkv_tokens",
               "proj_tokens", "ffn_tokens")


def same_size(a: Any, b: Any) -> bool:
    """Whether configs ``a`` and ``b`` have the same sizes (:data:`SIZE_FIELDS`)."""
    return all(getattr(a, f, None) == getattr(b, f, None) for f in SIZE_FIELDS)


def grow_at(run: Run, stage: schedule_.Stage, config: Any) -> GrowthEvent:
    """The growth event of ``run``'s growth from a model of ``config`` into ``stage``: its arm's
    operator (tokens, MLP widening, stacking or duplication), sizes and old-token options. Its
    spec is the ``--grow-at`` text a user would write, as the frontier has always written it
    (the recipe under ``strategy=``, its old key): what a record or a message shows."""
    growing = GROWING_ARMS[run.recipe]
    c = stage.config
    request: dict[str, Any]
    if growing.shape == "stack":  # G_stack, into the final size
        request = {"layers": c.num_layers, "how": "stack"}
    elif growing.shape == "clone":  # HyperCloning, into the final size
        request = {"hidden": c.hidden_size, "heads": c.num_heads,
                   "width_noise": growing.width_noise,
                   # v4's width-scaled Transformer++ doubles its MLP with the hidden size
                   "ffn": c.intermediate_size if config.intermediate_size
                   != c.intermediate_size else None}
    elif growing.kind == "widen":
        request = {"ffn": c.intermediate_size, "widen": growing.method}
    else:
        request = {"qkv": c.qkv_tokens, "proj": c.proj_tokens, "ffn": c.ffn_tokens,
                   "recipe": growing.method, "freeze_old": growing.freeze_old,
                   "noise_old": growing.noise_old}
    kwargs = {key: value for key, value in request.items() if value not in (None, 0.0)}
    spec = ",".join(f"{OLD_RECIPE_KEY if key == 'recipe' else key}="
                    + (repr(value) if isinstance(value, float) else str(value))
                    for key, value in kwargs.items())
    return GrowthEvent(stage.start, kwargs, f"{stage.start}:{spec}")


def growth_settings(preset: Preset, run: Run, grows: bool) -> dict[str, Any]:
    """The training options of a segment of ``run`` (``grows``: one that starts with a growth):
    the carried AdamW state of new rows (the preset's ``new_row_moments``; an MLP widening
    starts its new units' moments at zero, the only form an MLP widening has) and, for
    an annealing recipe, the anneal of Θ's factor that its exact growth starts."""
    growing = GROWING_ARMS.get(run.recipe or "")
    if growing is None:
        return {}
    widening = growing.kind == "widen" and growing.shape == "size"
    mean = preset.new_row_moments == "mean" and not widening
    return {"growth_optimizer": "carry-mean" if mean else "carry",
            "anneal_steps": preset.anneal_steps if growing.anneal and grows else 0}


def grows_tokens(run: Run) -> bool:
    growing = GROWING_ARMS.get(run.recipe or "")
    return growing is not None and growing.kind == "chain" and growing.shape == "size"


def _row_norm(t: Any) -> float:
    return float(t.detach().float().norm(dim=1).mean()) if t.shape[0] else math.nan


def diagnose_growth(run: Run, model: Any, step: int) -> dict[str, Any]:
    """Right after a growth of tokens: the old rows' (those the growth kept, as it recorded
    them: :func:`tokenformer.ops.growth.old_tokens`) and new rows' mean L2 norm per Pattention
    kind and tensor, and a copy of the tokens to measure the first step's update against
    (:func:`finish_diagnosis`)."""
    sizes = schedule_.size_at(run.stages, step - 1).size, schedule_.size_at(run.stages, step).size
    kept = old_tokens(model)
    if kept is None:
        raise AssertionError(f"{run.id}: the growth at step {step} recorded no old tokens")
    norms: dict[str, list[tuple[float, float]]] = {}
    snap = {}
    for name, m in model.pattentions().items():
        n = kept.rows[f"{name}.key_param_tokens"]
        for which, t in (("keys", m.key_param_tokens), ("values", m.value_param_tokens)):
            norms.setdefault(f"{pattention_kind(name)}.{which}", []).append(
                (_row_norm(t[:n]), _row_norm(t[n:])))
            snap[f"{name}.{which}"] = (n, t.detach().clone())
    tensors = {k: {"old_norm": sum(a for a, _ in v) / len(v),
                   "new_norm": sum(b for _, b in v) / len(v)} for k, v in norms.items()}
    return {"step": step, "from": sizes[0], "to": sizes[1], "tensors": tensors, "snap": snap}


def finish_diagnosis(model: Any, pending: dict[str, Any]) -> dict[str, Any]:
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
