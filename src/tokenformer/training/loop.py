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
from .execution import autocast_for, prepare_module
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


def fit(
    model: nn.Module,
    batch_fn: Batches,
    cfg: TrainConfig,
    *,
    eval_fn: EvalFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    start_step: int = 0,
    out_dir: str | Path | None = None,
    resume_from: str | Path | None = None,
    callbacks: Sequence[Callback] = (),
    flops_fn: FlopsFn | None = None,
    save_extra: Callable[[Path], None] | None = None,
    world: World | None = None,
    device: torch.device | str | None = None,
    progress: bool | None = None,
    freeze: FrozenRows | None = None,
    schedule: LrSchedule | None = None,
    anneal: Anneal | None = None,
    readback: int | None = None,
) -> FitResult:
    """Train ``model`` from ``start_step`` to ``cfg.steps``; see the module docstring.

    ``batch_fn(step)`` returns this rank's slice of the global batch (a dict of tensors, already
    on the device, whose keys ``model`` accepts). ``eval_fn(model)`` returns metrics; it runs on
    every rank at ``eval_interval``, ``eval_at``, around growths and at the end. ``flops_fn``
    counts the training FLOPs of a batch (default: :func:`lm_flops`). ``resume_from`` (a
    checkpoint directory) restores model, optimizer, RNG, step and counters, and ``model``'s class
    loads it. ``callbacks`` see every metrics record and the current model. ``freeze`` keeps
    rows of ``model`` unchanged until its step (:mod:`.freezing`; a growth with ``freeze_old``
    replaces it, and a checkpoint carries it to the resumed run). ``schedule``: the learning-rate
    schedule of every step instead of ``cfg``'s (:meth:`TrainConfig.lr_schedule`; a caller
    whose schedule spans several ``fit`` calls, e.g. the frontier's stable runs and cooldown
    branches). ``anneal``: the
    Θ-factor anneal in force at ``start_step`` (a caller whose run spans several ``fit`` calls
    passes on the :class:`FitResult`'s ``anneal`` and ``freeze`` of the call before); each exact
    growth of ``cfg.grow_at`` starts one of ``anneal_steps`` itself, and a checkpoint carries it
    to the resumed run. ``readback``: the steps between reads of the losses from the device
    (:mod:`.readback`; default 1 on the CPU or with ``callbacks``, else
    :data:`~.readback.READBACK_STEPS`): the records are the same for any value.

    With ``out_dir`` the run folder is locked for the call (:mod:`tokenformer.io.outputs`), and
    SIGINT/SIGTERM stop the loop after the current step with a checkpoint written
    (:class:`~tokenformer.training.signals.Interrupted`); a second signal stops at once.
    """
    world = world or World()
    events = growth_plan(cfg)  # before the run folder is locked: a bad plan writes nothing
    lock = (hold_run_folder(out_dir, command="train", world=world)
            if out_dir is not None else contextlib.nullcontext())
    with lock, StopOnSignal(enabled=out_dir is not None) as stopper:
        return _fit(model, batch_fn, cfg, eval_fn=eval_fn, optimizer=optimizer,
                    start_step=start_step, out_dir=out_dir, resume_from=resume_from,
                    callbacks=callbacks, flops_fn=flops_fn, save_extra=save_extra, world=world,
                    device=device, progress=progress, stopper=stopper, freeze=freeze,
                    schedule=schedule, anneal=anneal, readback=readback, events=events)


def _fit(model: nn.Module, batch_fn: Batches, cfg: TrainConfig, *, eval_fn: EvalFn | None,
         optimizer: torch.optim.Optimizer | None, start_step: int, out_dir: str | Path | None,
         resume_from: str | Path | None, callbacks: Sequence[Callback],
         flops_fn: FlopsFn | None, save_extra: Callable[[Path], None] | None, world: World,
         device: torch.device | str | None, progress: bool | None, stopper: StopOnSignal,
         freeze: FrozenRows | None, schedule: LrSchedule | None,
         anneal: Anneal | None, readback: int | None,
         events: list[GrowthEvent]) -> FitResult:
    device = torch.device(device) if device is not None else next(model.parameters()).device
    flops_fn = flops_fn or lm_flops
    if (events or freeze is not None) and world.strategy == "fsdp":
        raise ConfigError("growth inside a run (and frozen rows) is not supported with strategy "
                          "fsdp; use ddp")
    growth_steps = [e.step for e in events]
    if schedule is None:
        schedule = cfg.lr_schedule()
    run_dir = Path(out_dir) if out_dir is not None else None
    model = model.to(device)
    counters = None
    if resume_from is not None:
        if optimizer is not None:
            raise ConfigError("pass either an optimizer or resume_from, not both")
        if anneal is not None:
            raise ConfigError("pass either an anneal or resume_from (whose checkpoint carries "
                              "it), not both")
        model, optimizer, state = restore(type(model), Path(resume_from), cfg, world, device)
        start_step = state["step"]
        check_history(events, state.get("growth"), start_step,
                      str(Path(resume_from) / STATE_NAME))
        frozen = state.get("frozen_rows")
        freeze = (FrozenRows.from_state(frozen, str(resume_from)) if frozen is not None
                  else None)
        saved = state.get("anneal")
        anneal = (Anneal.from_state(saved, cfg.anneal_steps, str(Path(resume_from) / STATE_NAME))
                  if saved is not None else None)
        counters = {k: state[k] for k in ("tokens", "flops", "train_time", "elapsed")}
    module = prepare_module(model, cfg, world, device)
    if optimizer is None:
        optimizer = make_optimizer(model, cfg)
    # Named now: after an FSDP forward the root's parameters may be unsharded stand-ins.
    names = group_names(model, optimizer)
    if freeze is not None:
        freeze.attach(model, optimizer)
    if anneal is not None:  # start_step's (an earlier version's checkpoint saved the held one)
        anneal.apply(model, start_step)
    recorder = Recorder(cfg, world, run_dir=run_dir, start_step=start_step,
                        resumed=resume_from is not None, counters=counters, callbacks=callbacks,
                        progress=progress)
    autocast = autocast_for(cfg, device)
    evaluation = Evaluation(eval_fn, cfg, growth_steps, autocast)
    checkpoints = (Checkpointer(run_dir, cfg, world, events, save_extra) if run_dir is not None
                   else None)
    pending = Readback(recorder, readback if readback is not None else
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
