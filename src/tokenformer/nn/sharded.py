"""A Pattention split across devices by parameter token (tensor parallelism).

Each of W ranks holds a contiguous block of n/W parameter tokens: rows ``[r·n/W, (r+1)·n/W)`` of
both K_P and V_P. Every rank sees the whole input X. Then

* the scores split by token: rank r computes ``X · K_rᵀ``, its n/W columns of the [.., n] scores;
* Θ acts on a whole row of n scores, but every built-in Θ depends on the other columns only
  through one per-row number — the L2 norm (``l2_norm_gelu``: of the scores, ``gelu_l2_norm``: of
  GELU of them), the L1 norm of GELU (``gelu_l1_norm``), the sum of exponentials (``softmax``) —
  so one all-reduce of the per-row partial sum (of squares, for an L2 norm) gives every rank the
  row's normaliser, and the rank's Θ columns are exactly those of the unsharded Θ; ``gelu`` (no
  normaliser) needs none;
* the value product splits by token too: ``Θ·V = Σ_r Θ_r · V_r``, one all-reduce of the partial
  [.., d_out] outputs.

Two all-reduces per layer (one for ``gelu``), each rank's K/V memory and FLOPs divided by W. The
collective is a callable (sum over the ranks, returning the sum), so the same layer runs under
vLLM's tensor-parallel group (``tensor_model_parallel_all_reduce``) and plain
``torch.distributed`` (:func:`all_reduce_sum`). Top-k Pattention is not split: which k tokens
a row keeps is a global choice over all n (docs/serving.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .pattention import Pattention, TopK

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _l2_norm_gelu(a: torch.Tensor, reduce: AllReduce, scale: float, eps: float) -> torch.Tensor:
    norm = reduce(a.square().sum(dim=-1, keepdim=True)).sqrt()
    return F.gelu(a / (norm + eps) * scale)


def _gelu_l2_norm(a: torch.Tensor, reduce: AllReduce, scale: float, eps: float) -> torch.Tensor:
    act = F.gelu(a)
    return act / (reduce(act.square().sum(dim=-1, keepdim=True)).sqrt() + eps) * scale


def _gelu_l1_norm(a: torch.Tensor, reduce: AllReduce, scale: float, eps: float) -> torch.Tensor:
    act = F.gelu(a)
    return act / (reduce(act.abs().sum(dim=-1, keepdim=True)) + eps) * scale


def _softmax(a: torch.Tensor, reduce: AllReduce, scale: float, eps: float) -> torch.Tensor:
    act = torch.exp(a)  # no max subtracted: the official (and the reference) arithmetic
    return act / (reduce(act.sum(dim=-1, keepdim=True)) + eps) * scale


def _gelu(a: torch.Tensor, reduce: AllReduce, scale: float, eps: float) -> torch.Tensor:
    act = F.gelu(a)
    return act if scale == 1.0 else act * scale


# Θ of one rank's columns of the scores, given the all-reduce that completes the row normaliser;
# the formulas are the reference ones of nn/theta.py with the norm summed over the ranks.
SHARDED_THETAS: dict[str, Callable[[torch.Tensor, AllReduce, float, float], torch.Tensor]] = {
    "l2_norm_gelu": _l2_norm_gelu, "gelu_l2_norm": _gelu_l2_norm, "gelu_l1_norm": _gelu_l1_norm,
    "softmax": _softmax, "gelu": _gelu}


def check_split(name: str, norm: str, top_k: TopK, num_tokens: int, world_size: int) -> None:
    """ConfigError (one line, naming ``name``) when a Pattention of Θ ``norm``, ``top_k`` and
    ``num_tokens`` tokens cannot be split over ``world_size`` ranks by token: a Θ without a
    sharded form, top-k, or n not divisible."""
    if norm not in SHARDED_THETAS:
        raise ConfigError(f"{name}: Θ {norm!r} has no tensor-parallel form (built-in variants "
                          f"only: {', '.join(SHARDED_THETAS)}); serve it with "
                          f"tensor_parallel_size 1")
    if top_k is not None:
        raise ConfigError(f"{name}: top-k Pattention cannot be split by token (each row's k "
                          f"tokens are chosen among all n); serve it with tensor_parallel_size 1 "
                          f"or without top-k")
    if num_tokens % world_size:
        raise ConfigError(f"{name}: {num_tokens} parameter tokens do not split evenly over "
                          f"tensor_parallel_size {world_size}")


def check_shardable(layer: Pattention, world_size: int, name: str = "Pattention") -> None:
    """:func:`check_split` for an existing layer."""
    check_split(name, layer.norm, layer.top_k, layer.num_tokens, world_size)


class ShardedPattention(nn.Module):
    """Rank ``rank``'s share (n/W tokens) of a Pattention of n tokens; ``forward`` returns the
    whole layer's output on every rank. Parameters are named as :class:`Pattention`'s, holding
    only this rank's rows; :meth:`shard` cuts them from a full tensor (loading a checkpoint)."""

    def __init__(self, in_features: int, out_features: int, num_tokens: int, norm: str, *,
                 scale: float, eps: float, rank: int, world_size: int, all_reduce: AllReduce,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_split("Pattention", norm, None, num_tokens, world_size)
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not one of 0..{world_size - 1}")
        self.in_features, self.out_features, self.norm = in_features, out_features, norm
        self.scale, self.eps = float(scale), float(eps)
        self.rank, self.world_size = rank, world_size
        self.total_tokens = num_tokens
        self.all_reduce = all_reduce
        local = num_tokens // world_size
        self.start, self.stop = rank * local, (rank + 1) * local
        factory = {"device": device, "dtype": dtype}
        self.key_param_tokens = nn.Parameter(torch.empty(local, in_features, **factory),
                                             requires_grad=False)
        self.value_param_tokens = nn.Parameter(torch.empty(local, out_features, **factory),
                                               requires_grad=False)

    @classmethod
    def from_pattention(cls, layer: Pattention, rank: int, world_size: int,
                        all_reduce: AllReduce) -> ShardedPattention:
        """This rank's share of an existing (unsharded) layer: same Θ, factor and ε, its rows
        of K_P and V_P copied."""
        check_shardable(layer, world_size)
        key = layer.key_param_tokens
        sharded = cls(layer.in_features, layer.out_features, layer.num_tokens, layer.norm,
                      scale=layer.scale, eps=layer.eps, rank=rank, world_size=world_size,
                      all_reduce=all_reduce, device=key.device, dtype=key.dtype)
        with torch.no_grad():
            sharded.key_param_tokens.copy_(sharded.shard(key))
            sharded.value_param_tokens.copy_(sharded.shard(layer.value_param_tokens))
        return sharded

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full [n, ·] key or value tensor."""
        if full.shape[0] != self.total_tokens:
            raise ConfigError(f"a parameter-token tensor of {full.shape[0]} rows does not fit a "
                              f"Pattention of {self.total_tokens} tokens")
        return full[self.start:self.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = F.linear(x, self.key_param_tokens)  # this rank's n/W columns
        theta_ = SHARDED_THETAS[self.norm](scores, self.all_reduce, self.scale, self.eps)
        return self.all_reduce(torch.matmul(theta_, self.value_param_tokens))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tokens={self.start}..{self.stop - 1} of {self.total_tokens}, "
                f"norm={self.norm!r}, scale={self.scale:.6g}, rank={self.rank}/{self.world_size}")


def all_reduce_sum(group: object | None = None) -> AllReduce:
    """The collective of plain ``torch.distributed`` (any backend, gloo on CPUs): sums a tensor
    over the ranks of ``group`` (default: the whole world) in place and returns it."""
    import torch.distributed as dist  # absent from builds without distributed support

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    return reduce
