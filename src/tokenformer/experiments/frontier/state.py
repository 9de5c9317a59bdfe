"""The frontier's context and one run's saved state: the experiment's settings and data
(:class:`Context`), the models and training configs runs are built from, and what a run in
progress saves and restores.

Resumable at two levels. A finished run is written atomically to ``out/runs/<id>.json`` and never
trained again; a run in progress saves its stable-phase state (model, AdamW state, counters,
finished branches, the Θ-factor anneal and frozen rows in force) atomically to
``out/state/<id>.pt`` at every branch or growth point (:mod:`.one_run`; at a growth point, the
model before the growth, which the next segment's ``fit`` applies), and a restarted command
continues from there. Training is a pure
function of (seed, step) (batches, init, growth generators), so a resumed experiment writes the
same ``results.json`` up to its ``timing`` section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...data.corpora import corpus_dataset, parse_corpus, pysource_documents
from ...data.corpus import default_dataset
from ...data.datasets import TokenDataset
from ...data.heldout import WINDOWS, kjv_chapters, split_documents, window
from ...errors import CheckpointError, ConfigError, TokenFormerError, first_line
from ...io.files import atomic_write
from ...io.untrusted import safe_torch_load
from ...io.workers import check_parent
from ...models.baselines import TransformerConfig, model_class
from ...models.config import TokenFormerConfig
from ...training.anneal import Anneal
from ...training.config import TrainConfig
from ...training.evaluation import lm_evaluator
from ...training.execution import resolve_device
from ...training.growth_events import GrowthEvent
from ...training.optim import rebuild_optimizer
from ..common.saved import damaged, read_saved_json
from .configs import arch
from .growing import growth_settings
from .presets import Preset, is_tuning_seed
from .schedule import Run

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
    source: tuple[Any, ...] = ()  # (data, device, dtype, compile) as given: what a worker reopens
    compile: str = "off"  # torch.compile's mode for every training step, or off (run.COMPILE)
    counted: set[str] = dataclasses.field(default_factory=set)  # run ids counted in ``done``
    pool: Any = None  # the worker processes of ``jobs`` > 1, started once, at the first need
    # v5: the evaluation of each validation window ("tuning", "scoring"; :func:`evaluator`)
    windows: dict[str, Any] = dataclasses.field(default_factory=dict)
    # v5: each base run this process has seen (run id → the run and its LRs), to train it again
    # for its weights when a continuation needs them and the folder lacks them (weights are
    # never committed: a fresh machine resumes from run records; one_run.ready_bases)
    bases: dict[str, Any] = dataclasses.field(default_factory=dict)


def context(preset: Preset, data: str | Path | None, device: str, dtype: str | None,
            progress: bool | None, out: Path, print_fn: Any, compile: str = "off") -> Context:
    """The experiment's context: the dataset (``data``, else the preset's corpus, else the
    embedded one), the device, the precision, the evaluation function and ``compile``."""
    precision = PRECISIONS.get(str(dtype or preset.dtype).lower())
    if precision is None:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(PRECISIONS)}")
    dev = resolve_device(device)
    if compile != "off":
        allow_recompiles()
    if data is not None:
        dataset = TokenDataset.open(data)
    elif preset.validation is not None:  # v5: whole random documents held out
        dataset = held_out_dataset(preset)
    elif preset.corpus is not None:  # built here, never downloaded (data/corpora.py)
        dataset = corpus_dataset(preset.corpus, progress=progress is not False)
    else:
        dataset = default_dataset(progress=progress is not False)
    dataset.check_model(dataset.vocab_size, preset.seq_len)
    eval_fn = lm_evaluator(dataset, preset.seq_len, preset.batch_size, preset.eval_batches, dev)
    # v5: every branch on its window (tuning seeds: the tuning window, or its fixed subset of
    # tuning_batches; held-out: the whole scoring window)
    v = preset.validation
    windows = ({w: lm_evaluator(window(dataset, w), preset.seq_len, preset.batch_size,
                                v.tuning_batches if w == "tuning" else None, dev)
                for w in WINDOWS} if v is not None else {})
    return Context(preset, dataset, dev, precision, eval_fn, progress, out, print_fn,
                   compile=compile, windows=windows)


def held_out_dataset(preset: Preset) -> TokenDataset:
    """v5 (issue 46): the preset's corpus (pysource: its files; else the embedded corpus'
    chapters) with whole random documents held out in a tuning and a scoring window
    (:func:`tokenformer.data.heldout.split_documents`; in memory, about a second)."""
    v = preset.validation
    assert v is not None
    if preset.corpus is not None:
        kind, arg = parse_corpus(preset.corpus)
        if kind != "pysource":
            raise ConfigError(f"frontier: validation by documents needs a corpus of documents "
                              f"(pysource: or the embedded one), not {preset.corpus!r}")
        documents, name = pysource_documents(arg), preset.corpus
    else:
        documents, name = kjv_chapters(), "kjv-chapters"
    return split_documents(documents, v.tokens, v.tuning_share, v.seed, name)


def evaluator(ctx: Context, run: Run) -> Any:
    """The evaluation of ``run``'s branches: v5 (``preset.validation``) evaluates a run on a
    tuning seed on the tuning window (its fixed ``tuning_batches`` subset, where the preset
    sets one) and a held-out run on the whole scoring window, so
    that nothing chosen is scored on the data that chose it; v4 every run on the same
    ``eval_batches`` batches of the corpus' tail."""
    if not ctx.windows:
        return ctx.eval_fn
    return ctx.windows["tuning" if is_tuning_seed(run.seed) else "scoring"]


def allow_recompiles() -> None:
    """Every (family, size, Θ factor) an experiment trains in one process is one more graph of
    the same ``forward`` (static shapes: what CUDA graphs need), and a worker trains them all:
    more than dynamo's default 8 per function, past which it would quietly train eagerly. So
    allow its whole accumulated budget, and make hitting it an error rather than a slow run."""
    dynamo = torch._dynamo.config  # torch imports it on first use
    dynamo.recompile_limit = max(dynamo.recompile_limit, dynamo.accumulated_recompile_limit)
    if hasattr(dynamo, "fail_on_recompile_limit_hit"):  # where this torch has it
        dynamo.fail_on_recompile_limit_hit = True


def _config_class(family: str) -> type:
    return TokenFormerConfig if arch(family) == "tokenformer" else TransformerConfig


def build_model(family: str, config: Any, seed: int, device: Any) -> Any:
    torch.manual_seed(seed)  # every arm of a seed starts a given size from the same weights
    return model_class(arch(family))(config).to(device)


def train_config(ctx: Context, run: Run, steps: int, growth: GrowthEvent | None = None
                 ) -> TrainConfig:
    """A segment's training config, to step ``steps``; ``growth``: the growth it starts with
    (:func:`.growing.grow_at`), with the growth options of the run's arm. The learning rate is
    none of it: ``fit`` takes the run's schedule (:func:`.schedule.run_schedule`), which sets
    every step's (an optimizer built from this config gets the config's ``lr`` only until its
    first step)."""
    p = ctx.preset
    return TrainConfig(arch=arch(run.family), seq_len=p.seq_len, batch_size=p.batch_size,
                       steps=steps, weight_decay=p.weight_decay, grad_clip=p.grad_clip,
                       precision=ctx.precision, seed=run.seed, eval_interval=0,
                       eval_batches=p.eval_batches, samples=0, device=str(ctx.device),
                       pattention_impl=p.pattention_impl, grow_at=[growth] if growth else [],
                       compile=ctx.compile != "off",
                       compile_mode="default" if ctx.compile == "off" else ctx.compile,
                       **growth_settings(p, run, growth is not None))


def anneal_in_force(ctx: Context, run: Run, state: dict[str, Any]) -> Anneal | None:
    """exact-anneal: the Θ-factor anneal of the run's last growth (state["anneal"], None for
    none), which ``fit`` applies at every step (:mod:`tokenformer.training.anneal`)."""
    saved = state["anneal"]
    return (Anneal.from_state(saved, ctx.preset.anneal_steps, str(state_path(ctx, run)))
            if saved else None)


def model_path(ctx: Context, run_id: str, budget_index: int) -> Path:
    """Where a base run (:func:`.reuse.keeps_models`) saves its cooled branch at budget
    ``budget_index``: the finished base a continuation starts from."""
    return ctx.out / "models" / _safe(run_id) / f"b{budget_index}.pt"


def save_model(path: Path, family: str, model: Any) -> None:
    """A finished base's weights and config, atomically."""
    save_state(path, {"family": family, "config": dataclasses.asdict(model.config),
                      "model": model.state_dict()})


def load_base(ctx: Context, run: Run) -> Any:
    """The finished base ``run`` continues (its ``origin`` at ``origin_budget``), as a model
    on the context's device seeded by ``run``'s seed; :func:`damaged` when unreadable."""
    assert run.origin is not None and run.origin_budget is not None
    path = model_path(ctx, run.origin, run.origin_budget)
    how = f"delete {path.parent} and the base's run record to train the base again"
    try:
        model = _model_from(ctx, run, safe_torch_load(path, foreign=False))
    except CheckpointError:
        raise damaged(path, "truncated or corrupt: not a readable PyTorch file", how) from None
    except (TokenFormerError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise damaged(path, f"it does not restore: {first_line(exc)}", how) from None
    return model


def _model_from(ctx: Context, run: Run, saved: dict[str, Any]) -> Any:
    """The model ``saved`` holds (its ``config`` and ``model``: a run's state or a finished
    base), built for ``run``'s family and seed on the context's device."""
    model = build_model(run.family, _config_class(run.family)(**saved["config"]), run.seed,
                        ctx.device)
    model.load_state_dict(saved["model"])
    return model



def state_path(ctx: Context, run: Run) -> Path:
    return ctx.out / "state" / (_safe(run.id) + ".pt")


def result_path(ctx: Context, run: Run) -> Path:
    return ctx.out / "runs" / (_safe(run.id) + ".json")


def _safe(run_id: str) -> str:
    return run_id.replace("/", "__")


def save_state(path: Path, state: dict[str, Any]) -> None:
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


def load_state(ctx: Context, run: Run, lr: float | list[float]) -> dict[str, Any] | None:
    path = state_path(ctx, run)
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


def restore_state(ctx: Context, run: Run, state: dict[str, Any]) -> tuple[Any, Any]:
    """Model and optimizer of a loaded state; :func:`damaged` if they do not rebuild from it."""
    try:
        model = _model_from(ctx, run, state)
        optimizer = rebuild_optimizer(model, state["param_groups"], state["optimizer"],
                                      state_path(ctx, run),
                                      train_config(ctx, run, 1))
        anneal_in_force(ctx, run, state)  # a malformed anneal is a damaged state too
    except (TokenFormerError, AttributeError, KeyError, TypeError, ValueError,
            RuntimeError) as exc:
        raise damaged(state_path(ctx, run), f"it does not restore: {first_line(exc)}",
                      _rerun(run)) from None
    return model, optimizer


def lr_record(lrs: tuple[float, ...]) -> float | list[float]:
    """A run's ``lr`` as results.json and the state file hold it: one number, or one per stage
    when they differ (per-stage LR)."""
    return lrs[0] if len(set(lrs)) == 1 else list(lrs)


def saved_result(ctx: Context, run: Run, lrs: tuple[float, ...]) -> dict[str, Any] | None:
    """The run's results when an earlier invocation (or a worker) finished it at these LRs;
    :func:`damaged` when they do not hold exactly the budgets the run plans."""
    path = result_path(ctx, run)
    if not path.is_file():
        return None
    saved = read_saved_json(path, _is_result, _rerun(run))
    if saved.get("lr") != lr_record(lrs):  # of another run: trained again, and replaced
        return None
    unplanned = _unplanned_budgets(run, saved["branches"])
    if unplanned:
        raise damaged(path, unplanned, _rerun(run))
    return saved


def _unplanned_budgets(run: Run, branches: list[dict[str, Any]]) -> str | None:
    """How the budgets of a finished run's saved ``branches`` differ from those ``run`` plans
    (each planned budget index once, at its planned FLOPs, and no other), or None. A record cut
    short or edited would otherwise be reported as the run's results: the report answers its
    questions at the last budget it finds. The FLOPs compare exactly: JSON writes a float's
    shortest repr, which reads back as the same float."""
    planned = {b.budget_index: b.budget for b in run.branches}
    held: set[int] = set()
    for branch in branches:
        index, budget = branch["budget_index"], branch["budget"]
        if type(index) is not int or index not in planned:
            return (f"it holds a branch at budget {index!r}, which its arm does not plan (it "
                    f"plans {', '.join(map(str, planned))})")
        if index in held:
            return f"it holds budget {index} twice"
        if budget != planned[index]:
            return f"its budget {index} is {budget!r} FLOPs, the plan's {planned[index]!r}"
        held.add(index)
    missing = [j for j in planned if j not in held]
    if missing:
        return (f"it holds {len(held)} of the {len(planned)} budgets its arm plans; missing: "
                + ", ".join(f"budget {j} ({planned[j]:.3g} FLOPs)" for j in missing))
    return None
