"""One optimizer step: the batch split into micro-batches, forward and backward under autocast (the
gradient sync skipped but for the last), clipping, the update, and the loss averaged over ranks,
left on the device (:mod:`.readback` reads it); with the token and FLOP counts of a batch."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from ..errors import ConfigError
from ..io.process_group import World, mean_across
from ..models.config import flops_per_token
from .distributed import no_gradient_sync
from .freezing import FrozenRows


def micro_batches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """``batch`` cut into ``n`` equal micro-batches along the first dimension."""
    if n == 1:
        return [batch]
    sizes = {v.shape[0] for v in batch.values() if torch.is_tensor(v)}
    if len(sizes) != 1 or next(iter(sizes)) % n:
        raise ConfigError(f"the per-rank batch ({sizes}) is not divisible into grad_accum={n} "
                          f"equal micro-batches")
    chunks = {k: v.chunk(n) if torch.is_tensor(v) else [v] * n for k, v in batch.items()}
    return [{k: c[i] for k, c in chunks.items()} for i in range(n)]


def train_step(module: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer,
               batch: dict[str, torch.Tensor], *, grad_accum: int, grad_clip: float,
               world: World, device: torch.device,
               autocast: Callable[[], AbstractContextManager],
               freeze: FrozenRows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One update of ``model`` (through ``module``, its wrapped/compiled form) on ``batch``:
    the mean loss over ranks and the gradient norm before clipping (None without clipping), 0-d
    tensors on the device, not read: nothing here waits for the device.
    ``freeze``: rows that get no gradient (before clipping) and no update (restored after it)."""
    micro = micro_batches(batch, grad_accum)
    loss_sum = torch.zeros((), device=device)
    for i, mb in enumerate(micro):
        with no_gradient_sync(module, world, skip=i < len(micro) - 1), autocast():
            loss = module(**mb).loss / len(micro)
        loss.backward()
        loss_sum += loss.detach().float()
    if freeze is not None:
        freeze.zero_grads()
    grad_norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                 if grad_clip > 0 else None)
    optimizer.step()
    if freeze is not None:
        freeze.restore()
    optimizer.zero_grad(set_to_none=True)
    return mean_across(loss_sum, world), _whole(grad_norm)


def _whole(value: torch.Tensor | None) -> torch.Tensor | None:
    """A 0-d tensor (an FSDP DTensor gathered now, in step on every rank) detached; None stays
    None."""
    if value is None:
        return None
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach()


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens of an LM batch (its ``input_ids``), else its examples (e.g. images)."""
    if "input_ids" in batch:
        return batch["input_ids"].numel()
    return next(iter(batch.values())).shape[0]


def lm_flops(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """Training FLOPs of one LM batch: the one analytic count × tokens."""
    ids = batch["input_ids"]
    return flops_per_token(model.config, ids.shape[1], training=True)["total"] * ids.numel()
