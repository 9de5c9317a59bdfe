"""v5's reuse family as runs (issue 46; docs/frontier-v5.md): pure data, nothing is trained.

**Levels.** The base (``Reuse.base``, a TokenFormer size) is finished at each k of
``Reuse.tokens_per_parameter``: its compute there, C(k) = k · its non-embedding parameters ·
its training FLOPs per token, is a budget of the preset's grid (:func:`levels` checks it, to
2 %), so the base is the family's from-scratch size at those budgets, cooled there like every
size (its runs save each cooled branch's weights: the finished bases). **Cells**: an increment
X is a whole number m of grid steps below 1, so the cell (k at budget j, X) gives the
continuation budget j − m (incremental FLOPs, counted from the continuation's first step); a
cell is run when every continuing arm trains >= ``min_steps`` steps there (:func:`cells`).

**Runs.** One continuation run per (arm, k, LR, seed), with a cooldown branch at each X cell of
k: it loads the base's cooled weights at k (``Run.origin``, filled in by the runner once the
base's run is known), grows them by its arm's operator when it has one, starts a fresh AdamW and
the WSD schedule (warmup, stable, cooldown branches), and trains on the data stream after the
base's last step (``Run.data_offset``). Transformer++'s base (R4) is a run of its own (kind
"base"): its size of the width grid trained to the same k (k · its parameters tokens, so its
branches are at its own FLOPs), cooled at each k. Tuning runs (``tune/<arm>@k…/x<f>/seed…``)
carry the factor in ``lr``; held-out runs the LR chosen per X cell, one run per distinct LR.
"""

from __future__ import annotations

import dataclasses
import math

from ...errors import ConfigError
from .arms import CONTINUING_ARMS
from .chains import read_branches
from .configs import model_configs, sized_stage
from .presets import Preset, increment_steps, size_key
from .questions import continuing_arm
from .schedule import Run, Stage, branch_for

TF = "tokenformer"


def base_stage(preset: Preset, family: str, vocab_size: int) -> Stage:
    """The reuse family's base of ``family`` (its size ``Reuse.base``), from step 0."""
    assert preset.reuse is not None
    size = preset.reuse.base
    return sized_stage(preset, size, model_configs(preset, family, vocab_size)[size], 0)


def continuation_stage(preset: Preset, arm: str, vocab_size: int) -> Stage:
    """The size a continuing arm trains: the final size when it grows, else the base's."""
    assert preset.reuse is not None
    spec = CONTINUING_ARMS[arm]
    size = preset.reuse.final if spec.grows else preset.reuse.base
    return sized_stage(preset, size, model_configs(preset, spec.family, vocab_size)[size], 0)


def per_parameter(stage: Stage, preset: Preset) -> float:
    """Training FLOPs per token × non-embedding parameters: C(k) / k of a base of this stage."""
    return (stage.flops_per_step / preset.tokens_per_step
            * stage.config.num_parameters(non_embedding=True))


def levels(preset: Preset, vocab_size: int) -> dict[int, float]:
    """Budget index → the registered k whose base compute C(k) is that budget (within 2 %;
    one ConfigError line otherwise)."""
    assert preset.reuse is not None
    unit = per_parameter(base_stage(preset, TF, vocab_size), preset)
    out: dict[int, float] = {}
    for k in preset.reuse.tokens_per_parameter:
        j = min(range(len(preset.budgets)), key=lambda i: abs(math.log(
            preset.budgets[i] / (k * unit))))
        if abs(preset.budgets[j] / (k * unit) - 1) > 0.02:
            raise ConfigError(f"frontier: reuse: k = {k:g} puts the base's compute at "
                              f"{k * unit:.3g} FLOPs, no budget of the grid (nearest "
                              f"{preset.budgets[j]:.3g}); set max_budget to k · {unit:.6g}")
        out[j] = k
    return out


def base_budgets(preset: Preset, family: str, vocab_size: int) -> list[float]:
    """Per budget index, the compute of ``family``'s base there: the grid's budget for
    TokenFormer (the base is its size at those budgets); for another family, k_j × its own
    parameters × its FLOPs per token at each level j (trained equally: the same k), the grid's
    budget elsewhere (unused)."""
    if family == TF:
        return list(preset.budgets)
    unit = per_parameter(base_stage(preset, family, vocab_size), preset)
    ks = levels(preset, vocab_size)
    return [ks[j] * unit if j in ks else b for j, b in enumerate(preset.budgets)]


def cells(preset: Preset, vocab_size: int) -> dict[int, tuple[int, ...]]:
    """Per level (the base's budget index j), the budget indices j − m of its X cells that every
    continuing arm trains >= ``min_steps`` steps at (module docstring)."""
    assert preset.reuse is not None
    stages = [continuation_stage(preset, a, vocab_size) for a in preset.reuse.arms]
    out = {}
    for j in levels(preset, vocab_size):
        ids = sorted(j - m for m in (increment_steps(preset, x) for x in preset.reuse.increments)
                     if j - m >= 0)
        out[j] = tuple(i for i in ids if all(
            branch_for((s,), i, preset.budgets[i], preset) is not None for s in stages))
    return out


def forced_windows(preset: Preset, vocab_size: int) -> dict[str, set[int]]:
    """The budgets the reuse family needs of TokenFormer's from-scratch sizes, window or not:
    the base at every level (the finished bases), the final size at every cell (R1)."""
    if preset.reuse is None:
        return {}
    read = {i for ids in cells(preset, vocab_size).values() for i in ids}
    return {preset.reuse.base: set(levels(preset, vocab_size)), preset.reuse.final: read}


def base_run(preset: Preset, family: str, seed: int, vocab_size: int,
             only: set[int] | None = None,
             lr: float | None = None) -> Run:
    """A base of ``family`` (Transformer++'s, R4; TokenFormer's base is its from-scratch size)
    from scratch for ``seed``: one stable run with a cooldown branch at each level of ``only``
    (default: every level), at its own compute (:func:`base_budgets`)."""
    stage = base_stage(preset, family, vocab_size)
    key = size_key(family, stage.size)
    ks = set(levels(preset, vocab_size))
    branches = read_branches(preset, (stage,), base_budgets(preset, family, vocab_size),
                             ks if only is None else ks & only, key)
    return Run(f"{key}/seed{seed}", key, "base", family, seed, (stage,), branches, lr,
               key)


def base_steps(preset: Preset, family: str, j: int, vocab_size: int) -> int:
    """Steps the base of ``family`` trains to level j (its cooled branch's length): where the
    continuation's data stream starts."""
    stage = base_stage(preset, family, vocab_size)
    branch = branch_for((stage,), j, base_budgets(preset, family, vocab_size)[j], preset)
    assert branch is not None
    return branch.steps


def continuation_run(preset: Preset, arm: str, j: int, seed: int, vocab_size: int, *,
                     lr: float | None = None,
                     only: set[int] | None = None, origin: str | None = None) -> Run:
    """``arm`` continuing the base finished at level j for ``seed`` (module docstring): a
    branch at each X cell of j (those in ``only``, default all)."""
    assert preset.reuse is not None
    spec = CONTINUING_ARMS[arm]
    k = levels(preset, vocab_size)[j]
    name = continuing_arm(arm, k)
    stage = continuation_stage(preset, arm, vocab_size)
    ids = set(cells(preset, vocab_size)[j])
    branches = read_branches(preset, (stage,), list(preset.budgets),
                             ids if only is None else ids & only, name)
    return Run(f"{name}/seed{seed}", name, "reuse", spec.family, seed, (stage,),
               branches, lr, size_key(spec.family, stage.size), spec.grows, origin=origin,
               origin_budget=j, data_offset=base_steps(preset, spec.family, j, vocab_size))


def arm_levels(preset: Preset, vocab_size: int) -> list[tuple[str, int]]:
    """Every (continuing arm, level) with at least one cell."""
    assert preset.reuse is not None
    read = cells(preset, vocab_size)
    return [(arm, j) for arm in preset.reuse.arms for j in sorted(read) if read[j]]


def tuned(preset: Preset) -> bool:
    """Whether the continuations' LRs are tuned on the tuning seeds: with one horizon factor
    and no extension past it (quick) the pick is that factor whatever the losses, so no tuning
    continuation runs (:func:`tuning_runs` is empty)."""
    return len(preset.horizon_factors) > 1


def tuning_id(arm: str, factor: float, seed: int) -> str:
    """The id of ``arm``'s tuning continuation at ``factor`` for ``seed`` (plan and runner)."""
    return f"tune/{arm}/x{factor:g}/seed{seed}"


def tuning_runs(preset: Preset, vocab_size: int, seeds: list[int]) -> list[Run]:
    """Every continuing arm at every level on the tuning ``seeds`` at each of the preset's
    horizon factors (``lr`` holds the factor; the runner multiplies it by the sweep's pick of
    the arm's size; the runs added past an edge are the runner's)."""
    if not tuned(preset):
        return []
    runs = []
    for arm, j in arm_levels(preset, vocab_size):
        for factor in preset.horizon_factors:
            for seed in seeds:
                run = continuation_run(preset, arm, j, seed, vocab_size, lr=factor)
                runs.append(dataclasses.replace(run, id=tuning_id(run.arm, factor, seed)))
    return runs


def held_out_runs(preset: Preset, vocab_size: int, seeds: list[int],
                  chosen: dict[tuple[str, int], dict[int, float]] | None = None) -> list[Run]:
    """Every continuing arm at every level on the held-out ``seeds``: one run per distinct LR
    chosen for its X cells (``chosen[(arm, level)]``: cell budget → LR; None: one run, LR not
    known yet, for the plan). The id names the LR only when a level has more than one."""
    runs = []
    for seed in seeds:
        for arm, j in arm_levels(preset, vocab_size):
            by_lr: dict[float | None, set[int]] = {}
            for i, lr in sorted(((chosen or {}).get((arm, j)) or {
                    i: None for i in cells(preset, vocab_size)[j]}).items()):
                by_lr.setdefault(lr, set()).add(i)
            for lr, ids in by_lr.items():
                run = continuation_run(preset, arm, j, seed, vocab_size, lr=lr, only=ids)
                if len(by_lr) > 1:
                    run = dataclasses.replace(run, id=f"{run.arm}/lr={lr:.6g}/seed{seed}")
                runs.append(run)
    return runs


def other_bases(preset: Preset) -> list[str]:
    """The families whose base is a run of its own (not a TokenFormer from-scratch size)."""
    if preset.reuse is None:
        return []
    return sorted({CONTINUING_ARMS[a].family for a in preset.reuse.arms} - {TF})


def sweep_sizes(preset: Preset) -> list[tuple[str, str]]:
    """The (family, size) LR sweeps the reuse family needs beyond TokenFormer's window: each
    other family's base and the size its arm continues at."""
    if preset.reuse is None:
        return []
    out = []
    for arm in preset.reuse.arms:
        spec = CONTINUING_ARMS[arm]
        if spec.family != TF:
            for size in dict.fromkeys((preset.reuse.base, preset.reuse.final if spec.grows
                                       else preset.reuse.base)):
                out.append((spec.family, size))
    return list(dict.fromkeys(out))


def keeps_models(preset: Preset, run: Run) -> bool:
    """Whether ``run`` is a base: its cooled branches' weights are saved for the continuations
    (TokenFormer's base size from scratch, on any seed; another family's base run)."""
    if preset.reuse is None or run.kind in ("sweep", "reuse", "chain", "widen"):
        return False
    return run.stages[0].size == preset.reuse.base and len(run.stages) == 1 and (
        run.family == TF or run.family in other_bases(preset))
