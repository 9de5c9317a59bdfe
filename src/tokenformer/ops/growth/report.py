"""What a growth changed, measured: the logits of the model before and after it."""

from __future__ import annotations

import torch
from torch import nn


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
