"""What a growth changed: the logits of the model before and after it, measured, and its sizes
before and after, described."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...models.config import flops_per_token


@torch.no_grad()
def max_logit_change(before: nn.Module, after: nn.Module, *, batch_size: int = 2,
                     seq_len: int = 32, seed: int = 0) -> tuple[float, float]:
    """(max |Δlogit|, max |logit|) of two language models on a fixed random probe batch."""
    config = before.config
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch_size, min(seq_len, config.max_seq_len)),
                        generator=generator)
    device = next(before.parameters()).device
    a = before(ids.to(device)).logits.double()
    b = after(ids.to(next(after.parameters()).device)).logits.double().to(device)
    return float((a - b).abs().max()), float(a.abs().max())


def size_lines(before: Any, after: Any, seq_len: int | None = None) -> list[str]:
    """Shape, parameters and FLOPs per token of a model before and after a growth, one line each
    (``tokenformer grow`` and ``tokenformer info --grow``); any LM config, TokenFormer or
    baseline."""
    def change(a: Any, b: Any) -> str:
        return f"{a} -> {b}" if a != b else f"{a}"

    shape = [("layers", "num_layers"), ("hidden", "hidden_size"), ("heads", "num_heads")]
    shape += ([("qkv", "qkv_tokens"), ("proj", "proj_tokens"), ("ffn", "ffn_tokens")]
              if hasattr(before, "qkv_tokens") else [("mlp", "intermediate_size")])
    lines = ["shape        " + "   ".join(
        f"{label} {change(getattr(before, key), getattr(after, key))}" for label, key in shape)]
    n0, n1 = before.num_parameters(), after.num_parameters()
    lines.append(f"parameters   {n0:,} -> {n1:,} (x{n1 / n0:.3g})")
    for mode, training in (("forward", False), ("training", True)):
        f0 = flops_per_token(before, seq_len, training)["total"]
        f1 = flops_per_token(after, seq_len, training)["total"]
        lines.append(f"FLOPs/token  {f0:.4g} -> {f1:.4g} {mode} (x{f1 / f0:.3g}, context "
                     f"{seq_len or before.max_seq_len})")
    return lines
