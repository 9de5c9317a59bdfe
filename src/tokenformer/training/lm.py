"""The language-model front end of ``tokenformer train``: the model config a training config names,
the data, this rank's batches (a pure function of seed and step), the run folder, then ``fit``."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..data import corpus, datasets
from ..errors import ConfigError
from ..io.files import atomic_write_text
from ..io.outputs import check_run_folder, hold_run_folder
from ..io.process_group import World, barrier, init, shutdown
from ..io.run_folders import FINAL
from ..models.baselines import TransformerConfig, matched_config, model_class
from ..models.config import PRESETS, TokenFormerConfig, flops_per_token
from .checkpointing import (
    check_resumed_growth,
    initial_model,
    initial_optimizer,
    resume_point,
)
from .config import RUN_CONFIG, TrainConfig
from .distributed import consolidate_checkpoint
from .evaluation import lm_evaluator
from .execution import Execution, resolve_device
from .growth import growth_plan
from .growth_events import check_growth_plan
from .loop import FitResult, RunFolder, RunState, fit
from .recording import METRICS
from .report import report
from .signals import Interrupted


def build_model_config(cfg: TrainConfig, vocab_size: int | None = None,
                       eos_token_id: int | None = None) -> Any:
    """The model config a training config names: ``model`` (a preset plus overrides; vocabulary
    and EOS from the data, context = ``seq_len`` unless set) and, for a baseline ``arch``, the
    matched baseline with ``baseline`` overrides."""
    overrides = dict(cfg.model)
    preset = overrides.pop("preset", None)
    data: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown model preset {preset!r}; known presets: "
                              f"{', '.join(PRESETS)}")
        data.update(PRESETS[preset], name=preset)
    if vocab_size is not None:
        data["vocab_size"] = vocab_size
        data["eos_token_id"] = eos_token_id
    data["max_seq_len"] = cfg.seq_len
    data.update(overrides)
    config = TokenFormerConfig.from_dict(data)
    if cfg.seq_len > config.max_seq_len:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds model.max_seq_len "
                          f"{config.max_seq_len}")
    if cfg.arch == "tokenformer":
        if cfg.baseline:
            raise ConfigError("baseline overrides were given but arch is tokenformer")
        return config
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(cfg.baseline) - known)
    if unknown:
        raise ConfigError(f"unknown baseline key(s): {', '.join(unknown)}")
    return matched_config(config, cfg.arch, **cfg.baseline)


def open_dataset(cfg: TrainConfig, progress: bool = True) -> Any:
    """The dataset ``cfg.data`` names: the embedded corpus prepared with ``cfg.tokenizer``, or a
    prepared directory."""
    if cfg.data == "default":
        return corpus.default_dataset(cfg.tokenizer, progress=progress)
    return datasets.TokenDataset.open(cfg.data)


def lm_batches(dataset: Any, batch_size: int, seq_len: int, seed: int,
               device: torch.device | str = "cpu", rank: int = 0, world_size: int = 1
               ) -> Callable[[int], dict[str, torch.Tensor]]:
    """``fit``'s batch function for a language model: step → this rank's share of the training
    batch (a pure function of seed and step, so runs of one seed see the same data)."""
    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        ids = dataset.batch("train", step, batch_size, seq_len, seed=seed, rank=rank,
                            world_size=world_size).to(device)
        return {"input_ids": ids, "labels": ids}

    return batch_fn


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool | None = None,
          print_fn: Callable[[str], None] = print) -> FitResult:
    """Train a language model as ``cfg`` says, into ``cfg.out``: the model (TokenFormer or a
    baseline by ``arch``, or ``init_from``), the data, batches and evaluation, then :func:`fit`,
    then the report (:mod:`.report`).

    ``resume=True`` continues the run in ``cfg.out`` from its newest checkpoint, bit for bit.
    """
    events = growth_plan(cfg)  # before any work: a bad plan is one line, nothing written
    world = World()
    stack = contextlib.ExitStack()
    try:
        device = resolve_device(cfg.device)
        world = init(cfg.strategy, device)
        device = resolve_device(cfg.device, world)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        show = progress if world.is_main else False
        dataset = open_dataset(cfg, progress=show)
        tokenizer = dataset.tokenizer
        initial = initial_model(cfg) if cfg.init_from and not resume else None
        # read before the run folder is made: a bad optimizer file leaves nothing behind
        optimizer = initial_optimizer(initial, cfg) if initial is not None else None
        model_config = (initial.config if initial is not None else
                        build_model_config(cfg, dataset.vocab_size, tokenizer.eos_token_id))
        if cfg.seq_len > model_config.max_seq_len:
            raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's context "
                              f"{model_config.max_seq_len}")
        dataset.check_model(model_config.vocab_size, cfg.seq_len)
        if not resume:  # a resumed run's plan is checked against its checkpoint, below
            check_growth_plan(model_config, events)
        if world.is_main:
            for note in dict.fromkeys(e.note for e in events if e.note):
                print_fn(f"note: {note}")
        if cfg.batch_size % (world.world_size * cfg.grad_accum):
            raise ConfigError(f"batch_size {cfg.batch_size} must be divisible by world size "
                              f"{world.world_size} × grad_accum {cfg.grad_accum}")
        if cfg.tensorboard:
            try:
                importlib.import_module("torch.utils.tensorboard")
            except ImportError:
                raise ConfigError("tensorboard: true needs the tensorboard package: "
                                  "pip install 'tokenformer[tensorboard]'") from None
        run_dir = Path(cfg.out)
        inputs = [cfg.data if cfg.data != "default" else cfg.tokenizer, cfg.init_from or None]
        # before the folder is created or locked: not an input, not someone else's folder. A run
        # of an earlier version (no marker) has metrics.jsonl; config.json alone may be a model
        # folder (a merge or adapt output), which a lock and marker would spoil.
        check_run_folder(run_dir, inputs, command="train", legacy=(METRICS,))
        barrier(world)  # every rank checked before rank 0 writes the lock and marker
        stack.enter_context(hold_run_folder(run_dir, command="train", world=world))
        if not resume and ((run_dir / METRICS).exists() or (run_dir / RUN_CONFIG).exists()):
            raise ConfigError(f"{run_dir} already holds a run; resume it with --resume "
                              f"{run_dir}, or choose another --out")
        resume_from = resume_point(run_dir, world, print_fn) if resume else None
        if resume_from is not None:  # before the saved config is rewritten
            check_resumed_growth(cfg, run_dir, resume_from, events)
        elif resume:  # nothing trained yet: the run starts over from step 0
            check_growth_plan(model_config, events)
        barrier(world)  # every rank has looked at run_dir before rank 0 writes into it
        # Every rank evaluates the same windows, so the metrics do not depend on the world size.
        eval_fn = lm_evaluator(dataset, cfg.seq_len, cfg.batch_size, cfg.eval_batches, device)
        torch.manual_seed(cfg.seed)
        model = initial if initial is not None else model_class(cfg.arch)(model_config)
        if world.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(run_dir / RUN_CONFIG, json.dumps(cfg.to_dict(), indent=2) + "\n")
        per_rank = cfg.batch_size // world.world_size

        rank_batches = lm_batches(dataset, cfg.batch_size, cfg.seq_len, cfg.seed, device,
                                  world.rank, world.world_size)

        def batch_fn(step: int) -> dict[str, torch.Tensor]:
            batch = rank_batches(step)
            assert batch["input_ids"].shape[0] == per_rank
            return batch

        if world.is_main:
            n = model.num_parameters()
            print_fn(f"training {cfg.arch} {model_config.name}: {n:,} parameters "
                     f"({model.num_parameters(non_embedding=True):,} non-embedding), "
                     f"{flops_per_token(model_config, cfg.seq_len, True)['total']:.4g} "
                     f"training FLOPs/token, {cfg.steps} steps × {cfg.batch_size} × "
                     f"{cfg.seq_len} tokens on {world.world_size}× {device.type} "
                     f"({world.strategy}, {cfg.precision})")
        try:
            result = fit(model, batch_fn, cfg, eval_fn=eval_fn,
                         start=RunState(optimizer=optimizer, resume_from=resume_from),
                         out_dir=RunFolder(run_dir, tokenizer.save), progress=show,
                         execution=Execution(world, device))
        except Interrupted as exc:
            exc.args = (f"{exc}; continue with: tokenformer train --resume {run_dir}",)
            raise
    except BaseException:
        stack.close()
        raise
    finally:
        shutdown()
    with stack:  # the run folder stays locked until the report is written
        if world.is_main:
            if world.strategy == "fsdp":
                # The final model as a plain model.safetensors directory, read without the group.
                final = consolidate_checkpoint(run_dir / FINAL)
                result.model = model_class(cfg.arch).load(final).to(device)
            report(result, dataset, cfg, print_fn)
    return result
