"""The chains' stages: how a growing arm follows its family's envelope (pure data, nothing is
trained; the runs around them are :mod:`.plan`'s).

**Chains follow the envelope** (issue 25; :func:`follow_envelope`). The *envelope* of a family
at a budget is its from-scratch size with the lowest mean validation loss over seeds there
(``analysis.envelope``). The runner trains every from-scratch run first, reads the measured
envelope, and only then plans each chain from it by this rule:

1. Target sizes: at budget j the chain should be at t_j = the smallest of the envelope's best
   sizes at budgets j, j+1, …, last (a non-decreasing sequence, so a noisy envelope never asks a
   chain to shrink). The chain therefore starts at t_first, at or below the smallest budget's best
   size, and ends at t_last = the envelope's best size at its final budget.
2. Growth points: the chain grows from t_{j−1} to t_j (one growth, possibly over several sizes)
   right after budget j−1's cooldown branch point, i.e. as soon as the budget grid says the next
   size becomes the envelope's best, while budget j−1 still reads t_{j−1}.
3. Minimum share: a budget is read only when the size the chain cools down there has trained at
   least ``min_stage_share`` (40 %) of that budget's steps (stable steps since its growth plus
   the cooldown). Where rule 2 would give the new size less than that at budget j, the growth
   moves earlier, to the latest step that gives it the share; a budget that then falls short is
   not read for that chain (reported as —).
A chain whose targets never change is no chain (the envelope's best size is the same at every
budget): it is not run. ``tokenformer scale --plan`` shows the chains of a *predicted* envelope
(the size whose tokens per non-embedding parameter is closest, in log, to the preset's
``tokens_per_parameter`` prior: 40, the v2 full run's measured compute-optimal ratio at its
largest budget); the run replaces it by the measured one before any chain trains.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from ...errors import ConfigError
from .arms import GROWING_ARMS, GrowingArm
from .configs import model_configs, sized_stage
from .presets import Preset
from .schedule import Branch, Stage, branch_for, size_at

Envelope = dict[int, str]  # budget index → the family's best from-scratch size there


def predicted_envelope(preset: Preset, family: str, vocab_size: int) -> Envelope:
    """The plan-time guess of ``family``'s envelope (before anything has run): at each budget,
    the size whose training tokens per non-embedding parameter are closest in log to
    ``tokens_per_parameter``, among the sizes that run that budget (>= min_steps)."""
    out: Envelope = {}
    configs = model_configs(preset, family, vocab_size)
    for j, budget in enumerate(preset.budgets):
        ratios = {}
        for size, config in configs.items():
            b = branch_for((sized_stage(preset, size, config, 0),), j, budget, preset)
            if b is not None:
                tokens = b.steps * preset.tokens_per_step
                ratios[size] = abs(math.log(tokens / config.num_parameters(non_embedding=True)
                                            / preset.tokens_per_parameter))
        if ratios:
            out[j] = min(ratios, key=lambda z: (ratios[z], z))
    return out


def chain_targets(best: Envelope, order: tuple[str, ...]) -> dict[int, str]:
    """Rule 1 of the module docstring: at budget j the smallest of the envelope's best sizes
    at budgets j, j+1, … (sizes compared by their place in ``order``)."""
    js = sorted(best)
    return {j: min((best[k] for k in js if k >= j), key=order.index) for j in js}


def follow_envelope(preset: Preset, configs: dict[str, Any], best: Envelope
                    ) -> tuple[Stage, ...]:
    """A chain's stages by the module docstring's rule: start at the first target size, grow
    into each later target right after the previous budget's branch point, earlier where the
    new size would otherwise have less than ``min_stage_share`` of the next budget's steps."""
    order = tuple(configs)
    targets = chain_targets(best, order)
    js = sorted(targets)
    budgets = preset.budgets
    stages = [sized_stage(preset, targets[js[0]], configs[targets[js[0]]], 0)]
    for prev, j in itertools.pairwise(js):
        size = targets[j]
        if size == stages[-1].size:
            continue

        def with_growth(step: int, size: str = size) -> tuple[Stage, ...]:
            return (*stages, sized_stage(preset, size, configs[size], step))

        def has_share(step: int, j: int = j) -> bool:
            b = branch_for(with_growth(step), j, budgets[j], preset)
            return b is not None and b.steps - step >= preset.min_stage_share * b.steps

        before = branch_for(tuple(stages), prev, budgets[prev], preset)
        step = before.decay_start if before is not None else stages[-1].start + 1
        if not has_share(step):  # the latest earlier step that gives the share (monotone)
            lo, hi = stages[-1].start + 1, step - 1
            if lo > hi or not has_share(lo):
                raise ConfigError(f"frontier: {size} cannot get {preset.min_stage_share:.0%} "
                                  f"of budget {budgets[j]:.3g}'s steps in a chain; lower "
                                  f"min_stage_share or space the budgets wider")
            while lo < hi:  # the largest step in [lo, hi] with the share
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if has_share(mid) else (lo, mid - 1)
            step = lo
        stages.append(sized_stage(preset, size, configs[size], step))
    return tuple(stages)


def reshaped_chain(preset: Preset, growing: GrowingArm, configs: dict[str, Any], best: Envelope,
                   sized: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """A stack or clone chain (``growing.shape``): it ends where the size-walking chain ``sized``
    of the same envelope ends (the envelope's best size at the final budget), from that size at
    half depth (blocks stacked, G_stack) or at half hidden size and heads (duplicated,
    HyperCloning), and grows once, by :func:`follow_envelope`'s rule on the two-size envelope
    "the half copy until the budget where the chain's target becomes the final size" (so the
    growth sits at a branch point of its own stages, as for every chain). Its first stage
    takes, under the per-stage policy, the LR of the family's swept size nearest in
    non-embedding parameters (log). One stage when ``sized`` never grows (not run)."""
    if len(sized) < 2:
        return sized[:1]
    final = sized[-1]
    c = final.config
    if growing.shape == "stack":
        if c.num_layers % 2:
            raise ConfigError(f"frontier: {growing.arm} stacks half the blocks: num_layers "
                              f"must be even")
        small, name = dataclasses.replace(c, num_layers=c.num_layers // 2), "half-depth"
    else:
        if c.hidden_size % 2 or c.num_heads % 2:
            raise ConfigError(f"frontier: {growing.arm} duplicates half the width: hidden size "
                              f"and heads must be even")
        small = dataclasses.replace(c, hidden_size=c.hidden_size // 2, num_heads=c.num_heads // 2)
        if preset.tpp_widths is not None:  # v4: every width axis halves (S(k−2) exactly)
            small = dataclasses.replace(small, intermediate_size=c.intermediate_size // 2)
        name = "half-width"
    params = small.num_parameters(non_embedding=True)
    nearest = min(configs, key=lambda z: (abs(math.log(
        configs[z].num_parameters(non_embedding=True) / params)), z))
    same = [z for z, x in configs.items()
            if {**dataclasses.asdict(x), "name": None} == {**dataclasses.asdict(small),
                                                           "name": None}]
    # a half copy that is a from-scratch size of the grid is named (and timed) as that size
    half = same[0] if same else f"{final.size}/{name}"
    targets = chain_targets(best, tuple(configs))
    two = follow_envelope(preset, {half: small, final.size: c},
                          {j: final.size if z == final.size else half
                           for j, z in targets.items()})
    return (dataclasses.replace(two[0], lr_size=nearest), *two[1:])


def reads_budget(stages: tuple[Stage, ...], branch: Branch, preset: Preset) -> bool:
    """Rule 3: the size cooled down at ``branch`` has trained >= min_stage_share of its steps."""
    stage = size_at(stages, max(branch.decay_start - 1, 0))
    return branch.steps - stage.start >= preset.min_stage_share * branch.steps


def read_branches(preset: Preset, stages: tuple[Stage, ...], budgets: list[float],
                  only: set[int] | None, what: str) -> tuple[Branch, ...]:
    """The cooldown branches a run of ``stages`` has at ``budgets`` (those in ``only``, default
    all) that it may read (:func:`reads_budget`); ConfigError, naming ``what``, for none."""
    branches = tuple(b for i, budget in enumerate(budgets) if (only is None or i in only)
                     and (b := branch_for(stages, i, budget, preset)) is not None
                     and reads_budget(stages, b, preset))
    if not branches:
        raise ConfigError(f"frontier: {what} has no budget of >= {preset.min_steps} steps")
    return branches


def chain_stages(preset: Preset, vocab_size: int, envelopes: dict[str, Envelope] | None = None
                 ) -> dict[str, tuple[Stage, ...]]:
    """Each growing arm's stages on ``envelopes`` (else the predicted ones); arms that never
    grow are left out."""
    configs = {f: model_configs(preset, f, vocab_size) for f in preset.families}
    chains = {}
    for arm in preset.recipes:
        growing = GROWING_ARMS[arm]
        best = (envelopes or {}).get(growing.family) or predicted_envelope(
            preset, growing.family, vocab_size)
        stages = follow_envelope(preset, configs[growing.family], best)
        if growing.shape != "size":
            stages = reshaped_chain(preset, growing, configs[growing.family], best, stages)
        if len(stages) > 1:
            chains[arm] = stages
    return chains
