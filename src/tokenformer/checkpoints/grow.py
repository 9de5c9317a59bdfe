"""Growing a checkpoint folder: the model grown, its optimizer state carried over, the trainer's
state rewritten for the grown model, its tokenizer kept (``tokenformer grow``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, GrowthError
from ..formats.loading import load_model
from ..io.files import atomic_write_text
from ..io.outputs import check_output
from ..io.paths import has_regular_file, not_found, read_json_object
from ..io.training_state import (
    OPTIMIZER_NAME,
    RNG_NAME,
    STATE_NAME,
    has_optimizer_state,
    load_optimizer_state,
    read_rng_state,
    save_optimizer_state,
)
from ..io.tree import save_tree
from ..models.memory import check_memory
from ..ops.growth import (
    GrowthOptions,
    grow_with_optimizer,
    max_logit_change,
    plan_growth,
    resets_optimizer,
)
from ..ops.growth import grow as grow_model
from ..training.optim import rebuild_optimizer
from .folders import derived_model_folder


def grow_checkpoint(checkpoint: str | Path, out: str | Path, options: GrowthOptions, *,
                    seed: int = 0, reset_optimizer: bool = False, overwrite: bool = False,
                    progress: bool = True) -> dict[str, Any]:
    """Load ``checkpoint`` (our model directory or an official checkpoint), grow it by
    ``options`` (:func:`tokenformer.ops.growth.grow`'s request), write ``out``.

    The optimizer state beside the weights (``optimizer.safetensors``, or an earlier version's
    ``optimizer.pt``) is carried over (or reset with ``reset_optimizer``), and the trainer's
    ``trainer_state.json`` (param-group names updated to the grown model, the growth appended to
    ``grown``) and RNG state come along, so training resumes from ``out``; tokenizer files beside
    the input are copied. ``out`` is written atomically, with a manifest, and must not exist
    (``overwrite``: unless an earlier ``grow`` wrote it). Returns parameter counts before/after
    and the max |Δlogit| on a fixed probe batch.
    """
    out, source = Path(out), Path(checkpoint)
    if not source.exists():
        raise not_found(source, "checkpoint")
    check_output(out, [source], command="grow", overwrite=overwrite)
    model = load_model(source)  # a folder is checked against its manifest first
    has_state = source.is_dir() and has_optimizer_state(source)
    trainer_state = _read_trainer_state(source) if has_state else None
    # official-released starts a fresh optimizer whatever --reset-optimizer says: say so, and
    # record it, rather than "carried over"
    reset = reset_optimizer or resets_optimizer(options.recipe)
    carried = has_state and not reset
    # Before any tensor is made: the whole request checked, then the memory for the grown
    # weights, a working copy, and two moments if carried.
    planned = plan_growth(model.config, options)
    check_memory(planned, 4 if carried else 2, "the grown model")
    kwargs = dict(generator=torch.Generator().manual_seed(seed), copy=False,
                  progress=progress)  # the input model is only read
    optimizer = None
    if has_state:
        optimizer = _optimizer_from_checkpoint(model, source)
        grown, optimizer = grow_with_optimizer(model, optimizer, options, reset_optimizer=reset,
                                               **kwargs)
    else:
        grown = grow_model(model, options, **kwargs)
    delta, largest = max_logit_change(model, grown)
    if not (math.isfinite(delta) and math.isfinite(largest)):
        width_noise = options.width_noise
        noise = f" (--width-noise {width_noise:g}: lower it)" if width_noise else ""
        raise GrowthError(f"the grown model's logits are NaN or infinite on a fixed probe batch "
                          f"(max |Δlogit| {delta:g}){noise}; nothing written to {out}")
    with derived_model_folder(out, source, command="grow", overwrite=overwrite) as tmp:
        grown.save(tmp)
        if optimizer is not None:
            save_optimizer_state(tmp, optimizer)
            if trainer_state is not None:
                _write_trainer_state(source, trainer_state, tmp, grown, optimizer, {
                    "from": str(source), **options.recorded(), "seed": seed,
                    "reset_optimizer": reset})
    return {"out": str(out), "params_before": model.num_parameters(),
            "params_after": grown.num_parameters(), "max_abs_logit_change": delta,
            "max_abs_logit": largest, "optimizer": optimizer is not None,
            "reset_optimizer": reset, "recipe": options.recipe, "how": options.how,
            "config_before": model.config, "config": grown.config.to_dict(),
            "grown_config": grown.config}


def _read_trainer_state(source: Path) -> dict[str, Any] | None:
    """The trainer state beside the weights (None: none), its growth history checked before any
    work: a list of growth records (one JSON object per earlier ``grow``)."""
    state_file = source / STATE_NAME
    if not has_regular_file(state_file, folder=source):
        return None
    state = read_json_object(state_file)
    grown = state.get("grown", [])
    if not (isinstance(grown, list) and all(isinstance(g, dict) for g in grown)):
        raise CheckpointError(f"{state_file}: grown is {grown!r}, expected a list of growth "
                              f"records (one object per earlier tokenformer grow); restore the "
                              f"file from the run or grow that wrote it")
    return state


def _write_trainer_state(source: Path, state: dict[str, Any], out: Path,
                         model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         growth: dict[str, Any]) -> None:
    """``state`` (:func:`_read_trainer_state`) with the grown param-group names and ``growth``
    appended to ``grown``, and the RNG state, into ``out``."""
    names = {id(p): n for n, p in model.named_parameters()}
    state["param_groups"] = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    state["grown"] = [*state.get("grown", []), growth]
    atomic_write_text(out / STATE_NAME, json.dumps(state, indent=2) + "\n")
    rng = read_rng_state(source)  # re-written: an earlier version's rng.pt becomes ours
    if rng is not None:
        save_tree(out / RNG_NAME, rng)


def _optimizer_from_checkpoint(model: torch.nn.Module, directory: Path) -> torch.optim.Optimizer:
    """An AdamW over ``model`` holding the saved state, its groups named as
    :func:`_group_names` finds them (:func:`tokenformer.training.optim.rebuild_optimizer`)."""
    state = load_optimizer_state(directory)
    names = _group_names(state["param_groups"], directory,
                         [n for n, _ in model.named_parameters()])
    return rebuild_optimizer(model, names, state, directory / OPTIMIZER_NAME)


def _group_names(groups: list[dict[str, Any]], directory: Path,
                 model_names: list[str]) -> list[list[str]]:
    """Parameter names of each saved param group: from the state dict (optimizers built from
    ``named_parameters``), else from the trainer's state file, else, for a single group covering
    every parameter, the model's own order."""
    if all("param_names" in g for g in groups):
        return [list(g["param_names"]) for g in groups]
    state_file = directory / STATE_NAME
    if has_regular_file(state_file, folder=directory):
        value = read_json_object(state_file).get("param_groups")
        if (isinstance(value, list) and len(value) == len(groups)
                and all(isinstance(g, list) for g in value)):
            return [list(g) for g in value]
    if len(groups) == 1 and len(groups[0]["params"]) == len(model_names):
        return [model_names]
    raise CheckpointError(f"{directory / OPTIMIZER_NAME} has {len(groups)} parameter "
                          f"groups but does not name their parameters; pass --reset-optimizer "
                          f"to grow without carrying it over")
