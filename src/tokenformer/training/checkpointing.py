"""A run's checkpoints: write one, find and restore the one a resumed run continues from, start from
a model folder.

A checkpoint holds the model, the optimizer, the RNG and the trainer state, written atomically
(sharded under FSDP); ``init_from`` starts a run from a model folder and its optimizer state.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError, is_disk_full
from ..io import checkpoint as ckpt
from ..io.metrics import MetricsLog
from ..io.paths import has_regular_file
from ..io.process_group import World, barrier
from ..io.run_folders import FINAL, latest_checkpoint, list_checkpoints, prune_checkpoints, step_dir
from ..io.training_state import (
    OPTIMIZER_NAME,
    STATE_NAME,
    has_optimizer_state,
    load_optimizer_state,
    load_rng_state,
    read_state,
    write_state,
)
from ..models.baselines import load_model_dir, model_class
from ..models.checks import check_buildable
from ..models.persistence import CONFIG_NAME
from .config import RUN_CONFIG, load_config
from .distributed import is_sharded, load_sharded, save_sharded, wrap_model
from .growth import growth_plan
from .growth_events import GrowthEvent, check_growth_plan, check_history, check_resumed_plan
from .optim import make_optimizer, rebuild_optimizer
from .recording import METRICS
from .signals import Interrupted, StopOnSignal

if TYPE_CHECKING:
    from .config import TrainConfig

TRAINER_FORMAT = "tokenformer-trainer-v1"


class Checkpointer:
    """Writes a run's checkpoints into ``run_dir``: the final one, one every
    ``checkpoint_interval`` steps (the newest ``keep_last`` kept), and one when a signal asks the
    run to stop (:mod:`.signals`)."""

    def __init__(self, run_dir: Path, cfg: TrainConfig, world: World,
                 events: Sequence[GrowthEvent],
                 save_extra: Callable[[Path], None] | None) -> None:
        self.run_dir, self.cfg, self.world = run_dir, cfg, world
        self.events, self.save_extra = events, save_extra

    def save(self, step: int, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             names: list[list[str]], counters: dict[str, Any],
             frozen: dict[str, Any] | None = None,
             anneal: dict[str, Any] | None = None) -> None:
        """Write the checkpoint of ``step`` to ``path`` (every rank calls it); ``frozen``: the
        frozen rows in force (:meth:`.freezing.FrozenRows.to_state`); ``anneal``: the Θ-factor
        anneal in force (:meth:`.anneal.Anneal.to_state`)."""
        world = self.world
        state = {"format": TRAINER_FORMAT, "step": step, **counters,
                 "param_groups": names, "world_size": world.world_size,
                 "strategy": world.strategy, "growth": [e.spec for e in self.events
                                                       if e.step < step],
                 "train_config": self.cfg.to_dict()}
        if frozen is not None:
            state["frozen_rows"] = frozen
        if anneal is not None:
            state["anneal"] = anneal
        try:
            if world.strategy == "fsdp":
                def rest(tmp: Path) -> None:
                    model.config.save(tmp / "config.json")
                    if self.save_extra is not None:
                        self.save_extra(tmp)
                    write_state(tmp, state)

                save_sharded(path, model, optimizer, world, rest)
            elif world.is_main:
                ckpt.save_checkpoint(path, model, optimizer, state, self.save_extra)
        except (OSError, RuntimeError) as exc:
            if not is_disk_full(exc):
                raise
            raise CheckpointError(f"no space left on device while writing the checkpoint {path} "
                                  f"(step {step}); nothing was replaced, earlier checkpoints are "
                                  f"intact: free some space, then resume") from None
        barrier(world)

    def after_step(self, done: int, stopper: StopOnSignal, model: nn.Module,
                   optimizer: torch.optim.Optimizer, names: list[list[str]],
                   counters: dict[str, Any], frozen: dict[str, Any] | None = None,
                   anneal: dict[str, Any] | None = None,
                   before_save: Callable[[], None] | None = None) -> None:
        """After ``done`` steps: the final, a periodic or a stop checkpoint when due (after
        ``before_save``: the records read back, ``counters`` then complete); a stop then raises
        :class:`Interrupted`."""
        cfg, run_dir, world = self.cfg, self.run_dir, self.world
        signum = stopper.requested(world)  # the same on every rank: all save or none
        periodic = cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0
        if before_save is not None and (done == cfg.steps or periodic or signum):
            before_save()
        if done == cfg.steps:
            self.save(done, run_dir / FINAL, model, optimizer, names, counters, frozen,
                      anneal)
        elif periodic or signum:
            self.save(done, step_dir(run_dir, done), model, optimizer, names, counters,
                      frozen, anneal)
            if world.is_main:
                prune_checkpoints(run_dir, cfg.keep_last)
        if signum and done < cfg.steps:
            raise Interrupted(f"interrupted by {signal.Signals(signum).name} after step "
                              f"{done} of {cfg.steps}: checkpoint written to "
                              f"{step_dir(run_dir, done)}", 128 + signum)


def resume_point(run_dir: Path, world: World, print_fn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint of ``run_dir`` to resume from, its state and the metrics log checked
    (on every rank, before anything changes); None for a run that crashed before its first
    checkpoint, whose log is then emptied to start over with the saved config."""
    if list_checkpoints(run_dir):
        resume_from = latest_checkpoint(run_dir)
        # a malformed state or log fails here, on every rank, before anything changes
        state = read_state(resume_from)
        check_state(state, resume_from)
        MetricsLog.kept(run_dir / METRICS, state["step"])
        return resume_from
    MetricsLog.kept(run_dir / METRICS, 0)  # malformed: fails on every rank
    if world.is_main:
        MetricsLog.truncate(run_dir / METRICS, 0)
        print_fn(f"{run_dir} has no checkpoint yet: starting from step 0 with its "
                 f"saved config")
    return None


def check_resumed_growth(cfg: TrainConfig, run_dir: Path, resume_from: Path,
                         events: Sequence[GrowthEvent]) -> None:
    """Before a resumed run writes anything: its growth plan (``events``, from ``cfg``) is the
    one it recorded (``run_dir``'s saved config, and the growths the checkpoint says it
    applied), and the growths still to come fit the checkpoint's model (its own config, not the
    one the run started from), and so is its ``anneal_steps``. Each refusal is one ConfigError
    line naming --grow-at (or --anneal-steps)."""
    state = read_state(resume_from)
    step = state["step"]
    if has_regular_file(run_dir / RUN_CONFIG, folder=run_dir):
        saved = load_config(run_dir / RUN_CONFIG, recorded=True)
        check_resumed_plan(growth_plan(saved), events, step, str(run_dir), str(resume_from))
        if saved.anneal_steps != cfg.anneal_steps:  # the anneal is part of the growth plan
            raise ConfigError(f"--anneal-steps: {run_dir} resumes after step {step} with "
                              f"anneal_steps {cfg.anneal_steps}, but it recorded "
                              f"{saved.anneal_steps}: a resumed run keeps its Θ-factor anneal; "
                              f"give --anneal-steps {saved.anneal_steps} or not at all")
    check_history(events, state.get("growth"), step, str(resume_from / STATE_NAME))
    config = model_class(cfg.arch).config_class.load(resume_from / CONFIG_NAME)
    check_growth_plan(config, [e for e in events if e.step >= step])


def restore(cls: type, path: Path, cfg: TrainConfig, world: World, device: torch.device
             ) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """Model, optimizer and trainer state of a checkpoint, for :func:`fit` to continue from."""
    state = read_state(path)
    check_state(state, path)
    if is_sharded(path):
        if world.strategy != "fsdp":
            raise CheckpointError(f"{path} is an FSDP (sharded) checkpoint; resume it with "
                                  f"strategy fsdp, or consolidate it first")
        config = cls.config_class.load(path / "config.json")
        check_buildable(config, str(path / "config.json"))  # before any tensor is made
        model = cls(config).to(device)
        wrap_model(model, world, device)
        optimizer = make_optimizer(model, cfg, state["param_groups"])
        load_sharded(path, model, optimizer)
    else:
        model = cls.load(path).to(device)
        optimizer = rebuild_optimizer(model, state["param_groups"],
                                      load_optimizer_state(path),
                                      path / OPTIMIZER_NAME, cfg)
    load_rng_state(path)
    return model, optimizer, state


def check_state(state: Any, path: Path) -> None:
    """A trainer state to resume from holds a step, the counters and the param-group names."""
    file = path / STATE_NAME

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{file} is malformed ({what}); resume from an earlier "
                               f"checkpoint or restore the file")

    if not isinstance(state, dict):
        raise bad("not a JSON object")
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise bad(f"step is {step!r}, expected an integer >= 0")
    for key in ("tokens", "flops", "train_time", "elapsed"):
        value = state.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
                math.isfinite(value) and value >= 0):
            raise bad(f"{key} is {value!r}, expected a number >= 0")
    groups = state.get("param_groups")
    if not (isinstance(groups, list) and all(isinstance(g, list) and all(
            isinstance(n, str) for n in g) for g in groups)):
        raise bad("param_groups is not a list of lists of parameter names")


def initial_model(cfg: TrainConfig) -> nn.Module:
    """The model of ``init_from`` (a model directory, checked against its manifest), which must be
    of ``cfg.arch``."""
    model = load_model_dir(cfg.init_from)  # checked against its manifest first
    arch = getattr(model.config, "arch", "tokenformer")
    if arch != cfg.arch:
        raise ConfigError(f"init_from {cfg.init_from} holds a {arch} model but arch is "
                          f"{cfg.arch}; set --arch {arch}")
    return model


def initial_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer | None:
    """AdamW with the state saved beside ``init_from`` (e.g. carried over by growth), if any."""
    if not has_optimizer_state(cfg.init_from):
        return None
    return rebuild_optimizer(model, None, load_optimizer_state(cfg.init_from),
                             Path(cfg.init_from) / OPTIMIZER_NAME, cfg)
