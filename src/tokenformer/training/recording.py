"""A run's records: the counters (tokens, FLOPs, time), every train/eval/grow record kept for the
result, appended to ``metrics.jsonl`` (and TensorBoard) and shown to the callbacks, and the
progress bar."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ..io.metrics import MetricsLog
from ..io.process_group import World
from ..io.progress import progress_bar

if TYPE_CHECKING:
    from .config import TrainConfig

METRICS = "metrics.jsonl"  # the run folder's log, one JSON record per line
COUNTERS = ("tokens", "flops", "train_time", "elapsed")
Callback = Callable[[dict[str, Any], nn.Module], None]


class Recorder:
    """The counters and records of one ``fit`` call. With ``run_dir`` (rank 0 only) records go to
    its ``metrics.jsonl``, cut back to ``start_step`` when ``resumed``; the bar shows on rank 0."""

    def __init__(self, cfg: TrainConfig, world: World, *, run_dir: Path | None,
                 start_step: int, resumed: bool, counters: dict[str, Any] | None,
                 callbacks: Sequence[Callback], progress: bool | None) -> None:
        self.counters: dict[str, Any] = (dict(counters) if counters is not None else
                                         {"tokens": 0, "flops": 0.0, "train_time": 0.0,
                                          "elapsed": 0.0})
        self.records: list[dict[str, Any]] = []
        self.losses: list[float] = []
        self.callbacks = callbacks
        if run_dir is not None and resumed and world.is_main:
            MetricsLog.truncate(run_dir / METRICS, start_step)
        self.log = None
        if run_dir is not None and world.is_main:
            self.log = MetricsLog(run_dir / METRICS, run_dir / "tensorboard" if cfg.tensorboard
                                  else None)
        self.bar = None
        if world.is_main:  # a bar on a terminal, plain lines in a log, nothing if progress=False
            self.bar = progress_bar(cfg.steps, "train", progress=progress, unit="step",
                                    initial=start_step)
        self.wall_start = time.perf_counter()

    def start(self) -> None:
        """The wall clock of ``elapsed`` starts now (continuing a resumed run's)."""
        self.wall_start = time.perf_counter() - self.counters["elapsed"]

    def emit(self, record: dict[str, Any], model: nn.Module) -> None:
        """Keep ``record``, log it and show it to the callbacks with the current model."""
        self.records.append(record)
        if self.log is not None:
            self.log.append(record)
        for callback in self.callbacks:
            callback(record, model)

    def train(self, step: int, loss: float, lr: float, grad_norm: float | None, tokens: int,
              flops: float, seconds: float, model: nn.Module, at: float | None = None) -> None:
        """Count one optimizer step and emit its record (``step`` = steps done; ``at``: the
        ``time.perf_counter()`` it ended at, default now)."""
        self.counters["tokens"] += tokens
        self.counters["flops"] += flops
        self.counters["train_time"] += seconds
        self.counters["elapsed"] = (time.perf_counter() if at is None else at) - self.wall_start
        self.losses.append(loss)
        self.emit({"type": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                   **self.counters, "tokens_per_s": tokens / seconds,
                   "flops_per_s": flops / seconds}, model)

    def show(self, loss: float, lr: float, tokens_per_s: float) -> None:
        """Advance the bar by one step."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}",
                                 refresh=False)

    def evaluation(self, step: int, metrics: dict[str, float], model: nn.Module) -> None:
        """Emit an evaluation's record and print its metrics above the bar."""
        self.emit({"type": "eval", "step": step, **metrics, **self.counters}, model)
        if self.bar is not None:
            self.bar.write(f"step {step}: " + "  ".join(f"{k} {v:.4f}"
                                                        for k, v in metrics.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.log is not None:
            self.log.close()
