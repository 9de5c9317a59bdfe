"""Growth during a run: the run's growth plan, checked as a whole before any work
(:func:`growth_plan`), and at a ``--grow-at`` step the growth itself: grow the model and carry
its optimizer (:func:`tokenformer.ops.growth.grow_with_optimizer`), evaluate before and after,
and record the event."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..io.process_group import World
from ..models.config import flops_per_token
from ..ops.growth import grow_with_optimizer
from .anneal import check_anneal
from .execution import prepare_module
from .growth_events import GrowthEvent, growth_events

if TYPE_CHECKING:
    from .config import TrainConfig


def growth_plan(cfg: TrainConfig) -> list[GrowthEvent]:
    """The growths of the run ``cfg`` describes, by step, each with the run-wide options it does
    not set itself (:func:`.growth_events.growth_events`), checked as a plan: no freeze outlasts
    the next growth, and ``anneal_steps`` fits the growths (:func:`.anneal.check_anneal`). One
    ConfigError line otherwise; ``fit`` and ``train`` call it before anything is written (a
    TrainConfig checks its own fields, each growth's spec and step among them)."""
    events = growth_events(cfg.grow_at, freeze_old=cfg.growth_freeze_old,
                           noise_old=cfg.growth_noise_old)
    check_anneal(cfg.anneal_steps, cfg.arch, events)
    return events



def growth_generator(seed: int, step: int = 0) -> torch.Generator:
    """The generator of a growth's new tokens: a pure function of the run's seed and the
    growth's step, so every rank and every resume draws the same tokens."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)

def grow_in_run(model: nn.Module, optimizer: torch.optim.Optimizer, event: GrowthEvent,
          cfg: TrainConfig, world: World, device: torch.device,
          evaluate: Callable[[nn.Module], dict[str, float]] | None,
          counters: dict[str, Any]
          ) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, dict[str, Any]]:
    """Grow model and optimizer at ``event`` (the new rows, and ``noise_old``, drawn from a
    generator seeded by the run's seed and the step: the same on every rank and on resume);
    ``evaluate`` before and after; the event's record. The optimizer is reset when
    ``growth_optimizer`` is ``reset`` or the recipe is ``official-released``."""
    before = evaluate(model) if evaluate else {}
    params_before = sum(p.numel() for p in model.parameters())
    config_before = getattr(model, "config", None)
    generator = growth_generator(cfg.seed, event.step)
    model, optimizer = grow_with_optimizer(model, optimizer,
                                           reset_optimizer=cfg.growth_optimizer == "reset",
                                           new_row_moments="mean" if cfg.growth_optimizer
                                           == "carry-mean" else "zero",
                                           generator=generator, **event.kwargs)
    model = model.to(device).train()
    module = prepare_module(model, cfg, world, device)
    after = evaluate(model) if evaluate else {}
    record: dict[str, Any] = {
        "type": "grow", "step": event.step, "spec": event.spec,
        "params_before": params_before, "params_after": sum(p.numel() for p in
                                                            model.parameters()),
        "before": before, "after": after, **counters}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "projection_flops"):
        record["flops_per_token_before"] = flops_per_token(config_before, cfg.seq_len, True
                                                           )["total"]
        record["flops_per_token_after"] = flops_per_token(config, cfg.seq_len, True)["total"]
    return model, optimizer, module, record
