"""The frontier experiment's plan: presets → the list of runs (pure data, nothing is trained).

Presets (:mod:`.presets`), growing arms (:mod:`.recipes`), questions (:mod:`.questions`) and a
run's stages, branches and LR schedule (:mod:`.schedule`) live beside this module; here they
become the list of runs.

**Chains follow the envelope** (issue 25; :func:`follow_envelope`). The *envelope* of a family
at a budget is its from-scratch size with the lowest mean validation loss over seeds there
(``report.envelope``). The runner trains every from-scratch run first, reads the measured
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
import math
from typing import Any

from ...errors import ConfigError
from ...models.baselines import TransformerConfig, matched_config
from ...models.config import TokenFormerConfig, flops_per_token
from ..common.report import markdown_table
from .presets import (
    MAX_EPOCHS,
    PK_FLOPS_TOLERANCE,
    PRODUCT_KEY_FAMILIES,
    SCHEDULE_FAMILY,
    SWEEP_SEED,
    THETA_FAMILIES,
    Preset,
    family_sizes,
    size_key,
    tpp_shape,
)
from .questions import question_lines
from .recipes import RECIPES, Recipe
from .schedule import Branch, Run, Stage, branch_for, decay_start, size_at, stage_lr_key


def arch(family: str) -> str:
    """The model architecture (``baselines.model_class`` / the trainer's ``arch``) of a family:
    a product-key family is a TokenFormer."""
    return "transformer++" if family == "transformer++" else "tokenformer"


def product_key_config(dense: TokenFormerConfig, ratio: int, name: str | None = None
                       ) -> TokenFormerConfig:
    """``dense`` with its FFN Pattention replaced by product keys over n = s² ≈ ``ratio`` × its
    FFN tokens (s = the nearest integer to √(ratio·n)) and the top-k whose analytic FFN FLOPs per
    token are closest to the dense FFN's (``config.projection_flops``: sub-key scores 2·s·d,
    min(k, s)² candidate sums, Θ over k, k value rows 2·k·d). Everything else is ``dense``'s, so
    the whole model's FLOPs per token match too."""
    target = dense.projection_flops()[1]
    s = round(math.sqrt(ratio * dense.ffn_tokens))
    base = dataclasses.replace(dense, ffn_keys="product", ffn_tokens=s * s, ffn_scale=None,
                               name=name or f"{dense.name}-pk{ratio}")

    def ffn(k: int) -> float:
        return dataclasses.replace(base, ffn_product_k=k).projection_flops()[1]

    lo, hi = 1, s * s  # ffn(k) increases with k: the smallest k with ffn(k) >= target
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if ffn(mid) < target else (lo, mid)
    k = min((lo, max(lo - 1, 1)), key=lambda c: (abs(ffn(c) - target), c))
    if abs(ffn(k) / target - 1) > PK_FLOPS_TOLERANCE:
        raise ConfigError(f"frontier: no top-k of {s * s} product keys matches the dense FFN's "
                          f"{target:.0f} FLOPs/token within {PK_FLOPS_TOLERANCE:.0%}")
    return dataclasses.replace(base, ffn_product_k=k)


def size_tokens(preset: Preset, size: str) -> tuple[int, int, int]:
    """(qkv, proj, ffn) tokens of ``size``: ``base_tokens`` × factor^(k−1) for Sk (S0: ÷ factor)."""
    k = int(size[1:])
    if k < 1:
        return tuple(n // preset.factor ** (1 - k)  # type: ignore[return-value]
                     for n in preset.base_tokens)
    return tuple(n * preset.factor ** (k - 1) for n in preset.base_tokens)  # type: ignore


def model_configs(preset: Preset, family: str, vocab_size: int) -> dict[str, Any]:
    """Every size of ``family`` (:func:`family_sizes`), by name: TokenFormers with ``factor``×
    the tokens per size (``norm`` of :data:`THETA_FAMILIES` for those families), the
    Transformer++ matched to each in non-embedding parameters (MLP width), and the product-key
    TokenFormers matched to each in FLOPs per token (:func:`product_key_config`)."""
    out: dict[str, Any] = {}
    for name in family_sizes(preset, family):
        q, p, f = size_tokens(preset, name)
        tf = TokenFormerConfig(vocab_size=vocab_size, hidden_size=preset.hidden_size,
                               num_layers=preset.num_layers, num_heads=preset.num_heads,
                               qkv_tokens=q, proj_tokens=p, ffn_tokens=f,
                               max_seq_len=preset.seq_len, eos_token_id=None,
                               norm=THETA_FAMILIES.get(family, "l2_norm_gelu"),
                               name=f"{family}-{name}" if family in THETA_FAMILIES
                               else f"tokenformer-{name}")
        if family in PRODUCT_KEY_FAMILIES:
            out[name] = product_key_config(tf, PRODUCT_KEY_FAMILIES[family], f"{family}-{name}")
        elif family == "transformer++" and preset.tpp_widths is not None:
            d, heads, mlp = tpp_shape(preset, name)
            out[name] = TransformerConfig(
                arch=family, vocab_size=vocab_size, hidden_size=d, num_layers=preset.num_layers,
                num_heads=heads, intermediate_size=mlp, max_seq_len=preset.seq_len,
                eos_token_id=None, name=f"{family}-{name}")
            out[name].validate()
        elif family == "transformer++":
            out[name] = matched_config(tf, family, name=f"{family}-{name}")
        else:
            out[name] = tf
    return out


def _stage(preset: Preset, size: str, config: Any, start: int) -> Stage:
    per_token = flops_per_token(config, preset.seq_len, training=True)["total"]
    return Stage(size, config, start, per_token * preset.tokens_per_step)


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
    stage = _stage(preset, size, config, 0)
    n = preset.sweep_steps
    branch = Branch(0, n * stage.flops_per_step, n, decay_start(n, preset),
                    n * stage.flops_per_step)
    key = size_key(family, size)
    return Run(f"sweep/{key}/lr={lr:.6g}/seed{seed}", f"sweep-{key}", "sweep", family, seed,
               (stage,), (branch,), lr, key)


# ------------------------------------------------------------------ chains follow the envelope
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
            b = branch_for((_stage(preset, size, config, 0),), j, budget, preset)
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
    stages = [_stage(preset, targets[js[0]], configs[targets[js[0]]], 0)]
    for prev, j in itertools.pairwise(js):
        size = targets[j]
        if size == stages[-1].size:
            continue

        def with_growth(step: int, size: str = size) -> tuple[Stage, ...]:
            return (*stages, _stage(preset, size, configs[size], step))

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
        stages.append(_stage(preset, size, configs[size], step))
    return tuple(stages)


def reshaped_chain(preset: Preset, recipe: Recipe, configs: dict[str, Any], best: Envelope,
                   sized: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """A stack or clone chain (``recipe.shape``): it ends where the size-walking chain ``sized``
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
    if recipe.shape == "stack":
        if c.num_layers % 2:
            raise ConfigError(f"frontier: {recipe.arm} stacks half the blocks: num_layers "
                              f"must be even")
        small, name = dataclasses.replace(c, num_layers=c.num_layers // 2), "half-depth"
    else:
        if c.hidden_size % 2 or c.num_heads % 2:
            raise ConfigError(f"frontier: {recipe.arm} duplicates half the width: hidden size "
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
        check_epochs(preset, runs, train_tokens)
    return runs


def check_epochs(preset: Preset, runs: list[Run], train_tokens: int) -> None:
    """Refuse a run that would read the training split more than ``MAX_EPOCHS`` times."""
    for run in runs:
        epochs = run.total_steps * preset.tokens_per_step / train_tokens
        if epochs > MAX_EPOCHS:
            raise ConfigError(f"frontier: {run.id} would see the training split "
                              f"{epochs:.1f} times (> {MAX_EPOCHS:g}); lower max_budget or "
                              f"use a larger corpus (--data)")


def chain_stages(preset: Preset, vocab_size: int, envelopes: dict[str, Envelope] | None = None
                 ) -> dict[str, tuple[Stage, ...]]:
    """Each growing arm's stages on ``envelopes`` (else the predicted ones); arms that never
    grow are left out."""
    configs = {f: model_configs(preset, f, vocab_size) for f in preset.families}
    chains = {}
    for arm in preset.recipes:
        recipe = RECIPES[arm]
        best = (envelopes or {}).get(recipe.family) or predicted_envelope(
            preset, recipe.family, vocab_size)
        stages = follow_envelope(preset, configs[recipe.family], best)
        if recipe.shape != "size":
            stages = reshaped_chain(preset, recipe, configs[recipe.family], best, stages)
        if len(stages) > 1:
            chains[arm] = stages
    return chains


def chain_run(preset: Preset, arm: str, stages: tuple[Stage, ...], seed: int) -> Run:
    recipe = RECIPES[arm]
    return dataclasses.replace(
        _with_branches(preset, arm, recipe.kind, recipe.family, seed, stages, preset.budgets,
                       size_key(recipe.family, stages[-1].size), arm),
        lr_policy=recipe.lr_policy)


# ------------------------------------------------------------------ v4: tuning vs held-out
def size_windows(preset: Preset, family: str, vocab_size: int) -> dict[str, set[int]] | None:
    """Per size, the budget indices it runs under ``size_window`` (within that many sizes of
    the predicted optimum there); None: no window, every budget of >= min_steps steps."""
    if preset.size_window is None:
        return None
    order = list(family_sizes(preset, family))
    best = predicted_envelope(preset, family, vocab_size)
    return {z: {j for j, b in best.items()
                if abs(order.index(z) - order.index(b)) <= preset.size_window} for z in order}


def scratch_run(preset: Preset, family: str, size: str, config: Any, seed: int,
                only: set[int] | None) -> Run:
    """``family``'s ``size`` from scratch for ``seed``: one stable run with the cooldown branches
    of the budgets in ``only`` (None: every budget of >= min_steps steps)."""
    key = size_key(family, size)
    return _with_branches(preset, key, "scratch", family, seed,
                          (_stage(preset, size, config, 0),), preset.budgets, key, only=only)


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
    (per size key; 1.0 when not known yet, for the plan) × each of ``horizon_factors``."""
    runs = []
    for family in preset.families:
        for seed in tuning_seeds(preset):
            for run in scratch_runs(preset, vocab_size, family, seed):
                for factor in preset.horizon_factors:
                    lr = (lr0 or {}).get(run.arm, 1.0) * factor
                    runs.append(dataclasses.replace(
                        run, id=f"horizon/{run.arm}/x{factor:g}/seed{seed}", kind="horizon",
                        lr=lr))
    return runs


Choice = dict[str, dict[int, tuple[str, float | None]]]  # family → budget → (size, LR)


def held_out_scratch(preset: Preset, vocab_size: int, choice: Choice) -> list[Run]:
    """v4 stage 3: the envelope's (size, LR) of each family at each budget (chosen on the
    tuning seeds) on every held-out seed: one stable run per (size, LR) with the cooldown
    branches of the budgets that chose it. The run id names the LR only when a size has more
    than one."""
    configs = {f: model_configs(preset, f, vocab_size) for f in preset.families}
    runs = []
    for seed in held_out_seeds(preset):
        for family in preset.families:
            by_pair: dict[tuple[str, float | None], set[int]] = {}
            for j, pair in sorted(choice.get(family, {}).items()):
                by_pair.setdefault(pair, set()).add(j)
            for (size, lr), budgets in by_pair.items():
                several = sum(z == size for z, _ in by_pair) > 1
                run = scratch_run(preset, family, size, configs[family][size], seed, budgets)
                runs.append(dataclasses.replace(
                    run, lr=lr, id=f"{run.arm}/lr={lr:.6g}/seed{seed}" if several else run.id))
    return runs


def chain_tuning_plan(preset: Preset, chains: list[Run]) -> list[Run]:
    """v4: each growing arm (its seed-0 held-out run as the template) on every tuning seed at
    each of ``horizon_factors`` × its policy's LRs (the runner multiplies; ``lr`` holds the
    factor here)."""
    return [dataclasses.replace(run, id=f"tune/{run.arm}/x{factor:g}/seed{seed}", seed=seed,
                                lr=factor)
            for run in chains if run.seed == 0
            for factor in preset.horizon_factors for seed in tuning_seeds(preset)]


def stage_plans(preset: Preset, vocab_size: int) -> dict[str, list[Run]]:
    """Every run of the preset by stage, on the predicted envelope (``--plan`` and the time
    estimate): the LR sweep, the horizon runs and the chains' tuning (tuning seeds), then the
    held-out from-scratch and chain runs (held-out seeds). The v3 protocol has no horizon or
    chain tuning stage."""
    runs = plan(preset, vocab_size)
    chains = [r for r in runs if r.kind != "scratch"]
    return {"sweep": sweep_plan(preset, vocab_size),
            "horizon": horizon_plan(preset, vocab_size) if preset.horizon_factors else [],
            "chain tuning": chain_tuning_plan(preset, chains),
            "held-out from scratch": [r for r in runs if r.kind == "scratch"],
            "held-out chains": chains}


def _refuse_edge_of_grid(preset: Preset, vocab_size: int) -> None:
    """A question that reads a family's envelope (directly, or through a chain that follows
    it) at a budget where the family's PREDICTED best size has no size run on one side of it
    there would read the grid's edge, not an optimum: refused in one line before anything
    trains. Budgets read: the largest for "final", every budget of the family for "all" and
    "trend". (The run's measured envelope can still end at an edge: the report flags it.)"""
    for q in preset.questions:
        families = dict.fromkeys(
            t.split(":", 1)[1] if t.startswith("envelope:") else RECIPES[t].family
            for t in q.terms() if t.startswith("envelope:") or t in RECIPES)
        for family in families:
            best = predicted_envelope(preset, family, vocab_size)
            order = list(family_sizes(preset, family))
            windows = size_windows(preset, family, vocab_size)
            js = sorted(best)[-1:] if q.budgets == "final" else sorted(best)
            for j in js:
                runs = [z for z in order if (windows is None or j in windows[z]) and branch_for(
                    (_stage(preset, z, model_configs(preset, family, vocab_size)[z], 0),), j,
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
    branches = tuple(b for i, budget in enumerate(budgets)
                     if (only is None or i in only)
                     and (b := branch_for(stages, i, budget, preset)) is not None
                     and reads_budget(stages, b, preset))
    if not branches:
        raise ConfigError(f"frontier: {arm} has no budget of >= {preset.min_steps} steps")
    if len(stages) > 1 and recipe is not None and RECIPES[recipe].anneal:
        gaps = [b.start - a.start for a, b in itertools.pairwise(stages)]
        if min(gaps) <= preset.anneal_steps:
            raise ConfigError("frontier: anneal_steps must be shorter than every chain stage")
    return Run(f"{arm}/seed{seed}", arm, kind, family, seed, stages, branches, None, lr_from,
               recipe)


def sweep_plan(preset: Preset, vocab_size: int) -> list[Run]:
    """The initial LR grid of every (family, size) the final runs use (a size that runs no
    budget of its window is not swept), for every tuning seed."""
    return [sweep_run(preset, family, size, lr, vocab_size, seed)
            for family in preset.families for size in swept_sizes(preset, family, vocab_size)
            for lr in preset.lr_grid for seed in tuning_seeds(preset)]


def swept_sizes(preset: Preset, family: str, vocab_size: int) -> tuple[str, ...]:
    """The sizes of ``family`` that run at least one budget (of their window)."""
    windows = size_windows(preset, family, vocab_size)
    return tuple(z for z in family_sizes(preset, family) if windows is None or windows[z])


def steps_by_size(run: Run) -> dict[str, int]:
    """Optimizer steps the run trains at each size: its stable phase and every cooldown."""
    out: dict[str, int] = {}
    for i, s in enumerate(run.stages):
        end = run.stages[i + 1].start if i + 1 < len(run.stages) else run.steps
        out[s.size] = out.get(s.size, 0) + max(0, min(end, run.steps) - s.start)
    for b in run.branches:
        size = size_at(run.stages, max(b.decay_start - 1, 0)).size
        out[size] = out.get(size, 0) + b.steps - b.decay_start
    return out


def estimate_seconds(preset: Preset, runs: list[Run], seconds_per_step: dict[str, float]
                     ) -> float:
    """Training time of ``runs`` from measured seconds per step of each ``"<family>-<size>"``,
    plus one evaluation per branch (``eval_batches`` forward passes ≈ a third of a step each).
    Evaluation FLOPs aside, the runner does nothing else of weight."""
    total = 0.0
    for run in runs:
        final = run.stages[-1]
        for size, steps in steps_by_size(run).items():
            # a half-depth/half-width stage is no swept size: the final size's, scaled by FLOPs
            stage = next(s for s in run.stages if s.size == size)
            total += steps * seconds_per_step.get(
                size_key(run.family, size), seconds_per_step[size_key(run.family, final.size)]
                * stage.flops_per_step / final.flops_per_step)
        last = final.size
        total += len(run.branches) * preset.eval_batches / 3 * seconds_per_step[
            size_key(run.family, last)]
    return total


def parallel_seconds(preset: Preset, phases: list[list[Run]],
                     seconds_per_step: dict[str, float], jobs: int) -> float:
    """Wall time of ``phases`` (run one after another: the sweeps, the from-scratch runs, the
    chains) when each phase's runs are spread over ``jobs`` workers (``scale --jobs``), longest
    first onto the least busy worker (each run's time: :func:`estimate_seconds`)."""
    total = 0.0
    for runs in phases:
        loads = [0.0] * max(1, jobs)
        for t in sorted((estimate_seconds(preset, [r], seconds_per_step) for r in runs),
                        reverse=True):
            loads[loads.index(min(loads))] += t
        total += max(loads)
    return total


CHAIN_RULE = (
    "Chains follow the envelope: at budget j a chain should be at the smallest of the envelope's "
    "best sizes at budgets j, j+1, …; it starts there (at or below the smallest budget's best "
    "size), grows into each next target right after the previous budget's branch point, earlier "
    "where the new size would get less than {share:.0%} of the next budget's steps, and a budget "
    "is read only when the size cooled down there has trained {share:.0%} of that budget's "
    "steps. It ends at the envelope's best size at its final budget. A stack or clone chain "
    "grows once, at the same step, into the same final size from its half-depth or half-width "
    "copy. Each stage trains at its own size's tuned LR (per-stage), unless the arm is "
    "final-size (the whole chain at its final size's LR).")
LR_RULE = (
    "LR: per family and size, the argmin of the mean final validation loss over {seeds} tuning "
    "seed(s) of {steps}-step WSD runs on a factor-2 grid, picked inside the grid (extended "
    "beyond an edge argmin); non-monotone sweeps and seeds that disagree are flagged.")
HORIZON_RULE = (
    "Horizon (v4): every size then runs at full length (its stable run and every cooldown "
    "branch it reads) on the tuning seeds at ×{factors} of that pick; at each budget the LR "
    "with the lowest tuning mean is that size's LR there, and the (size, LR) with the lowest "
    "tuning mean is the family's envelope there. Held-out seeds run only those (size, LR) pairs "
    "(one stable run per pair, the branches of the budgets that chose it) and score them. Each "
    "growing arm runs at full length on the tuning seeds at ×{factors} of its policy's LRs "
    "(final-size: the final size's LR at its final budget; per-stage: each size's LR at the "
    "last budget it is cooled down at), the factor with the lowest tuning mean at its final "
    "budget is the one its held-out runs use.")


def seed_lines(preset: Preset) -> list[str]:
    """Which seeds choose and which seeds score (``--plan`` and the report)."""
    tuning, held = tuning_seeds(preset), held_out_seeds(preset)
    span = f"{held[0]}–{held[-1]}" if len(held) > 1 else str(held[0])
    if not preset.horizon_factors:
        return [f"Seeds: tuning seeds {', '.join(map(str, tuning))} choose the LRs (the short "
                f"sweeps); seeds {span} run every final run, and the envelope's size is chosen "
                f"on the same seeds it is scored on (the v3 protocol)."]
    return [f"Seeds: **tuning seeds** {', '.join(map(str, tuning))} choose every LR and every "
            f"best size (LR sweeps, horizon runs, chain tuning); **held-out seeds** {span} are "
            f"the only seeds any reported number rests on."]


def describe(preset: Preset, vocab_size: int) -> str:
    """The plan as text (``tokenformer scale --plan``): the pre-registered questions, the seeds
    and the stages (sweep, horizon, held-out) with their run counts and FLOPs, the chain and LR
    rules, every held-out arm's sizes, growth steps, budgets run and FLOPs (on the predicted
    envelope); nothing is trained."""
    stages = stage_plans(preset, vocab_size)
    runs = stages["held-out from scratch"] + stages["held-out chains"]
    rows = []
    for run in runs:
        if run.seed:
            continue
        seeds = sum(r.arm == run.arm and r.stages == run.stages for r in runs)
        rows.append([run.arm, str(seeds), " → ".join(f"{s.size}@{s.start}" for s in run.stages),
                     ", ".join(f"{b.budget:.2g}:{b.steps}" for b in run.branches),
                     f"{run.total_steps:,}", f"{run.total_flops():.3g}",
                     " → ".join(dict.fromkeys(stage_lr_key(run, s) for s in run.stages))])
    total = sum(r.total_flops() for r in runs)
    sweeps = stages["sweep"]
    sweep_flops = sum(r.total_flops() for r in sweeps)
    held = "held-out" if preset.horizon_factors else "final"
    stage_rows = [[name, "tuning" if name in ("sweep", "horizon", "chain tuning") else held,
                   str(len(rs)), f"{sum(r.total_steps for r in rs):,}",
                   f"{sum(r.total_flops() for r in rs):.3g}"]
                  for name, rs in stages.items() if rs]
    families = sorted({RECIPES[a].family for a in preset.recipes})
    envelope_families = preset.families if preset.horizon_factors else families
    predicted = [f"- {f}: " + ", ".join(f"{preset.budgets[j]:.2g} {z}" for j, z in
                                        predicted_envelope(preset, f, vocab_size).items())
                 for f in envelope_families]
    rules = [CHAIN_RULE.format(share=preset.min_stage_share),
             LR_RULE.format(seeds=preset.tuning_seeds, steps=preset.sweep_steps)]
    if preset.horizon_factors:
        rules.append(HORIZON_RULE.format(factors=", ×".join(
            f"{f:g}" for f in preset.horizon_factors)))
    if preset.size_window is not None:
        rules.append(f"A size runs a budget only when it is within {preset.size_window} "
                     f"size(s) of the predicted optimum there.")
    return "\n".join([
        f"preset {preset.name}: {len(sweeps)} LR-sweep runs ({sweep_flops:.3g} FLOPs), "
        f"{len(runs)} {held} runs ({total:.3g} FLOPs), schedule {SCHEDULE_FAMILY} for all", "",
        *seed_lines(preset), "",
        markdown_table(["stage", "seeds", "runs", "steps", "FLOPs"], stage_rows, "llrrr"), "",
        "Pre-registered questions (fixed before anything runs):", "",
        *question_lines(preset.questions), "",
        *rules, "",
        *([f"The envelope PREDICTED from {preset.tokens_per_parameter:g} tokens per "
           f"non-embedding parameter (budget: best size)"
           + ("; the run replaces it by the measured envelope before any chain or held-out run "
              "trains:" if preset.follow == "measured" else " (this preset keeps it):"),
           *predicted, ""] if predicted else []),
        f"{held.capitalize()} runs (chains and held-out sizes on the predicted envelope):", "",
        markdown_table(["arm", "seeds", "sizes@start step", "budget:steps", "steps/seed",
                        "FLOPs/seed", "LR from (per stage)"], rows, "lrllrrl"),
        "time: python benchmarks/frontier_steps.py --preset NAME --cpu-time (measures the step "
        "times here and estimates the whole preset)"])
