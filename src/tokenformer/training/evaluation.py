"""Evaluation inside a run: the steps that evaluate, ``eval_fn`` run in eval mode without gradients
(under the run's autocast), and the language model's validation metrics."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .config import TrainConfig

EvalFn = Callable[[nn.Module], dict[str, float]]


class Evaluation:
    """A run's ``eval_fn`` and its schedule: every ``eval_interval`` steps, at ``eval_at``, at the
    offsets ``eval_after_growth`` after each growth, and at the end."""

    def __init__(self, eval_fn: EvalFn | None, cfg: TrainConfig, growth_steps: Sequence[int],
                 autocast: Callable[[], AbstractContextManager]) -> None:
        self.eval_fn = eval_fn
        self.interval = cfg.eval_interval
        self.steps = {cfg.steps, *cfg.eval_at,
                      *(g + o for g in growth_steps for o in cfg.eval_after_growth)}
        self.autocast = autocast

    def due(self, step: int) -> bool:
        """Whether the run evaluates after ``step`` steps."""
        return self.eval_fn is not None and (step in self.steps or bool(
            self.interval and step % self.interval == 0))

    def __call__(self, model: nn.Module) -> dict[str, float]:
        """``eval_fn(model)`` in eval mode, no gradients, the run's precision; the model's mode
        is restored after."""
        was_training = model.training
        model.eval()
        with torch.no_grad(), self.autocast():
            metrics = self.eval_fn(model)
        model.train(was_training)
        return {k: float(v) for k, v in metrics.items()}


def lm_evaluator(dataset: Any, seq_len: int, batch_size: int, max_batches: int | None,
                 device: torch.device) -> EvalFn:
    """Validation loss (nats/token), perplexity and bits per byte over fixed, evenly spread
    windows of the held-out split (``max_batches`` None: every window, the whole split)."""
    windows = list(dataset.eval_windows("val", seq_len, batch_size, max_batches=max_batches))
    bytes_per_token = dataset.bytes_per_token("val")

    def evaluate(model: nn.Module) -> dict[str, float]:
        total, count = 0.0, 0
        for ids in windows:
            ids = ids.to(device)
            loss = model(input_ids=ids, labels=ids).loss
            n = ids.shape[0] * (ids.shape[1] - 1)
            total += float(loss) * n
            count += n
        loss = total / count
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
                "val_bpb": loss / math.log(2) / bytes_per_token}

    return evaluate
