"""The ``--grow-at`` mini-language: ``STEP:key=value,...`` specs become checked growth events.

``500:qkv=2x,proj=2x,ffn=512,layers=6,strategy=exact`` is a :class:`GrowthEvent`, checked against
the run's steps and, before the first step, against the model (:func:`check_growth_plan`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, TokenFormerError
from ..models.memory import check_memory
from ..ops.growth import STRATEGIES, plan_growth

GROW_KEYS = ("qkv", "proj", "ffn", "layers", "strategy")


@dataclass(frozen=True)
class GrowthEvent:
    """One growth of a run: before optimizer step ``step``, ``grow_with_optimizer(**kwargs)``."""

    step: int
    kwargs: dict[str, Any]
    spec: str


def parse_grow_at(spec: str) -> GrowthEvent:
    """``"STEP:qkv=2x,ffn=512,layers=6,strategy=exact"`` → GrowthEvent."""
    usage = (f"--grow-at {spec!r} is malformed: expected STEP:key=value,... with keys "
             f"{', '.join(GROW_KEYS)} (e.g. 500:qkv=2x,proj=2x,ffn=2x,strategy=exact)")
    step_text, sep, rest = str(spec).partition(":")
    if not sep or not step_text.strip().isdecimal() or not rest.strip():
        raise ConfigError(usage)
    kwargs: dict[str, Any] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or key not in GROW_KEYS or not value or key in kwargs:
            raise ConfigError(usage)
        if key == "strategy":
            if value not in STRATEGIES:
                raise ConfigError(f"--grow-at {spec!r}: unknown strategy {value!r}; choose one "
                                  f"of {', '.join(STRATEGIES)}")
            kwargs[key] = value
        elif value.isdecimal() and int(value) > 0:
            kwargs[key] = int(value)
        elif value.endswith("x") and _is_positive_float(value[:-1]):
            if float(value[:-1]) < 1:
                raise ConfigError(f"--grow-at {spec!r}: {key}={value} would shrink the model; "
                                  f"growth only adds (use a multiplier >= 1x)")
            kwargs[key] = value
        else:
            raise ConfigError(f"--grow-at {spec!r}: {key}={value!r} must be a positive integer "
                              f"or a multiplier like 2x")
    return GrowthEvent(int(step_text), kwargs, str(spec))


def _is_positive_float(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def growth_events(specs: Sequence[str], steps: int) -> list[GrowthEvent]:
    """The ``--grow-at`` specs of a run of ``steps`` steps as events, by step; a step outside the
    run or two growths at one step are refused."""
    events = sorted((parse_grow_at(s) for s in specs), key=lambda e: e.step)
    for event in events:
        if not 0 < event.step < steps:
            raise ConfigError(f"--grow-at {event.spec!r}: the step must be in 1..{steps - 1}")
    if len({e.step for e in events}) != len(events):
        raise ConfigError("--grow-at: two growths at the same step; merge them into one")
    return events


def check_growth_plan(config: Any, events: Sequence[GrowthEvent]) -> None:
    """Apply every growth to the model config in order, before the first step: a shrink, an
    unknown strategy, an impossible multiple or a model too large for memory fails now, not after
    the steps before it."""

    if not events or not hasattr(config, "qkv_tokens"):
        return
    for event in events:
        try:
            config = plan_growth(config, **event.kwargs)
            check_memory(config, 4, "the grown model")  # weights, gradients, two moments
        except TokenFormerError as exc:
            raise ConfigError(f"--grow-at {event.spec!r}: {exc}") from None
