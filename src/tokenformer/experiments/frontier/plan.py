"""The frontier experiment's plan: presets → the list of runs (pure data, nothing is trained).

Presets (:mod:`.presets`), growing arms (:mod:`.arms`), questions (:mod:`.questions`), a
run's stages, branches and LR schedule (:mod:`.schedule`), a family's model configs
(:mod:`.configs`) and the chains' stages on the envelope (:mod:`.chains`) live beside this
module; here they become the list of runs, with the refusals made before anything trains. Time
estimates are :mod:`.estimates`'s, the plan in words (``--plan``) :mod:`.plan_text`'s.

**LR rule** (issue 25): per (family, size), a grid of peak LRs, each run for ``sweep_steps`` steps
(same WSD family, one branch at the end) with ``tuning_seeds`` seeds (tuning seeds
``SWEEP_SEED`` + i, not the final runs' seeds); the final runs of that size use the argmin of the
**mean over sweep seeds**, picked inside the grid (the runner extends the grid by one factor
beyond an edge argmin, at most ``max_extensions`` times per side). Every verdict-bearing preset
has ≥ 2 sweep seeds; the report flags a sweep whose mean curve is not unimodal (non-monotone on a
side of its minimum) or whose seeds pick different LRs. A chain trains each stage at its own size's
chosen LR (``lr_policy`` "per-stage": the peak moves at once at the growth step; a half-depth or
half-width first stage takes the LR of the swept size nearest in non-embedding parameters), or
the whole run at its final size's LR ("final-size", v2's policy: the compared factor).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from ...errors import ConfigError
from . import reuse as reuse_
from .arms import GROWING_ARMS
from .chains import Envelope, chain_stages, predicted_envelope, read_branches
from .configs import model_configs, sized_stage
from .presets import MAX_EPOCHS, SWEEP_SEED, Preset, family_sizes, size_key
from .schedule import Branch, Run, Stage, branch_for, decay_start


def tuning_seeds(preset: Preset) -> list[int]:
    """The tuning seeds (module docstring: never a held-out seed): every LR-sweep point and
    every horizon run runs them."""
    return [SWEEP_SEED + i for i in range(preset.tuning_seeds)]


def held_out_seeds(preset: Preset) -> list[int]:
    """The held-out seeds, 0 … seeds − 1: the only ones any reported number rests on."""
    return list(range(preset.seeds))


def sweep_run(preset: Preset, family: str, size: str, lr: float, vocab_size: int,
              seed: int = SWEEP_SEED) -> Run:
    """One LR sweep point: ``sweep_steps`` WSD steps at peak ``lr``, one seed, one branch."""
    config = model_configs(preset, family, vocab_size)[size]
    stage = sized_stage(preset, size, config, 0)
    n = preset.sweep_steps
    branch = Branch(0, n * stage.flops_per_step, n, decay_start(n, preset),
                    n * stage.flops_per_step)
    key = size_key(family, size)
    return Run(f"sweep/{key}/lr={lr:.6g}/seed{seed}", f"sweep-{key}", "sweep", family, seed,
               (stage,), (branch,), lr, key)


def plan(preset: Preset, vocab_size: int, train_tokens: int | None = None,
         envelopes: dict[str, Envelope] | None = None, kinds: tuple[str, ...] | None = None
         ) -> list[Run]:
    """Every final (held-out) run (from-scratch sizes, then the chains) for every seed,
    seed-major within each. Chains follow ``envelopes[family]`` (the measured envelope; the
    runner passes it once the from-scratch runs are done) or, without it,
    :func:`predicted_envelope`; a chain whose target never changes is left out. ``kinds`` keeps
    only runs of those kinds. Sweep runs are :func:`sweep_plan`'s; v4's horizon runs
    :func:`horizon_plan`'s. With ``horizon_factors`` (v4) the from-scratch held-out runs are
    the envelope's (size, LR) at each budget only (:func:`held_out_scratch`; here on the
    predicted envelope), else every size at every budget of its window. ``train_tokens``
    checks that no run repeats the corpus more than ``MAX_EPOCHS`` times."""
    preset.validate()
    runs: list[Run] = []
    chains = chain_stages(preset, vocab_size, envelopes)
    if envelopes is None:
        _refuse_unplanned_questions(preset, set(chains))
        _refuse_edge_of_grid(preset, vocab_size)
    if preset.horizon_factors:
        runs += held_out_scratch(preset, vocab_size, {
            f: {j: (z, None) for j, z in predicted_envelope(preset, f, vocab_size).items()}
            for f in preset.families})
    else:
        for seed in held_out_seeds(preset):
            for family in preset.families:
                runs += scratch_runs(preset, vocab_size, family, seed)
    for seed in held_out_seeds(preset):
        for arm, stages in chains.items():
            runs.append(chain_run(preset, arm, stages, seed))
    if kinds is not None:
        runs = [r for r in runs if r.kind in kinds]
    if train_tokens is not None:
        reuse = [] if preset.reuse is None else reuse_.held_out_runs(
            preset, vocab_size, held_out_seeds(preset))
        check_epochs(preset, runs + reuse, train_tokens)
    return runs


def check_epochs(preset: Preset, runs: list[Run], train_tokens: int) -> None:
    """Refuse a run whose model would read the training split more than ``MAX_EPOCHS`` times:
    a continuation counts its base's steps too (it reads on from where its base stopped)."""
    for run in runs:
        epochs = (run.data_offset + run.total_steps) * preset.tokens_per_step / train_tokens
        if epochs > MAX_EPOCHS:
            raise ConfigError(f"frontier: {run.id} would see the training split "
                              f"{epochs:.1f} times (> {MAX_EPOCHS:g}); lower max_budget or "
                              f"use a larger corpus (--data)")


def chain_run(preset: Preset, arm: str, stages: tuple[Stage, ...], seed: int) -> Run:
    growing = GROWING_ARMS[arm]
    return dataclasses.replace(
        _with_branches(preset, arm, growing.kind, growing.family, seed, stages, preset.budgets,
                       size_key(growing.family, stages[-1].size), arm),
        lr_policy=growing.lr_policy)


# ------------------------------------------------------------------ v4: tuning vs held-out
def size_windows(preset: Preset, family: str, vocab_size: int) -> dict[str, set[int]] | None:
    """Per size, the budget indices it runs under ``size_window`` (within that many sizes of
    the predicted optimum there); None: no window, every budget of >= min_steps steps."""
    if preset.size_window is None:
        return None
    order = list(family_sizes(preset, family))
    best = predicted_envelope(preset, family, vocab_size)
    forced = reuse_.forced_windows(preset, vocab_size) if family == reuse_.TF else {}
    return {z: {j for j, b in best.items()
                if abs(order.index(z) - order.index(b)) <= preset.size_window}
            | forced.get(z, set()) for z in order}


def scratch_run(preset: Preset, family: str, size: str, config: Any, seed: int,
                only: set[int] | None) -> Run:
    """``family``'s ``size`` from scratch for ``seed``: one stable run with the cooldown branches
    of the budgets in ``only`` (None: every budget of >= min_steps steps)."""
    key = size_key(family, size)
    return _with_branches(preset, key, "scratch", family, seed,
                          (sized_stage(preset, size, config, 0),), preset.budgets, key, only=only)


def scratch_runs(preset: Preset, vocab_size: int, family: str, seed: int) -> list[Run]:
    """One from-scratch run per size of ``family`` (the budgets of its window) for ``seed``."""
    windows = size_windows(preset, family, vocab_size)
    runs = []
    for size, config in model_configs(preset, family, vocab_size).items():
        only = None if windows is None else windows[size]
        if only is not None and not only:
            continue
        runs.append(scratch_run(preset, family, size, config, seed, only))
    return runs


def horizon_plan(preset: Preset, vocab_size: int, lr0: dict[str, float] | None = None
                 ) -> list[Run]:
    """v4 stage 2: every size of every family at full length (its stable run and every
    cooldown branch of its window) on every tuning seed, at the short sweep's pick ``lr0``
    (per size key; 1.0 when not known yet, for the plan) × each of ``horizon_factors``; v5:
    the other families' reuse bases too (:func:`horizon_templates`)."""
    return [horizon_run(run, factor, lr0)
            for runs in horizon_templates(preset, vocab_size).values() for run in runs
            for factor in preset.horizon_factors]


def horizon_templates(preset: Preset, vocab_size: int) -> dict[str, list[Run]]:
    """Per size key, the from-scratch runs the horizon stage trains at each factor, one per
    tuning seed, v5's other bases (Transformer++'s, R4, at each k) included."""
    out: dict[str, list[Run]] = {}
    for family in preset.families:
        for seed in tuning_seeds(preset):
            for run in scratch_runs(preset, vocab_size, family, seed):
                out.setdefault(run.arm, []).append(run)
    for family in reuse_.other_bases(preset):
        for seed in tuning_seeds(preset):
            run = reuse_.base_run(preset, family, seed, vocab_size)
            out.setdefault(run.arm, []).append(run)
    return out


def horizon_run(run: Run, factor: float, lr0: dict[str, float] | None, suffix: str = "") -> Run:
    """``run`` (a from-scratch run on a tuning seed) as the horizon run at ``factor`` × the
    sweep's pick of its size (1.0 when not known yet); ``suffix`` marks a run of budgets a
    window extension added."""
    return dataclasses.replace(run, id=horizon_id(run.arm, factor, run.seed, suffix),
                               kind="horizon", lr=(lr0 or {}).get(run.arm, 1.0) * factor)


def horizon_id(key: str, factor: float, seed: int, suffix: str = "") -> str:
    """The id of the horizon run of size ``key`` at ``factor`` for ``seed`` (v5: the tuning
    seeds' finished bases are these runs at the factor chosen at each level)."""
    return f"horizon/{key}/x{factor:g}/seed{seed}{suffix}"


Choice = dict[str, dict[int, tuple[str, float | None]]]  # family → budget → (size, LR)


def held_out_scratch(preset: Preset, vocab_size: int, choice: Choice,
                     lr_at: dict[str, dict[int, float]] | None = None) -> list[Run]:
    """v4 stage 3: the envelope's (size, LR) of each family at each budget (chosen on the
    tuning seeds) on every held-out seed: one stable run per (size, LR) with the cooldown
    branches of the budgets that chose it. The run id names the LR only when a size has more
    than one. v5 adds the reuse family's from-scratch runs (:func:`reuse_pairs`: the base at
    each level, the final size at each cell, each at its LR there in ``lr_at``) and the other
    families' bases."""
    configs = {f: model_configs(preset, f, vocab_size) for f in preset.families}
    extra = reuse_pairs(preset, vocab_size, lr_at)
    runs = []
    for seed in held_out_seeds(preset):
        for family in preset.families:
            by_pair: dict[tuple[str, float | None], set[int]] = {}
            for j, pair in sorted([*choice.get(family, {}).items(), *extra.get(family, [])],
                                  key=lambda item: item[0]):
                by_pair.setdefault(pair, set()).add(j)
            for (size, lr), budgets in by_pair.items():
                several = sum(z == size for z, _ in by_pair) > 1
                run = scratch_run(preset, family, size, configs[family][size], seed, budgets)
                runs.append(dataclasses.replace(
                    run, lr=lr, id=f"{run.arm}/lr={lr:.6g}/seed{seed}" if several else run.id))
        for family in reuse_.other_bases(preset):
            key = size_key(family, preset.reuse.base)  # type: ignore[union-attr]
            by_lr: dict[float | None, set[int]] = {}
            for j in reuse_.levels(preset, vocab_size):
                by_lr.setdefault((lr_at or {}).get(key, {}).get(j), set()).add(j)
            for lr, budgets in by_lr.items():
                run = reuse_.base_run(preset, family, seed, vocab_size, only=budgets, lr=lr)
                runs.append(dataclasses.replace(run, id=f"{key}/lr={lr:.6g}/seed{seed}")
                            if len(by_lr) > 1 else run)
    return runs


def reuse_pairs(preset: Preset, vocab_size: int, lr_at: dict[str, dict[int, float]] | None
                ) -> dict[str, list[tuple[int, tuple[str, float | None]]]]:
    """v5: the (budget, (size, LR)) pairs the reuse family needs of TokenFormer's held-out
    from-scratch runs besides the envelope: its base at each level (the finished bases) and its
    final size at each cell (R1), each at the LR the tuning seeds chose for it at that budget
    (None before they have: the plan)."""
    return {reuse_.TF: [(j, (size, (lr_at or {}).get(size_key(reuse_.TF, size), {}).get(j)))
                        for size, js in reuse_.forced_windows(preset, vocab_size).items()
                        for j in sorted(js)]}


@dataclasses.dataclass(frozen=True)
class ChainCandidate:
    """One point of a chain's tuning grid: every stage before the last at ``small`` × its
    policy's LR (None: at ``final``, v4's single factor), the last at ``final`` ×, and every
    growth step at ``growth`` × the envelope rule's step."""

    final: float
    small: float | None = None
    growth: float = 1.0

    def lrs(self, policy: tuple[float, ...]) -> tuple[float, ...]:
        """The stage LRs of this candidate from the policy's (``horizon_stage_lrs``)."""
        small = self.final if self.small is None else self.small
        return tuple(x * (self.final if i == len(policy) - 1 else small)
                     for i, x in enumerate(policy))

    def tag(self) -> str:
        """The candidate in a run id: ``x2`` (v4), ``x2/s1/g0.5`` (v5's grid)."""
        if self.small is None and self.growth == 1.0:
            return f"x{self.final:g}"
        return f"x{self.final:g}/s{(self.small or self.final):g}/g{self.growth:g}"


def chain_grid(preset: Preset) -> list[ChainCandidate]:
    """The chains' tuning grid: v4's ``horizon_factors`` alone (every stage at one factor of
    the policy's LRs), or v5's small-stage × final-stage LR factors at the rule's growth times,
    and every other growth time at the final-stage factor ×1 (trimmed: v4's chain tuning
    found ×1 best by >= 0.015 on both sides; docs/frontier-v5.md)."""
    if not (preset.chain_small_factors or preset.growth_time_factors):
        return [ChainCandidate(f) for f in preset.horizon_factors]
    return [ChainCandidate(f, s, g) for g in preset.growth_time_factors or (1.0,)
            for s in preset.chain_small_factors or (None,) for f in preset.horizon_factors
            if g == 1.0 or f == 1.0]


def candidate_run(preset: Preset, run: Run, candidate: ChainCandidate, seed: int,
                  run_id: str | None = None) -> Run:
    """The chain ``run`` for ``seed`` with its growth steps at ``candidate.growth`` × theirs
    (its branches planned again by the rule: a budget whose size is too fresh is not read)."""
    stages = run.stages
    if candidate.growth != 1.0:
        stages = tuple(s if i == 0 else dataclasses.replace(
            s, start=max(i, round(s.start * candidate.growth))) for i, s in enumerate(stages))
        run = dataclasses.replace(
            _with_branches(preset, run.arm, run.kind, run.family, seed, stages, preset.budgets,
                           run.lr_from, run.recipe), lr_policy=run.lr_policy)
    return dataclasses.replace(run, id=run_id or f"tune/{run.arm}/{candidate.tag()}/seed{seed}",
                               seed=seed, lr=candidate.final)


def chain_tuning_plan(preset: Preset, chains: list[Run]) -> list[Run]:
    """v4: each growing arm (its seed-0 held-out run as the template) on every tuning seed at
    each point of its tuning grid (:func:`chain_grid`; ``lr`` holds the final stage's factor,
    the runner multiplies)."""
    return [candidate_run(preset, run, c, seed) for run in chains if run.seed == 0
            for c in chain_grid(preset) for seed in tuning_seeds(preset)]


def stage_plans(preset: Preset, vocab_size: int) -> dict[str, list[Run]]:
    """Every run of the preset by stage, on the predicted envelope (``--plan`` and the time
    estimate): the LR sweep, the horizon runs and the chains' tuning (tuning seeds), then the
    held-out from-scratch and chain runs (held-out seeds). The v3 protocol has no horizon or
    chain tuning stage."""
    runs = plan(preset, vocab_size)
    chains = [r for r in runs if r.kind in ("chain", "widen")]
    reuse = {"reuse tuning": reuse_.tuning_runs(preset, vocab_size, tuning_seeds(preset)),
             "reuse held-out": reuse_.held_out_runs(preset, vocab_size, held_out_seeds(preset))
             } if preset.reuse is not None else {}
    return {"sweep": sweep_plan(preset, vocab_size),
            "horizon": horizon_plan(preset, vocab_size) if preset.horizon_factors else [],
            "held-out from scratch": [r for r in runs if r.kind in ("scratch", "base")],
            **reuse,
            "chain tuning": chain_tuning_plan(preset, chains),
            "held-out chains": chains}


def _refuse_edge_of_grid(preset: Preset, vocab_size: int) -> None:
    """A question that reads a family's envelope (directly, or through a chain that follows
    it) at a budget where the family's PREDICTED best size has no size run on one side of it
    there would read the grid's edge, not an optimum: refused in one line before anything
    trains. Budgets read: the largest for "final", every budget of the family for "all" and
    "trend". (The run's measured envelope can still end at an edge: the report flags it.)"""
    for q in preset.questions:
        families = dict.fromkeys(
            t.split(":", 1)[1] if t.startswith("envelope:") else GROWING_ARMS[t].family
            for t in q.terms() if t.startswith("envelope:") or t in GROWING_ARMS)
        for family in families:
            best = predicted_envelope(preset, family, vocab_size)
            order = list(family_sizes(preset, family))
            windows = size_windows(preset, family, vocab_size)
            js = sorted(best)[-1:] if q.budgets == "final" else sorted(best)
            for j in js:
                runs = [z for z in order if (windows is None or j in windows[z]) and branch_for(
                    (sized_stage(preset, z, model_configs(preset, family, vocab_size)[z], 0),), j,
                    preset.budgets[j], preset) is not None]
                z = best[j]
                if not (any(order.index(x) < order.index(z) for x in runs)
                        and any(order.index(x) > order.index(z) for x in runs)):
                    raise ConfigError(
                        f"frontier: question {q.id} reads the {family} envelope at "
                        f"{preset.budgets[j]:.3g} FLOPs, where its predicted best size {z} is "
                        f"at the edge of the sizes run there ({', '.join(runs)}); add a size on "
                        f"the other side or change the budgets")


def _refuse_unplanned_questions(preset: Preset, chains: set[str]) -> None:
    """A question whose arm the plan never runs (its chain never grows on the predicted
    envelope) would get no data: refused before anything trains, not reported as 'not read'
    after the run. (On the measured envelope the runner plans again and the report marks what
    was not read.)"""
    for q in preset.questions:
        for term in q.terms():
            if term in preset.recipes and term not in chains:
                raise ConfigError(
                    f"frontier: question {q.id} needs {term}, which preset {preset.name!r} "
                    f"never runs (its chain does not grow on the predicted envelope); drop the "
                    f"question or change the sizes or budgets")


def _with_branches(preset: Preset, arm: str, kind: str, family: str, seed: int,
                   stages: tuple[Stage, ...], budgets: list[float], lr_from: str,
                   recipe: str | None = None, only: set[int] | None = None) -> Run:
    """``only``: the budget indices the run may read (a window, a held-out choice)."""
    branches = read_branches(preset, stages, budgets, only, arm)
    if len(stages) > 1 and recipe is not None and GROWING_ARMS[recipe].anneal:
        gaps = [b.start - a.start for a, b in itertools.pairwise(stages)]
        if min(gaps) <= preset.anneal_steps:
            raise ConfigError("frontier: anneal_steps must be shorter than every chain stage")
    return Run(f"{arm}/seed{seed}", arm, kind, family, seed, stages, branches, None, lr_from,
               recipe)


def sweep_plan(preset: Preset, vocab_size: int) -> list[Run]:
    """The initial LR grid of every (family, size) the final runs use (a size that runs no
    budget of its window is not swept), for every tuning seed."""
    return [sweep_run(preset, family, size, lr, vocab_size, seed)
            for family, size in swept_keys(preset, vocab_size)
            for lr in preset.lr_grid for seed in tuning_seeds(preset)]


def swept_keys(preset: Preset, vocab_size: int) -> list[tuple[str, str]]:
    """Every (family, size) whose LR is swept: each family's sizes that run a budget, and the
    reuse family's other base and its final size (v5)."""
    return [(family, size) for family in preset.families
            for size in swept_sizes(preset, family, vocab_size)] + reuse_.sweep_sizes(preset)


def swept_sizes(preset: Preset, family: str, vocab_size: int) -> tuple[str, ...]:
    """The sizes of ``family`` that run at least one budget (of their window)."""
    windows = size_windows(preset, family, vocab_size)
    return tuple(z for z in family_sizes(preset, family) if windows is None or windows[z])
