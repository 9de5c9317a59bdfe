"""One run of the frontier: its stable phase in segments with a cooldown branch at each budget
(:func:`train_run`), loaded when finished or trained and saved (:func:`execute`), and runs
trained in parallel worker processes (:func:`prefetch`).

Every segment is trained by :func:`tokenformer.training.fit` with the run's own schedule
(``schedule``: :func:`schedule.run_schedule`, the WSD schedule over the branch's total steps
whose peak is the LR of the stage in force), so no approximation slips in when a run is cut into
segments.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ...errors import DivergedError, TokenFormerError
from ...io.files import atomic_write_text
from ...io.workers import check_parent, worker_pool
from ...ops.growth import grow
from ...ops.growth.optimizer import copy_optimizer
from ...training.config import TrainConfig
from ...training.execution import Execution
from ...training.freezing import FrozenRows
from ...training.growth import growth_generator
from ...training.lm import lm_batches
from ...training.loop import RunState, fit
from ...training.optim import group_names, make_optimizer
from ...training.schedule import LrSchedule
from ..common.report import to_json
from . import schedule as schedule_
from .growing import diagnose_growth, finish_diagnosis, grow_at, grows_tokens, same_size
from .presets import Preset
from .reuse import keeps_models
from .schedule import Branch, Run
from .state import (
    Context,
    anneal_in_force,
    build_model,
    context,
    evaluator,
    load_base,
    load_state,
    lr_record,
    model_path,
    restore_state,
    result_path,
    save_model,
    save_state,
    saved_result,
    state_path,
    train_config,
)


def train_run(ctx: Context, run: Run, lrs: tuple[float, ...]) -> dict[str, Any]:
    """Train ``run`` at the peak LRs ``lrs`` (one per stage, :func:`schedule.stage_lrs`): the
    stable phase in segments, a cooldown branch at each budget. A chain's growth into a stage
    is the ``--grow-at`` event (:func:`.growing.grow_at`) that starts the segment at the stage's
    first step, applied by ``fit`` like any run's. Returns the run's results (branch losses and
    FLOPs) and timing."""
    lr = lr_record(lrs)
    stage_at = {s.start: s for s in run.stages[1:]}
    stops = sorted({b.decay_start for b in run.branches} | set(stage_at))
    state = load_state(ctx, run, lr)
    if state is None:
        model = (continued_base(ctx, run) if run.origin_budget is not None else
                 build_model(run.family, run.stages[0].config, run.seed, ctx.device))
        optimizer = make_optimizer(model, train_config(ctx, run, 1))
        state = {"cursor": 0, "counters": {"tokens": 0, "flops": 0.0}, "branches": [],
                 "anneal": None, "lr": lr, "timing": {"train_time": 0.0, "step_time": {}}}
    else:
        model, optimizer = restore_state(ctx, run, state)
    longest = max(b.steps for b in run.branches)  # the stable phase runs on its schedule
    schedule = schedule_.run_schedule(run, lrs, longest, ctx.preset)
    if run.steps > schedule_.decay_start(longest, ctx.preset):
        raise AssertionError("a stable segment runs into the cooldown")
    bar = _bar(ctx, run)
    if bar is not None:
        bar.update(state["cursor"])
    try:
        for stop in stops:
            if stop <= state["cursor"]:
                continue
            start = state["cursor"]
            # a growth into the stage starting here, unless a state of an earlier version (which
            # saved the model grown) already holds it
            stage = stage_at.get(start)
            growth = (grow_at(run, stage, model.config)
                      if stage is not None and not same_size(model.config, stage.config)
                      else None)
            cfg = train_config(ctx, run, stop, growth)
            result = _segment(ctx, run, schedule, model, optimizer, cfg, start, state, bar)
            model, optimizer = result.model, result.optimizer
            state["counters"]["tokens"] += result.tokens
            state["counters"]["flops"] += result.flops
            # what the last growth left in force, for the branches and the next segment
            state["frozen_rows"] = result.freeze.to_state() if result.freeze is not None else None
            state["anneal"] = result.anneal.to_state() if result.anneal is not None else None
            state["cursor"] = stop
            for branch in run.branches:
                if branch.decay_start == stop:
                    state["branches"].append(_branch(ctx, run, lrs, model, optimizer, branch,
                                                     state))
            state.update(model=model.state_dict(), optimizer=optimizer.state_dict(),
                         param_groups=group_names(model, optimizer),
                         config=dataclasses.asdict(model.config))
            save_state(state_path(ctx, run), state)
    finally:
        if bar is not None:
            bar.close()
    out = {"lr": lr, "branches": sorted(state["branches"], key=lambda b: b["budget_index"]),
           "timing": state["timing"]}
    if state.get("diagnostics"):
        out["growth_diagnostics"] = state["diagnostics"]
    return out


def continued_base(ctx: Context, run: Run) -> Any:
    """v5's reuse family: the finished base ``run`` continues (:func:`.state.load_base`),
    grown into the run's stage by its arm's operator when it has one (the new rows drawn from
    a generator of the run's seed). Its optimizer is a fresh AdamW (the caller's)."""
    model = load_base(ctx, run)
    stage = run.stages[0]
    if run.recipe is not None:
        event = grow_at(run, stage, model.config)
        model = grow(model, generator=growth_generator(run.seed), **event.kwargs).to(ctx.device)
    if not same_size(model.config, stage.config):
        raise AssertionError(f"{run.id}: the base continued is {model.config}, planned "
                             f"{stage.config}")
    return model


def _segment(ctx: Context, run: Run, schedule: LrSchedule, model: Any, optimizer: Any,
             cfg: TrainConfig, start: int, state: dict[str, Any], bar: Any,
             eval_fn: Any = None) -> Any:
    """Train [start, cfg.steps) on the run's ``schedule`` (:func:`schedule.run_schedule`),
    growing first when ``cfg.grow_at`` holds the growth at ``start``."""
    timing = state["timing"]
    batches = lm_batches(ctx.dataset, cfg.batch_size, cfg.seq_len, run.seed, ctx.device)
    # a continuation trains on the seed's stream after its base's last step (v5)
    batch_fn = (batches if not run.data_offset else
                lambda step: batches(step + run.data_offset))

    def on_record(record: dict[str, Any], current: Any) -> None:
        if record["type"] == "grow":
            stage = schedule_.size_at(run.stages, record["step"])
            if not same_size(current.config, stage.config):
                raise AssertionError(f"{run.id}: grown to {current.config}, planned "
                                     f"{stage.config}")
            if grows_tokens(run):
                state["pending"] = diagnose_growth(run, current, record["step"])
            return
        if record["type"] != "train":
            return
        pending = state.get("pending")
        if pending is not None and eval_fn is None and record["step"] == pending["step"] + 1:
            state.setdefault("diagnostics", []).append(finish_diagnosis(current, pending))
            state["pending"] = None
        size = schedule_.size_at(run.stages, record["step"] - 1).size
        # seconds of this step: its tokens over its measured tokens/s
        n, total = timing["step_time"].get(size, (0, 0.0))
        timing["step_time"][size] = (n + 1, total + cfg.batch_size * cfg.seq_len
                                     / record["tokens_per_s"])
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)

    # frozen old tokens (a chain's freeze_old), for the steps of this segment that need it
    frozen = state.get("frozen_rows")  # absent from states written before chains had options
    freeze = FrozenRows.from_state(frozen, str(state_path(ctx, run))) if frozen else None
    in_force = RunState(step=start, optimizer=optimizer,
                        freeze=freeze if freeze is not None and freeze.active(start) else None,
                        anneal=anneal_in_force(ctx, run, state), schedule=schedule)
    result = fit(model, batch_fn, cfg, eval_fn=eval_fn, start=in_force, callbacks=[on_record],
                 progress=False, execution=Execution(device=ctx.device))
    timing["train_time"] += result.train_time
    return result


def _branch(ctx: Context, run: Run, lrs: tuple[float, ...], model: Any, optimizer: Any,
            branch: Branch, state: dict[str, Any]) -> dict[str, Any]:
    """Cool a copy of the stable state down to ``branch.steps``; its final validation loss."""
    schedule = schedule_.run_schedule(run, lrs, branch.steps, ctx.preset)
    b_model = copy.deepcopy(model)
    b_opt = copy_optimizer(model, optimizer, b_model)
    result = _segment(ctx, run, schedule, b_model, b_opt, train_config(ctx, run, branch.steps),
                      branch.decay_start, state, None, eval_fn=evaluator(ctx, run))
    final = result.final_eval
    if final is None:
        raise TokenFormerError(f"{run.id}: the branch at budget {branch.budget_index} has no "
                               f"evaluation")
    if keeps_models(ctx.preset, run):  # a finished base, for the reuse family's continuations
        save_model(model_path(ctx, run.id, branch.budget_index), run.family, result.model)
    flops = state["counters"]["flops"] + result.flops
    return {"budget_index": branch.budget_index, "budget": branch.budget, "steps": branch.steps,
            "decay_start": branch.decay_start, "flops": flops,
            "tokens": state["counters"]["tokens"] + result.tokens,
            "size": schedule_.size_at(run.stages, max(branch.decay_start - 1, 0)).size,
            "loss": final["val_loss"], "bpb": final["val_bpb"]}


def _bar(ctx: Context, run: Run) -> Any:
    if ctx.progress is False or not sys.stderr.isatty():
        return None
    return tqdm(total=run.steps, desc=run.id, unit="step", leave=False)


def execute(ctx: Context, run: Run, lrs: tuple[float, ...]) -> dict[str, Any]:
    """A run's results at peak LRs ``lrs`` (one per stage): loaded when an earlier invocation
    finished it, else trained (resuming from its state file) and saved atomically."""
    if keeps_models(ctx.preset, run):
        ctx.bases[run.id] = (run, lrs)
    saved = saved_result(ctx, run, lrs)
    if saved is not None:
        _count(ctx, run)
        return saved
    ready_bases(ctx, [(run, lrs)])
    t0 = time.perf_counter()
    try:
        result = train_run(ctx, run, lrs)
    except DivergedError as err:  # sweeps probe LRs that may diverge
        result = {"lr": lr_record(lrs), "diverged": str(err), "timing": {"train_time": 0.0,
                                                             "step_time": {}},
                  "branches": [{"budget_index": b.budget_index, "budget": b.budget,
                                "steps": b.steps, "decay_start": b.decay_start,
                                "flops": b.flops, "tokens": b.steps * ctx.preset.tokens_per_step,
                                "size": run.stages[-1].size, "loss": math.inf,
                                "bpb": math.inf} for b in run.branches]}
    result["timing"]["wall"] = time.perf_counter() - t0
    path = result_path(ctx, run)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_parent()
    atomic_write_text(path, to_json(result) if "diverged" not in result else
                      json.dumps(result, allow_nan=True))
    state_path(ctx, run).unlink(missing_ok=True)
    _announce(ctx, run, lrs, result)
    return result


def _count(ctx: Context, run: Run) -> None:
    if run.id not in ctx.counted:
        ctx.counted.add(run.id)
        ctx.done += 1


def _announce(ctx: Context, run: Run, lrs: tuple[float, ...], result: dict[str, Any]) -> None:
    """Count a run just trained (here or in a worker) and print its progress line."""
    _count(ctx, run)
    if ctx.progress is not False:
        last = result["branches"][-1]
        elapsed = time.perf_counter() - ctx.started
        lr = " → ".join(f"{x:.3g}" for x in dict.fromkeys(lrs))
        ctx.print_fn(f"scale: [{ctx.done}/{ctx.total}] {run.id} lr {lr}: loss "
                     f"{last['loss']:.4f} at {last['flops']:.3g} FLOPs, "
                     f"{result['timing']['wall']:.0f} s (elapsed {elapsed / 60:.1f} min)")


def missing_bases(ctx: Context, jobs: list[tuple[Run, tuple[float, ...]]]
                  ) -> list[tuple[Run, tuple[float, ...]]]:
    """The base runs (and their LRs) whose finished weights the unfinished continuations in
    ``jobs`` start from and the folder lacks: a folder resumed on a fresh machine from its
    committed run records (weights are never committed: 42 MB per base at ``gpu-v5``'s size).
    Every such base is a run this process has seen (``ctx.bases``): the runner trains or loads
    each base before planning its continuations."""
    out: dict[str, tuple[Run, tuple[float, ...]]] = {}
    for run, lrs in jobs:
        if (run.origin is None or run.origin_budget is None or run.origin in out
                or model_path(ctx, run.origin, run.origin_budget).is_file()
                or saved_result(ctx, run, lrs) is not None):
            continue
        if run.origin not in ctx.bases:
            raise AssertionError(f"{run.id}: its base {run.origin} was not seen before it")
        out[run.origin] = ctx.bases[run.origin]
    return list(out.values())


def train_base_again(ctx: Context, run: Run, lrs: tuple[float, ...]) -> dict[str, Any]:
    """Train the finished base ``run`` again for its weights (saved by its cooldown branches,
    :func:`_branch`), keeping its run record: training is a pure function of seed and step,
    so on the CPU the weights equal the first training's bit for bit (a test holds it); on a
    GPU, up to its nondeterminism, which the printed line shows against the record."""
    t0 = time.perf_counter()
    result = train_run(ctx, run, lrs)
    state_path(ctx, run).unlink(missing_ok=True)
    result["timing"]["wall"] = time.perf_counter() - t0
    return result


def ready_bases(ctx: Context, jobs: list[tuple[Run, tuple[float, ...]]]) -> None:
    """Every base the continuations in ``jobs`` start from on disk (:func:`missing_bases`
    trained again, in the worker processes when ``ctx.jobs`` > 1), each with one line."""
    missing = missing_bases(ctx, jobs)
    if not missing:
        return
    if ctx.jobs > 1 and len(missing) > 1:
        if ctx.pool is None:
            ctx.pool = worker_pool(ctx.jobs)
        items = [(ctx.preset, ctx.source, str(ctx.out), run, lrs, True) for run, lrs in missing]
        done = dict(ctx.pool.imap_unordered(_work_item, items))
    else:
        done = {run.id: train_base_again(ctx, run, lrs) for run, lrs in missing}
    for run, lrs in missing:
        recorded = saved_result(ctx, run, lrs)
        again, first = done[run.id]["branches"][-1]["loss"], (
            recorded["branches"][-1]["loss"] if recorded else math.nan)
        if ctx.print_fn is not None and ctx.progress is not False:
            ctx.print_fn(f"scale: {run.id}: trained again for its weights (a folder keeps "
                         f"none): loss {again:.4f}, recorded {first:.4f}, "
                         f"{done[run.id]['timing']['wall']:.0f} s")


# ------------------------------------------------------------------------ runs in parallel
_WORKER: dict[Any, Context] = {}  # a worker process's context, built once per experiment


def _work(preset: Preset, source: tuple[Any, ...], out: str, run: Run,
          lr: tuple[float, ...], again: bool = False) -> dict[str, Any]:
    """One run in a worker process (one torch thread: a run's numbers equal those of a
    sequential ``--threads 1`` run); its results land on disk as :func:`execute` writes them.
    ``again``: a finished base trained again for its weights (:func:`train_base_again`)."""
    torch.set_num_threads(1)
    key = (preset, source, out)
    if key not in _WORKER:
        _WORKER.clear()
        data, device, dtype, compile_mode = source
        _WORKER[key] = context(preset, data, device, dtype, progress=False, out=Path(out),
                               print_fn=None, compile=compile_mode)
    return (train_base_again if again else execute)(_WORKER[key], run, lr)


def prefetch(ctx: Context, jobs: list[tuple[Run, tuple[float, ...]]]) -> None:
    """With ``ctx.jobs`` > 1, train the (run, stage LRs) pairs of ``jobs`` not finished yet in that
    many worker processes; :func:`execute` then finds their results on disk. Runs are
    independent given their LR (a pure function of seed and step), so the order does not
    matter; a run killed in a worker resumes from its state file like any other. When bases
    must be trained again (:func:`missing_bases`), one seed at a time: its bases, then its
    continuations, so that a lease shorter than the whole stage still finishes some seeds'
    continuations (their records travel, the weights never do) instead of only bases."""
    if ctx.jobs <= 1:
        return
    todo = [(run, lr) for run, lr in jobs if saved_result(ctx, run, lr) is None]
    if len(todo) < 2:
        return
    groups = ([[(run, lr) for run, lr in todo if run.seed == seed]
               for seed in dict.fromkeys(run.seed for run, _ in todo)]
              if missing_bases(ctx, todo) else [todo])
    for group in groups:
        ready_bases(ctx, group)
        if ctx.pool is None:  # spawned: no forked torch state; closed by closing_workers
            ctx.pool = worker_pool(ctx.jobs)  # workers die with this process: never write
            # after its run-folder lock is gone
        pending = {run.id: (run, lr) for run, lr in group}
        items = [(ctx.preset, ctx.source, str(ctx.out), run, lr) for run, lr in group]
        for run_id, result in ctx.pool.imap_unordered(_work_item, items):
            run, lr = pending[run_id]
            _announce(ctx, run, lr, result)


def _work_item(item: tuple[Any, ...]) -> tuple[str, dict[str, Any]]:
    return item[3].id, _work(*item)


@contextlib.contextmanager
def closing_workers(ctx: Context) -> Any:
    """Close the worker processes after the experiment; on an error or an interrupt, stop
    them at once (a run killed in a worker keeps its last state file, as anywhere)."""
    try:
        yield
    except BaseException:
        if ctx.pool is not None:
            ctx.pool.terminate()
            ctx.pool.join()
        raise
    if ctx.pool is not None:
        ctx.pool.close()
        ctx.pool.join()
