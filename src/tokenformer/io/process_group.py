"""The process group: this process's rank among the ``torchrun`` workers and the collectives every
rank must agree through (a flag, a mean). One process (no ``WORLD_SIZE``) is a world of one, and
every collective is then the identity.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError

STRATEGIES = ("auto", "single", "ddp", "fsdp")


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(strategy: str, device: torch.device) -> World:
    """Join the process group torchrun describes (if any) and pick the strategy."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    size = env_world_size()
    if size == 1:
        return World(strategy="single")
    if strategy == "single":
        raise ConfigError(f"strategy 'single' cannot run on {size} processes; use ddp or fsdp")
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return World(dist.get_rank(), dist.get_world_size(), local_rank,
                 "ddp" if strategy == "auto" else strategy)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def mean_across(value: torch.Tensor, world: World) -> torch.Tensor:
    """The mean of a scalar tensor over ranks (each rank's loss is the mean over its equal
    slice), on its device: reading it is the caller's choice (a read waits for the device)."""
    value = value.detach()
    if world.distributed:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= world.world_size
    return value


def max_across(value: int, world: World) -> int:
    """The largest of an integer over ranks: a flag (stop, failed) every rank must agree on."""
    if not world.distributed:
        return value
    on_gpu = dist.get_backend() == "nccl"  # NCCL reduces CUDA tensors only
    tensor = torch.tensor([value], device=f"cuda:{torch.cuda.current_device()}" if on_gpu
                          else "cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())
