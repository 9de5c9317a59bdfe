"""``fit``: train any model from a batch function, a short loop handing each concern to a module.

``fit(model, batch_fn, cfg)`` trains any module whose ``model(**batch_fn(step))`` returns an object
with ``.loss``; batches are a pure function of the step, so the step *is* the data position and a
resumed run replays exactly the batches an uninterrupted one sees. The learning rate is a pure
function of the step too (:mod:`.schedule`). Each step: a growth when one is due
(:mod:`.growth`), the rate, one optimizer step (:mod:`.step`), its record (:mod:`.recording`;
its loss read back from the device every few steps, :mod:`.readback`), Θ's factor for the next
step while an anneal runs (:mod:`.anneal`), an evaluation when due (:mod:`.evaluation`), a
checkpoint when due or asked for by a signal (:mod:`.checkpointing`, :mod:`.signals`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..io.outputs import hold_run_folder
from ..io.process_group import World
from ..io.training_state import STATE_NAME
from .anneal import Anneal, anneal_after
from .checkpointing import Checkpointer, restore
from .config import TrainConfig
from .evaluation import EvalFn, Evaluation
from .execution import Execution, autocast_for, prepare_module
from .freezing import FrozenRows
from .growth import grow_in_run, growth_plan
from .growth_events import GrowthEvent, check_history
from .optim import group_names, make_optimizer
from .readback import Readback, readback_steps
from .recording import Callback, Recorder
from .schedule import LrSchedule, lr_at, set_lr
from .signals import StopOnSignal
from .step import count_tokens, lm_flops, train_step

Batches = Callable[[int], dict[str, torch.Tensor]]
FlopsFn = Callable[[nn.Module, dict[str, torch.Tensor]], float]


@dataclass
class FitResult:
    model: nn.Module  # the final (possibly grown) model, unwrapped
    optimizer: torch.optim.Optimizer
    step: int
    losses: list[float]  # per-step training loss of this call
    records: list[dict[str, Any]]  # every train / eval / grow record of this call
    tokens: int
    flops: float
    train_time: float
    elapsed: float
    run_dir: Path | None = None
    # in force after the last step (a caller that trains on in another fit call passes them on,
    # e.g. the frontier's segments and cooldown branches)
    freeze: FrozenRows | None = None
    anneal: Anneal | None = None

    @property
    def evals(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["type"] == "eval"]

    @property
    def final_eval(self) -> dict[str, Any] | None:
        evals = self.evals
        return evals[-1] if evals else None


def divergence(loss: float, done: int, events: Sequence[GrowthEvent]) -> str:
    """The line for a loss that became non-finite after ``done`` steps: the growth noise when a
    noisy growth preceded it (the likelier cause), else the learning rate."""
    noisy = [e for e in events if e.step < done
             and (e.kwargs.get("width_noise") or e.kwargs.get("noise_old"))]
    if noisy:
        last = noisy[-1]
        noise = ", ".join(f"{k}={last.kwargs[k]:g}" for k in ("width_noise", "noise_old")
                          if last.kwargs.get(k))
        return (f"the training loss became {loss} at step {done}, after the growth at step "
                f"{last.step} ({last.spec!r}) added noise ({noise}): lower that noise (a std "
                f"relative to each tensor's rms; HyperCloning used 0.32 for width_noise), then "
                f"the learning rate")
    return (f"the training loss became {loss} at step {done}; lower the learning rate or "
            f"enable grad_clip")


@dataclass(frozen=True)
class RunState:
    """Where a ``fit`` call starts in its run. A run that spans several calls (the frontier's
    segments and cooldown branches) passes on what the call before left in force: the step it
    reached (``step``), its ``optimizer``, the frozen rows (``freeze``, :mod:`.freezing`) and the
    Θ-factor anneal (``anneal``, :mod:`.anneal`) of :class:`FitResult`, and the learning-rate
    ``schedule`` it follows when that is not the config's (:class:`~.schedule.LrSchedule`; the
    default is :meth:`TrainConfig.lr_schedule`). Or it names a checkpoint to continue,
    ``resume_from``, which carries the step, optimizer, frozen rows and anneal itself (with the
    RNG and counters; ``model``'s class loads it)."""

    step: int = 0
    optimizer: torch.optim.Optimizer | None = None
    freeze: FrozenRows | None = None
    anneal: Anneal | None = None
    schedule: LrSchedule | None = None
    resume_from: str | Path | None = None

    def __post_init__(self) -> None:
        if self.resume_from is None:
            return
        # the checkpoint carries these: one given beside it would be overwritten in silence
        given = [name for name, value in (("a step", self.step), ("an optimizer", self.optimizer),
                                          ("frozen rows", self.freeze), ("an anneal", self.anneal))
                 if value not in (0, None)]
        if given:
            raise ConfigError(f"pass either {' and '.join(given)} or resume_from (whose "
                              f"checkpoint carries {'them' if len(given) > 1 else 'it'}), not both")


@dataclass(frozen=True)
class RunFolder:
    """The folder a ``fit`` call writes, locked for the call (:mod:`tokenformer.io.outputs`): its
    metrics log and checkpoints, each holding what ``extra(folder)`` writes beside the model
    (``train``'s: the tokenizer files)."""

    path: Path
    extra: Callable[[Path], None] | None = None


def fit(
    model: nn.Module,
    batch_fn: Batches,
    cfg: TrainConfig,
    *,
    eval_fn: EvalFn | None = None,
    flops_fn: FlopsFn | None = None,
    start: RunState | None = None,
    out_dir: str | Path | RunFolder | None = None,
    callbacks: Sequence[Callback] = (),
    progress: bool | None = None,
    execution: Execution | None = None,
) -> FitResult:
    """Train ``model`` from ``start.step`` (default 0) to ``cfg.steps``; see the module docstring.

    ``batch_fn(step)`` returns this rank's slice of the global batch (a dict of tensors, already
    on the device, whose keys ``model`` accepts). ``eval_fn(model)`` returns metrics; it runs on
    every rank at ``eval_interval``, ``eval_at``, around growths and at the end. ``flops_fn``
    counts the training FLOPs of a batch (default: :func:`lm_flops`). ``start``: where the call
    starts in its run (:class:`RunState`: the step, optimizer, frozen rows, anneal and schedule
    in force, or a checkpoint to resume). ``callbacks`` see every metrics record and the current
    model; ``progress``: a progress bar (None: when stderr is a terminal). ``execution``: the
    process group, device and read-back interval (:class:`~.execution.Execution`; default: this
    process, the model's device). Each exact growth of ``cfg.grow_at`` starts a Θ-factor anneal
    of ``anneal_steps`` itself, and a growth with ``freeze_old`` freezes the old tokens; a
    checkpoint carries both to the resumed run.

    With ``out_dir`` (a path, or a :class:`RunFolder`) the run folder is locked for the call
    (:mod:`tokenformer.io.outputs`) and gets the metrics log and checkpoints, and SIGINT/SIGTERM
    stop the loop after the current step with a checkpoint written
    (:class:`~tokenformer.training.signals.Interrupted`); a second signal stops at once. The
    growth plan is checked first (:func:`.growth.growth_plan`): a bad one writes nothing.
    """
    start = start or RunState()
    folder = (out_dir if isinstance(out_dir, RunFolder) or out_dir is None
              else RunFolder(Path(out_dir)))
    execution = execution or Execution()
    if execution.world is None:  # this process alone
        execution = dataclasses.replace(execution, world=World())
    events = growth_plan(cfg)  # before the run folder is locked: a bad plan writes nothing
    lock = (hold_run_folder(folder.path, command="train", world=execution.world)
            if folder is not None else contextlib.nullcontext())
    with lock, StopOnSignal(enabled=folder is not None) as stopper:
        return _fit(model, batch_fn, cfg, start, folder, execution, events, stopper,
                    eval_fn=eval_fn, flops_fn=flops_fn, callbacks=callbacks, progress=progress)


def _resume(model: nn.Module, cfg: TrainConfig, start: RunState, world: World,
            device: torch.device, events: Sequence[GrowthEvent]
            ) -> tuple[nn.Module, RunState, dict[str, Any]]:
    """The model, the run state and the counters of the checkpoint ``start.resume_from``, its
    growth history checked against ``events``."""
    path = Path(start.resume_from)
    model, optimizer, state = restore(type(model), path, cfg, world, device)
    check_history(events, state.get("growth"), state["step"], str(path / STATE_NAME))
    frozen, saved = state.get("frozen_rows"), state.get("anneal")
    resumed = dataclasses.replace(
        start, step=state["step"], optimizer=optimizer, resume_from=None,
        freeze=FrozenRows.from_state(frozen, str(path)) if frozen is not None else None,
        anneal=(Anneal.from_state(saved, cfg.anneal_steps, str(path / STATE_NAME))
                if saved is not None else None))
    return model, resumed, {k: state[k] for k in ("tokens", "flops", "train_time", "elapsed")}


def _fit(model: nn.Module, batch_fn: Batches, cfg: TrainConfig, start: RunState,
         folder: RunFolder | None, execution: Execution, events: list[GrowthEvent],
         stopper: StopOnSignal, *, eval_fn: EvalFn | None, flops_fn: FlopsFn | None,
         callbacks: Sequence[Callback], progress: bool | None) -> FitResult:
    world = execution.world
    device = (torch.device(execution.device) if execution.device is not None
              else next(model.parameters()).device)
    flops_fn = flops_fn or lm_flops
    if (events or start.freeze is not None) and world.strategy == "fsdp":
        raise ConfigError("growth inside a run (and frozen rows) is not supported with strategy "
                          "fsdp; use ddp")
    growth_steps = [e.step for e in events]
    schedule = start.schedule if start.schedule is not None else cfg.lr_schedule()
    run_dir = folder.path if folder is not None else None
    model = model.to(device)
    counters = None
    resumed = start.resume_from is not None
    if resumed:
        model, start, counters = _resume(model, cfg, start, world, device, events)
    start_step, optimizer, freeze, anneal = start.step, start.optimizer, start.freeze, start.anneal
    module = prepare_module(model, cfg, world, device)
    if optimizer is None:
        optimizer = make_optimizer(model, cfg)
    # Named now: after an FSDP forward the root's parameters may be unsharded stand-ins.
    names = group_names(model, optimizer)
    if freeze is not None:
        freeze.attach(model, optimizer)
    if anneal is not None:  # start_step's (an earlier version's checkpoint saved the held one)
        anneal.apply(model, start_step)
    recorder = Recorder(cfg, world, run_dir=run_dir, start_step=start_step, resumed=resumed,
                        counters=counters, callbacks=callbacks, progress=progress)
    autocast = autocast_for(cfg, device)
    evaluation = Evaluation(eval_fn, cfg, growth_steps, autocast)
    checkpoints = (Checkpointer(run_dir, cfg, world, events, folder.extra)
                   if folder is not None else None)
    pending = Readback(recorder, execution.readback if execution.readback is not None else
                       readback_steps(device, callbacks), device,
                       lambda loss, done: divergence(loss, done, events))

    model.train()
    recorder.start()
    try:
        for step in range(start_step, cfg.steps):
            event = next((e for e in events if e.step == step), None)
            if event is not None:
                pending.flush(model)
                model, optimizer, module, record = grow_in_run(
                    model, optimizer, event, cfg, world, device,
                    evaluation if eval_fn is not None else None, recorder.counters)
                names = group_names(model, optimizer)
                freeze = FrozenRows.after_growth(model, step)  # ends an earlier freeze
                if freeze is not None:
                    freeze.attach(model, optimizer)
                    record["frozen_until"] = "forever" if freeze.until is None else freeze.until
                anneal = anneal_after(event, model.config, cfg.anneal_steps)  # ends an earlier
                if anneal is not None:
                    anneal.apply(model, step)
                recorder.emit(record, model)
            if freeze is not None and not freeze.active(step):
                freeze = None  # the old tokens train again (and the saved copy is freed)
            lr = lr_at(step, schedule)
            set_lr(optimizer, lr)
            started = time.perf_counter()
            batch = batch_fn(step)
            loss, grad_norm = train_step(module, model, optimizer, batch,
                                         grad_accum=cfg.grad_accum, grad_clip=cfg.grad_clip,
                                         world=world, device=device, autocast=autocast,
                                         freeze=freeze)
            done = step + 1
            pending.add(done, loss, lr, grad_norm, count_tokens(batch) * world.world_size,
                        flops_fn(model, batch) * world.world_size, started, model)
            if anneal is not None:  # the factor of the next step, and of an evaluation now
                anneal.apply(model, done)
            if evaluation.due(done):
                pending.flush(model)
                recorder.evaluation(done, evaluation(model), model)
            if checkpoints is not None:
                checkpoints.after_step(done, stopper, model, optimizer, names, recorder.counters,
                                       freeze.to_state() if freeze is not None else None,
                                       anneal.to_state() if anneal is not None else None,
                                       before_save=functools.partial(pending.flush, model))
        pending.flush(model)
    except BaseException:
        pending.flush_after_error(model)
        raise
    finally:
        recorder.close()
    c = recorder.counters
    return FitResult(model, optimizer, max(start_step, cfg.steps), recorder.losses,
                     recorder.records, c["tokens"], c["flops"], c["train_time"], c["elapsed"],
                     run_dir, freeze, anneal)
