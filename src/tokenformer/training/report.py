"""The end of a language-model run: the summary line (steps, tokens, FLOPs, time, validation
metrics), the corpus's unigram entropy to compare with, and seeded text samples."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..data.datasets import unigram_entropy
from ..io.run_folders import FINAL

if TYPE_CHECKING:
    from .config import TrainConfig
    from .loop import FitResult


def report(result: FitResult, dataset: Any, cfg: TrainConfig,
           print_fn: Callable[[str], None]) -> None:
    """Print the summary line, the corpus's unigram entropy against the final validation loss,
    where the model is, and the samples."""
    final = result.final_eval
    ln2_bpt = math.log(2) * dataset.bytes_per_token("val")
    entropy = unigram_entropy(dataset, "train")
    line = (f"done: {result.step} steps, {result.tokens:,} tokens, {result.flops:.3e} FLOPs, "
            f"{result.elapsed:.1f} s ({result.tokens / max(result.train_time, 1e-9):,.0f} "
            f"tokens/s)")
    if final is not None:
        line += (f"; val loss {final['val_loss']:.4f} nats/token, ppl {final['val_ppl']:.2f}, "
                 f"{final['val_bpb']:.4f} bits/byte")
    print_fn(line)
    print_fn(f"unigram entropy of the corpus: {entropy:.4f} nats/token "
             f"({entropy / ln2_bpt:.4f} bits/byte); final val loss "
             + (f"{final['val_loss']:.4f} nats/token" if final else "n/a"))
    print_fn(f"model and optimizer: {result.run_dir / FINAL}")
    if cfg.samples:
        for i, text in enumerate(sample(result.model, dataset.tokenizer, cfg)):
            print_fn(f"--- sample {i + 1} ---\n{text}")


def sample(model: nn.Module, tokenizer: Any, cfg: TrainConfig) -> list[str]:
    """``cfg.samples`` continuations of ``cfg.sample_prompt`` (seeded: reproducible)."""
    ids = tokenizer.encode(cfg.sample_prompt) or [tokenizer.eos_token_id or 0]
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    model.eval()
    prompt = torch.tensor([ids] * cfg.samples, device=device)
    out = model.generate(prompt, cfg.sample_tokens, do_sample=cfg.temperature > 0,
                         temperature=cfg.temperature or 1.0, generator=generator)
    return [tokenizer.decode(row.tolist()) for row in out]
