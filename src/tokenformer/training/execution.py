"""Where and how a run computes: the device, bf16 autocast, and the module the step calls (the
Pattention implementation, activation checkpointing per block, DDP/FSDP, ``torch.compile``);
what ``fit`` is told of it is one record, :class:`Execution`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from ..io.process_group import World
from ..nn.kernels.dispatch import DEFAULT_IMPL, prepare_impl
from ..nn.pattention import set_pattention_impl
from .config import TrainConfig, parse_device
from .distributed import blocks, wrap_model


@dataclass(frozen=True)
class Execution:
    """Where ``fit`` computes: the process group (``world``; None: this process alone), the
    device (None: the model's) and the steps between reads of the losses from it (``readback``,
    :mod:`.readback`; None: 1 on the CPU or with callbacks, else ``READBACK_STEPS``; the records
    are the same for any value)."""

    world: World | None = None
    device: torch.device | str | None = None
    readback: int | None = None


def resolve_device(spec: str, world: World | None = None) -> torch.device:
    """``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``; under torchrun on CUDA, this
    rank's local GPU."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = parse_device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device cuda requested but CUDA is not available")
        if world is not None and world.distributed:
            device = torch.device("cuda", world.local_rank)
            torch.cuda.set_device(device)
    return device


def autocast_for(cfg: TrainConfig, device: torch.device
                 ) -> Callable[[], AbstractContextManager]:
    """The precision context of forward passes: bf16 autocast for ``precision: bf16``, else off."""
    return functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16,
                             enabled=cfg.precision == "bf16")


def _checkpointed(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def prepare_module(model: nn.Module, cfg: TrainConfig, world: World,
                   device: torch.device) -> nn.Module:
    """Pattention impl, activation checkpointing per block, DDP/FSDP, torch.compile: the module
    training calls."""
    if cfg.pattention_impl != DEFAULT_IMPL:  # the default keeps each layer's own setting
        set_pattention_impl(model, cfg.pattention_impl)
    if cfg.activation_checkpointing:
        for block in blocks(model):
            if not isinstance(block.forward, functools.partial):
                block.forward = functools.partial(_checkpointed, block.forward)
    module = wrap_model(model, world, device)
    if not cfg.compile:
        return module
    prepare_impl(cfg.pattention_impl)  # build the C++ kernel now: mid-trace it breaks graphs
    return torch.compile(module, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
