"""Data-parallel training: the same trainer under ``torchrun`` with DDP or FSDP2.

``torchrun --nproc_per_node=N -m tokenformer train ...`` sets ``WORLD_SIZE``; the trainer then
joins a process group (gloo on CPU, nccl on CUDA), every rank reads its slice of the same global
batch, and the model is wrapped by :func:`wrap_model`:

* ``ddp``: ``DistributedDataParallel`` (gradients averaged with an all-reduce);
* ``fsdp``: FSDP2 ``fully_shard`` on every block, then on the root (parameters, gradients and
  optimizer state sharded; gradients averaged with a reduce-scatter).

FSDP checkpoints are sharded with ``torch.distributed.checkpoint`` (DCP) into ``sharded/``;
:func:`load_sharded_model` reads one into a plain model in a single process and
:func:`consolidate_checkpoint` turns it into an ordinary ``model.safetensors`` directory.
DCP's reader unpickles ``sharded/.metadata`` and the non-tensor values without restriction, so
every sharded checkpoint carries our ``manifest.json`` (sha256 of each file) and is verified
against it before DCP reads a byte (:func:`tokenformer.io.checkpoint.verify_checkpoint`); then
``.metadata`` must unpickle with DCP's own metadata classes only, and non-tensor values are read
with ``torch.load(weights_only=True)`` (:func:`_load_dcp`). A forged manifest therefore still
cannot make loading run code.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pathlib
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..io.checkpoint import SHARDED, verify_checkpoint, write_manifest
from ..io.process_group import World, barrier
from ..io.untrusted import restricted_unpickler
from ..models.baselines import build_from_dir_config


def wrap_model(model: nn.Module, world: World, device: torch.device) -> nn.Module:
    """The module the training step calls: the model itself, DDP around it, or (FSDP2) the model
    sharded in place, each block a unit."""
    if world.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if world.strategy == "fsdp":
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(model, FSDPModule):  # already sharded (a restored checkpoint)
            return model
        mesh = device_mesh(device)
        for block in blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def device_mesh(device: torch.device) -> Any:
    """The 1-D mesh of every rank on the run's device type. fully_shard's default mesh takes the
    machine's accelerator instead (torch 2.13: ``torch._C._get_accelerator()``; earlier:
    ``torch.cuda.is_available()``), so a CPU run on a GPU machine put its shards on cuda:0."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (torch.distributed.get_world_size(),))


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks (``layers`` of the LMs, ``blocks`` of the vision model): the units FSDP
    shards and activation checkpointing recomputes."""
    for name in ("layers", "blocks"):
        found = getattr(model, name, None)
        if isinstance(found, nn.ModuleList):
            return list(found)
    return []


@contextlib.contextmanager
def no_gradient_sync(module: nn.Module, world: World, skip: bool) -> Iterator[None]:
    """Skip the gradient all-reduce / reduce-scatter for accumulation micro-steps but the last."""
    if not skip or not world.distributed:
        yield
    elif world.strategy == "ddp":
        with module.no_sync():
            yield
    else:
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)


# ----------------------------------------------------------------------------- sharded checkpoints
def save_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 world: World, write_rest: Any) -> None:
    """All ranks write their shards with DCP into a temporary directory; rank 0 adds the JSON
    files (``write_rest(tmp)``) and the manifest, and renames it onto ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp = path.with_name(f".{path.name}.tmp")
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(world)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / SHARDED))
    barrier(world)
    if world.is_main:
        write_rest(tmp)
        write_manifest(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    barrier(world)


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a sharded checkpoint into an FSDP model and its optimizer (any world size)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    _load_dcp(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def _load_dcp(state: dict[str, Any], path: Path, **kwargs: Any) -> None:
    """``dcp.load`` of ``path/sharded`` that cannot run code from the files, whatever they hold.

    The manifest is verified first. DCP then unpickles two kinds of data without restriction:
    ``.metadata`` (checked here beforehand: it may name only DCP's metadata classes, so the
    unrestricted load performs the same harmless constructions) and each non-tensor value (read
    here with ``torch.load(weights_only=True)`` and handed to DCP re-saved from that result)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata

    verify_checkpoint(path)
    allowed = _dcp_metadata_globals()

    def resolve(module: str, name: str) -> Any:
        if f"{module}.{name}" not in allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not DCP metadata")
        return allowed[f"{module}.{name}"]

    for metadata in sorted((path / SHARDED).glob("*.metadata")):
        try:  # DCP reads one pickle from the file's start, and so does this check
            with metadata.open("rb") as f:
                if not isinstance(restricted_unpickler(resolve)(f).load(), Metadata):
                    raise pickle.UnpicklingError("not a Metadata object")
        except Exception as exc:
            raise CheckpointError(f"{metadata} is not DCP metadata ({str(exc)[:200]}); "
                                  f"refusing to read the sharded checkpoint") from None

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            plain, buffer = torch.load(value, weights_only=True), io.BytesIO()
            torch.save(plain, buffer)
            buffer.seek(0)
            super().load_bytes(read_item, buffer)

    try:
        dcp.load(state, checkpoint_id=str(path / SHARDED), planner=WeightsOnlyPlanner(),
                 **kwargs)
    except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise CheckpointError(f"cannot read the sharded checkpoint {path}: "
                              f"{first or type(exc).__name__}") from None


def _dcp_metadata_globals() -> dict[str, Any]:
    """What a DCP ``.metadata`` pickle names: the classes of DCP's metadata module, its storage
    records, sizes, dtypes, layouts and the checkpoint's path."""
    import torch.distributed.checkpoint.filesystem as filesystem
    import torch.distributed.checkpoint.metadata as metadata

    allowed: dict[str, Any] = {f"{metadata.__name__}.{name}": value
                               for name, value in vars(metadata).items()
                               if isinstance(value, type) and value.__module__ == metadata.__name__}
    allowed.update({f"torch.{name}": value for name, value in vars(torch).items()
                    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))})
    allowed.update({"torch.Size": torch.Size, "collections.OrderedDict": collections.OrderedDict,
                    "pathlib.PosixPath": pathlib.PosixPath,
                    "pathlib.PurePosixPath": pathlib.PurePosixPath,
                    "pathlib.WindowsPath": pathlib.PureWindowsPath,
                    "pathlib.PureWindowsPath": pathlib.PureWindowsPath})
    # private names DCP itself pickles; absent in another torch, they are simply not allowed
    for module, name in ((filesystem, "_StorageInfo"), (torch.serialization, "_get_layout")):
        if hasattr(module, name):
            allowed[f"{module.__name__}.{name}"] = getattr(module, name)
    return allowed


def is_sharded(path: str | Path) -> bool:
    return (Path(path) / SHARDED).is_dir()


def load_sharded_model(path: str | Path) -> nn.Module:
    """A plain (unsharded) model from a sharded checkpoint, in one process, no process group."""
    path = Path(path)
    if not is_sharded(path):
        raise CheckpointError(f"{path} is not a sharded checkpoint (no {SHARDED}/ directory)")
    verify_checkpoint(path)  # before anything in it is read, config.json included
    model = build_from_dir_config(path)
    state = {"model": model.state_dict()}
    _load_dcp(state, path, no_dist=True)
    model.load_state_dict(state["model"])
    return model


def consolidate_checkpoint(path: str | Path) -> Path:
    """Write ``model.safetensors`` beside a sharded checkpoint, so that ``TokenFormerLM.load``
    (and everything built on it) reads the directory; the manifest then lists it too."""
    model = load_sharded_model(path)
    model.save(path)
    write_manifest(path)
    return Path(path)
