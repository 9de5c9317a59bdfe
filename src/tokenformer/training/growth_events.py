"""The ``--grow-at`` mini-language: ``STEP:key=value,...`` specs become checked growth events.

``500:qkv=2x,proj=2x,ffn=512,layers=6,recipe=exact`` is a :class:`GrowthEvent`, parsed once (a
TrainConfig's ``grow_at`` holds the events; code that plans growths, such as the frontier,
builds them directly), checked against the run's steps and, before the first step, against the
model (:func:`check_growth_plan`). The spec text stays with the event for records (the trainer
state's ``growth``, the ``grow`` record) and messages. Keys:

* sizes, passed to :func:`tokenformer.ops.growth.grow`: ``qkv``, ``proj``, ``ffn``, ``layers``,
  ``hidden``, ``heads`` (a count or a multiplier like ``2x``), ``how`` (``identity``, ``stack``),
  ``width_noise`` (zero-sum noise on duplicated units, std relative to each tensor's rms),
  ``widen`` (a Transformer baseline's MLP: ``duplicate``, ``zero``, ``net2net``);
* ``recipe``: ``exact``, ``paper``, ``official-init``, ``official-released`` (``official``: the
  old name of ``official-init``; ``strategy=``, the key's old name, still works, with a
  deprecation warning);
* old tokens: ``freeze_old`` (steps, or ``forever``), ``noise_old`` (std relative to each tensor's
  rms);
* the schedule: ``lr`` (the peak of the stages from this growth on) and ``lr_ramp`` (steps over
  which the peak moves there; default 0, at once).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, ConfigError, TokenFormerError
from ..models.memory import check_memory
from ..ops.growth import (
    FOREVER,
    OLD_RECIPE_KEY,
    OLD_TOKEN_KEYS,
    RECIPES,
    TEXT_KEYS,
    canonical_recipe,
    freeze_request,
    plan_growth,
    recipe_alias_note,
    recipe_names,
    resets_optimizer,
    take_old_recipe_key,
    widen_names,
)
from .schedule import LrStage

# Other names of a key (each listed after it), and the keys a growth sets in the run's schedule.
KEY_ALIASES = {"recipe": (OLD_RECIPE_KEY,)}
SCHEDULE_KEYS = ("lr", "lr_ramp")
# The growth's own keys are GrowthOptions' fields that have a key=value form.
GROW_KEYS = (*(k for key in TEXT_KEYS for k in (key, *KEY_ALIASES.get(key, ()))),
             *SCHEDULE_KEYS)
_WORD = re.compile(r"^[a-z][a-z_-]*$")


@dataclass(frozen=True)
class GrowthEvent:
    """One growth of a run: before optimizer step ``step``, ``grow_with_optimizer(**kwargs)``;
    ``spec``: its ``--grow-at`` text (what records and messages show); ``lr``/``lr_ramp``: the
    peak learning rate from then on (None: unchanged); ``note``: a line for the user (an old
    recipe name); ``run_wide``: the keys of ``kwargs`` the run's ``growth_freeze_old`` /
    ``growth_noise_old`` filled in (:func:`growth_events`)."""

    step: int
    kwargs: dict[str, Any]
    spec: str
    lr: float | None = None
    lr_ramp: int = 0
    note: str = ""
    run_wide: tuple[str, ...] = ()

    @property
    def lr_stage(self) -> LrStage:
        """What this growth does to the schedule: a restart for ``official-released``."""
        return LrStage(self.step, resets_optimizer(self.kwargs.get("recipe", "exact")), self.lr,
                       self.lr_ramp)

    def as_given(self) -> GrowthEvent:
        """The event as its spec gives it, without the run-wide options."""
        return dataclasses.replace(self, kwargs={k: v for k, v in self.kwargs.items()
                                                 if k not in self.run_wide}, run_wide=())

    @property
    def freeze_end(self) -> float:
        """The step the old tokens frozen by this growth train again (inf: never; the step
        itself: no freeze)."""
        freeze = freeze_request(self.kwargs.get("freeze_old"))
        return math.inf if freeze == FOREVER else self.step + (freeze or 0)


def parse_grow_at(spec: str, *, recorded: bool = False) -> GrowthEvent:
    """``"STEP:qkv=2x,ffn=512,layers=6,recipe=exact,lr=5e-4"`` → GrowthEvent. ``recorded``: a
    spec a run recorded (its trainer state), read without the old key's deprecation warning."""
    usage = (f"--grow-at {spec!r} is malformed: expected STEP:key=value,... with keys "
             f"{', '.join(GROW_KEYS)} (e.g. 500:qkv=2x,proj=2x,ffn=2x,recipe=exact)")
    step_text, sep, rest = str(spec).partition(":")
    if not sep or not step_text.strip().isdecimal() or not rest.strip():
        raise ConfigError(usage)
    kwargs = parse_options(rest, f"--grow-at {spec!r}", GROW_KEYS, usage)
    note = ""
    if recorded:  # a run's own record: the key it has always written, read without a warning
        kwargs = {("recipe" if k == OLD_RECIPE_KEY else k): v for k, v in kwargs.items()}
    kwargs = take_old_recipe_key(kwargs, "--grow-at ...,strategy=", "recipe=", ConfigError,
                                 f"--grow-at {spec!r}: ")
    if kwargs.get("recipe", "exact") not in RECIPES:  # an old name (_value knew it)
        note = recipe_alias_note(kwargs["recipe"])
        kwargs["recipe"] = canonical_recipe(kwargs["recipe"], warn=False)
    lr, ramp = kwargs.pop("lr", None), kwargs.pop("lr_ramp", 0)
    if ramp and lr is None:
        raise ConfigError(f"--grow-at {spec!r}: lr_ramp needs lr= (the peak to ramp to)")
    return GrowthEvent(int(step_text), kwargs, str(spec), lr, ramp, note)


def parse_options(text: str, where: str, keys: Sequence[str], usage: str) -> dict[str, Any]:
    """``key=value,...`` (keys among ``keys``) with each value checked and converted; one
    ConfigError line naming ``where`` for anything wrong."""
    kwargs: dict[str, Any] = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or key not in keys or not value or key in kwargs:
            raise ConfigError(usage)
        kwargs[key] = _value(key, value, where)
    return kwargs


def _value(key: str, value: str, where: str) -> Any:
    if key in ("recipe", OLD_RECIPE_KEY):
        if value not in recipe_names():
            raise ConfigError(f"{where}: unknown {key} {value!r}; choose one of "
                              f"{', '.join(RECIPES)}")
        return value
    if key == "widen":
        if value not in widen_names():
            raise ConfigError(f"{where}: unknown widen {value!r}; choose one of "
                              f"{', '.join(widen_names())}")
        return value
    if key == "how":
        if not _WORD.match(value):
            raise ConfigError(f"{where}: how={value!r} must be a word like identity or stack")
        return value
    if key == "freeze_old":
        if value != FOREVER and not value.isdecimal():
            raise ConfigError(f"{where}: freeze_old={value!r} must be a number of steps or "
                              f"{FOREVER}")
        return value if value == FOREVER else int(value)
    if key in ("noise_old", "width_noise", "lr"):
        number = _float(value)
        if number is None or number < 0 or (key == "lr" and number == 0):
            raise ConfigError(f"{where}: {key}={value!r} must be a number "
                              f"{'> 0' if key == 'lr' else '>= 0'}")
        return number
    if key == "lr_ramp":
        if not value.isdecimal():
            raise ConfigError(f"{where}: lr_ramp={value!r} must be a number of steps")
        return int(value)
    if value.isdecimal() and int(value) > 0:  # a size
        return int(value)
    if value.endswith("x") and (factor := _float(value[:-1])) is not None and factor > 0:
        if factor < 1:
            raise ConfigError(f"{where}: {key}={value} would shrink the model; growth only "
                              f"adds (use a multiplier >= 1x)")
        return value
    raise ConfigError(f"{where}: {key}={value!r} must be a positive integer or a multiplier "
                      f"like 2x")


def _float(text: str) -> float | None:
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def run_options(freeze_old: str = "0", noise_old: float = 0.0) -> dict[str, Any]:
    """A run's ``growth_freeze_old`` / ``growth_noise_old`` as the options every growth without
    its own gets (none when 0: off, as if not given); one ConfigError line if malformed."""
    options = parse_options(f"freeze_old={freeze_old},noise_old={noise_old}",
                            "growth_freeze_old/growth_noise_old", OLD_TOKEN_KEYS,
                            f"growth_freeze_old must be a number of steps or {FOREVER}, and "
                            f"growth_noise_old a number >= 0")
    return {k: v for k, v in options.items() if v}


def check_steps(events: Sequence[GrowthEvent], steps: int, min_lr: float) -> None:
    """The growths fit a run of ``steps`` steps whose decays end at ``min_lr``: each inside the
    run, none at the step of another, no stage peak below ``min_lr``. One ConfigError line."""
    for event in events:
        if not 0 < event.step < steps:
            raise ConfigError(f"--grow-at {event.spec!r}: the step must be in 1..{steps - 1}")
    if len({e.step for e in events}) != len(events):
        raise ConfigError("--grow-at: two growths at the same step; merge them into one")
    for event in events:
        if event.lr is not None and event.lr < min_lr:
            raise ConfigError(f"--grow-at {event.spec!r}: lr {event.lr:g} is below min_lr "
                              f"{min_lr:g}, where every decay ends")


def growth_events(given: Sequence[GrowthEvent], *, freeze_old: str = "0",
                  noise_old: float = 0.0) -> list[GrowthEvent]:
    """The growths of a run, by step, each without its own ``freeze_old``/``noise_old`` given the
    run's (``growth_freeze_old``/``growth_noise_old``, :func:`run_options`; the ``given`` events
    are left as they are). Refused: a freeze that would outlast the next growth (which ends it)
    unless that growth freezes at least as long."""
    defaults = run_options(freeze_old, noise_old)
    events = []
    for event in given:
        added = {k: v for k, v in defaults.items() if k not in event.kwargs}
        events.append(dataclasses.replace(event, kwargs={**event.kwargs, **added},
                                          run_wide=tuple(added)) if added else event)
    events.sort(key=lambda e: e.step)
    for a, b in itertools.pairwise(events):
        if a.freeze_end > b.step and b.freeze_end < a.freeze_end:
            raise ConfigError(
                f"--grow-at {a.spec!r}: its freeze_old outlasts the growth at step {b.step}, "
                f"which ends it; freeze for at most {b.step - a.step} steps, or give the growth "
                f"at {b.step} a freeze_old at least as long (it freezes every older token)")
    return events


def _same(a: GrowthEvent, b: GrowthEvent) -> bool:
    """Two events ask for the same growth (their spec text may differ: spaces, key order)."""
    return (a.step, sorted(a.kwargs.items()), a.lr, a.lr_ramp) == (
        b.step, sorted(b.kwargs.items()), b.lr, b.lr_ramp)


def _plan_text(events: Sequence[GrowthEvent]) -> str:
    return " ".join(repr(e.spec) for e in events) or "no growth"


def check_resumed_plan(recorded: Sequence[GrowthEvent], given: Sequence[GrowthEvent],
                       step: int, run: str, checkpoint: str) -> None:
    """A run resumed at ``step`` (steps done) keeps the growth plan it recorded (its saved
    config): the growths before ``step`` happened and cannot be replayed differently, and the
    later ones are part of the run the checkpoint continues (its schedule too). Any
    difference is one ConfigError naming --grow-at and the first step where they differ
    (docs/reliability.md, "Growth and resume")."""
    steps = sorted({e.step for e in (*recorded, *given)})
    for at in steps:
        old = [e for e in recorded if e.step == at]
        new = [e for e in given if e.step == at]
        if len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new, strict=True)):
            continue
        was = old[0].spec if old else "no growth"
        now = new[0].spec if new else "no growth"
        if at < step:
            raise ConfigError(
                f"--grow-at: {run} resumes after step {step}, and at step {at} it grew by "
                f"{was!r}, not {now!r}: a resumed run keeps the growth it recorded; give "
                f"--grow-at as the run has it ({_plan_text(recorded)}) or not at all")
        raise ConfigError(
            f"--grow-at: {run} resumes after step {step} with the growth {was!r} planned at step "
            f"{at}, not {now!r}: a resumed run keeps its recorded plan ({_plan_text(recorded)}); "
            f"to grow differently, start a new run with --init-from {checkpoint}")


def check_history(events: Sequence[GrowthEvent], applied: object, step: int,
                  where: str) -> None:
    """The growths a checkpoint of ``step`` records as applied (its trainer state's ``growth``:
    the specs before ``step``; checkpoints of earlier versions also listed the one at ``step``)
    are the ``events`` before ``step``: else the model would grow twice, or miss a growth."""
    if applied is None:
        return  # a checkpoint of an earlier version that did not record it
    if not (isinstance(applied, list) and all(isinstance(a, str) for a in applied)):
        raise CheckpointError(f"{where}: growth is {applied!r}, expected a list of --grow-at "
                              f"specs")
    try:
        done = [parse_grow_at(spec, recorded=True) for spec in applied]
    except ConfigError:
        raise CheckpointError(f"{where}: growth holds a malformed spec ({applied!r})") from None

    def same(planned: list[GrowthEvent]) -> bool:  # the specs as given: no run-wide defaults
        return len(planned) == len(done) and all(
            _same(e.as_given(), d) for e, d in zip(planned, done, strict=True))

    if not (same([e for e in events if e.step < step])
            or same([e for e in events if e.step <= step])):
        planned = _plan_text([e for e in events if e.step < step])
        raise ConfigError(f"--grow-at: the checkpoint of step {step} ({where}) grew by "
                          f"{', '.join(map(repr, applied)) or 'no growth'}, but the run's plan "
                          f"before step {step} is {planned}: a resumed run keeps the growth it "
                          f"recorded")


def check_growth_plan(config: Any, events: Sequence[GrowthEvent]) -> None:
    """Apply every growth to the model config in order, before the first step: a shrink, an
    unknown recipe, an impossible multiple, old-token options on a growth that keeps no
    tokens, or a model too large for memory fails now, not after the steps before it."""
    for event in events:
        if not _old_token_options(event):
            continue
        if not hasattr(config, "qkv_tokens"):
            raise ConfigError(f"--grow-at {event.spec!r}: freeze_old and noise_old act on "
                              f"parameter tokens; a {getattr(config, 'arch', 'baseline')} model "
                              f"has none")
    if not events or not (hasattr(config, "qkv_tokens")
                          or getattr(config, "fused_projections", False)):  # plan refuses it
        return
    for event in events:
        try:  # the old-token options change no config: checked here and by grow
            grown = plan_growth(config, **event.kwargs)
            check_memory(grown, 4, "the grown model")  # weights, gradients, two moments
        except TokenFormerError as exc:
            raise ConfigError(f"--grow-at {event.spec!r} (step {event.step}, applied to the "
                              f"model of the growths before it): {exc}") from None
        if _old_token_options(event) and event.kwargs.get("how") == "stack":
            raise ConfigError(f"--grow-at {event.spec!r}: freeze_old and noise_old act on the "
                              f"tokens a growth of tokens or identity blocks keeps, not on a "
                              f"stacked copy (how=stack)")
        if _old_token_options(event) and grown.hidden_size != config.hidden_size:
            raise ConfigError(f"--grow-at {event.spec!r}: freeze_old and noise_old act on the "
                              f"tokens a growth keeps; changing the hidden size changes every "
                              f"token's width, so none is kept")
        config = grown


def _old_token_options(event: GrowthEvent) -> bool:
    return (freeze_request(event.kwargs.get("freeze_old")) is not None
            or bool(event.kwargs.get("noise_old")))
