"""Where and how a run computes: the device, bf16 autocast, and the module the step calls (the
Pattention implementation, activation checkpointing per block, DDP/FSDP, ``torch.compile``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from ..io.process_group import World
from ..nn.kernels.dispatch import DEFAULT_IMPL, prepare_impl
from ..nn.pattention import set_pattention_impl
from .distributed import blocks, wrap_model

if TYPE_CHECKING:
    from .config import TrainConfig


DEVICE_TYPES = ("cpu", "cuda", "mps")


def parse_device(spec: str) -> torch.device:
    """``spec`` as a torch device of a type this package runs on (:data:`DEVICE_TYPES`), else one
    ConfigError line (torch's own error lists every device type it knows). Whether CUDA is there
    is :func:`resolve_device`'s question."""
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError, TypeError):
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise ConfigError(f"unknown device {spec!r} (use cpu, cuda, cuda:N or mps)")
    return device


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
