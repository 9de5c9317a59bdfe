"""Θ's factor annealed after an exact growth (``anneal_steps``; the frontier's ``exact-anneal``).

An exact growth (:mod:`tokenformer.ops.growth`) holds each Pattention kind's Θ factor at its
pre-growth value (written into ``config.{kind}_scale``), which keeps the grown model's function;
the paper's factor for the new size is the default of the new n (√n for the L2 Θs,
:func:`tokenformer.nn.pattention.default_scale`). :class:`Anneal` moves each Pattention's
``scale`` linearly from the held value to that target over ``steps`` steps after the growth; once
there, the config follows n again (``{kind}_scale = None``), so a later exact growth holds the
factor of the size it grows from.

The factor of a step is a pure function of the step and the anneal (its growth step, held and
target factors), so ``fit`` sets it before each step as a training event, and a checkpoint that
carries the anneal (:meth:`Anneal.to_state`) resumes it bit for bit. The config follows the
factor too (``{kind}_scale`` is the factor in force), so a model folder saved inside the anneal
(a checkpoint, ``final/``, :meth:`~tokenformer.TokenFormerLM.save`) loads as the function the
model computes, not the held one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import CheckpointError, ConfigError
from ..nn.pattention import KINDS, default_scale, pattention_kind
from ..ops.growth import recipe_named
from .growth_events import GrowthEvent


@dataclass(frozen=True)
class Anneal:
    """Θ's factor of each kind from ``held[kind]`` at growth step ``step`` to ``target[kind]``
    ``steps`` steps later."""

    step: int
    held: dict[str, float]
    target: dict[str, float]
    steps: int

    @classmethod
    def after_growth(cls, config: Any, step: int, steps: int) -> Anneal:
        """The anneal of a model just grown exactly to ``config`` at ``step``: from the factor
        the config holds to the default of its n."""
        return cls(step, {k: config.theta_scale(k) for k in KINDS},
                   {k: default_scale(config.norm, getattr(config, f"{k}_tokens")) for k in KINDS},
                   steps)

    def fraction(self, step: int) -> float:
        """How far the anneal is before optimizer step ``step``: 0 at the growth, 1 from
        ``steps`` steps later on."""
        return min(1.0, max(0.0, (step - self.step) / self.steps))

    def factor(self, kind: str, step: int) -> float:
        """Θ's factor of ``kind``'s Pattentions at ``step``: the target itself once there (n's
        default, bit for bit, which the config then stands for)."""
        held, target, fraction = self.held[kind], self.target[kind], self.fraction(step)
        return held + fraction * (target - held) if fraction < 1.0 else target

    def apply(self, model: nn.Module, step: int) -> None:
        """Set every Pattention's ``scale`` of ``model`` to its factor at ``step``, and the
        config's ``{kind}_scale`` to the same factor, so that saving the model now writes the
        function it computes; at the end the config follows n again (None)."""
        for name, module in model.pattentions().items():
            module.scale = self.factor(pattention_kind(name), step)
        done = self.fraction(step) >= 1.0
        for kind in self.target:
            setattr(model.config, f"{kind}_scale", None if done else self.factor(kind, step))

    def to_state(self) -> dict[str, Any]:
        """What a checkpoint saves (JSON, and the frontier's state file): the growth step and
        the held and target factors (``steps`` is the run's ``anneal_steps``)."""
        return {"step": self.step, "held": dict(self.held), "target": dict(self.target)}

    @classmethod
    def from_state(cls, data: Any, steps: int, where: str) -> Anneal:
        """The anneal a checkpoint saved (:meth:`to_state`), over ``steps`` steps;
        CheckpointError if malformed."""
        def factors(value: Any) -> bool:
            return (isinstance(value, dict) and set(value) == set(KINDS) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in value.values()))

        step = data.get("step") if isinstance(data, dict) else None
        if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0
                and factors(data.get("held")) and factors(data.get("target"))):
            raise CheckpointError(f"{where}: anneal is malformed (expected step: a step, held "
                                  f"and target: {{kind: factor}} for {', '.join(KINDS)}); resume "
                                  f"from an earlier checkpoint or restore the file")
        if steps <= 0:
            raise ConfigError(f"{where} is inside a Θ-factor anneal: resume it with the "
                              f"anneal_steps it was trained with (> 0)")
        return cls(step, dict(data["held"]), dict(data["target"]), steps)


def is_exact(event: GrowthEvent) -> bool:
    """Whether a ``--grow-at`` growth is exact: its recipe's (exact by default) table entry
    says so (a registered recipe may be exact too)."""
    return recipe_named(event.kwargs.get("recipe", "exact")).exact


def anneal_after(event: GrowthEvent, config: Any, steps: int) -> Anneal | None:
    """The anneal a run's growth ``event`` starts (the model grown to ``config``): after an exact
    growth when ``steps`` > 0, else none (a growth ends an earlier anneal)."""
    if not steps or not is_exact(event):
        return None
    return Anneal.after_growth(config, event.step, steps)


def check_anneal(steps: int, arch: str, events: Sequence[GrowthEvent]) -> None:
    """``anneal_steps`` fits the run: a TokenFormer, at least one exact growth, and no growth
    inside an anneal (it would grow from a factor that is neither held nor n's). One ConfigError
    line otherwise."""
    if not steps:
        return
    if arch != "tokenformer":
        raise ConfigError(f"anneal_steps {steps} anneals Θ's factor of the Pattention layers; "
                          f"arch {arch} has none (set anneal_steps 0)")
    if not any(is_exact(e) for e in events):
        raise ConfigError(f"anneal_steps {steps} anneals Θ's factor after an exact growth, and "
                          f"this run has none: add --grow-at STEP:...,recipe=exact, or set "
                          f"anneal_steps 0")
    for a, b in itertools.pairwise(events):
        if is_exact(a) and b.step - a.step < steps:
            raise ConfigError(f"--grow-at {b.spec!r} comes {b.step - a.step} steps after the "
                              f"exact growth {a.spec!r}, inside its {steps}-step Θ-factor "
                              f"anneal (anneal_steps); anneal over at most {b.step - a.step} "
                              f"steps, or grow later")
