"""The losses read back from the device every few steps instead of every step.

Reading a loss (``float(loss)``) makes the host wait for the device: on a GPU, the step's kernels
have all run before the next step's are queued, so the device idles while the host prepares
them. Here a step's loss and gradient norm stay on the device
(:func:`.step.train_step`); :class:`Readback` holds them and reads a window of up to ``every``
steps in one transfer, then emits each step's record as the loop did when it read every step.

What stays exactly as it was:

* the records: each step's loss, gradient norm, learning rate, tokens and FLOPs, in the same
  order among the eval and grow records (the loop reads back before a growth, an evaluation and a
  checkpoint, and at the end);
* divergence: the first non-finite loss stops the run with the same :class:`DivergedError`,
  after that step's record and before anything later is recorded, evaluated or saved. The
  device may have computed up to ``every - 1`` further steps by then (they cannot be known to
  follow a divergence without a read); their records are dropped and nothing of them is written;
* callbacks see each record with the model right after its step: with callbacks (the frontier's
  growth diagnostics, a benchmark's barrier) the loop reads back every step unless told
  otherwise.

What is measured differently: the steps of one window share its time evenly (``train_time``,
``tokens_per_s``), the window's end being when the device finished; their ``elapsed`` are spaced
evenly over it. On the CPU the step is done when it returns, so reading back costs nothing and
happens every step: each step's time is its own, as before.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import DivergedError
from .recording import Callback, Recorder

READBACK_STEPS = 16  # steps between read-backs where the device runs ahead of the host


def readback_steps(device: torch.device, callbacks: Sequence[Callback]) -> int:
    """The steps between read-backs of a run on ``device``: 1 on the CPU and when ``callbacks``
    are given (module docstring), else :data:`READBACK_STEPS`."""
    return 1 if device.type == "cpu" or callbacks else READBACK_STEPS


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run everything queued (a no-op where work is synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Step:
    done: int  # steps done after it
    loss: torch.Tensor  # 0-d, on the device
    lr: float
    grad_norm: torch.Tensor | None  # 0-d, on the device; None without clipping
    tokens: int
    flops: float
    started: float  # time.perf_counter() when the step began


class Readback:
    """A run's steps whose losses are not read yet; :meth:`flush` reads and records them.
    ``diverged(loss, done)`` is the :class:`DivergedError` line of a non-finite loss after
    ``done`` steps."""

    def __init__(self, recorder: Recorder, every: int, device: torch.device,
                 diverged: Callable[[float, int], str]) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"readback must be a whole number of steps >= 1, got {every!r}")
        self.recorder, self.every, self.device, self.diverged = recorder, every, device, diverged
        self.pending: list[_Step] = []

    def add(self, done: int, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor | None,
            tokens: int, flops: float, started: float, model: nn.Module) -> None:
        """Hold one step's values; read back when ``every`` steps are held."""
        self.pending.append(_Step(done, loss, lr, grad_norm, tokens, flops, started))
        if len(self.pending) >= self.every:
            self.flush(model)

    def flush(self, model: nn.Module) -> None:
        """Read the held steps back in one transfer and record each (``model``: what callbacks
        see); :class:`DivergedError` at the first non-finite loss, recording nothing after it."""
        if not self.pending:
            return
        window, self.pending = self.pending, []
        synchronize(self.device)
        norms = [s.grad_norm for s in window if s.grad_norm is not None]
        values = torch.stack([t.detach().to(torch.float64)
                              for t in [s.loss for s in window] + norms]).tolist()
        end = time.perf_counter()
        losses, read_norms = values[:len(window)], iter(values[len(window):])
        share = (end - window[0].started) / len(window)
        for i, (step, loss) in enumerate(zip(window, losses, strict=True)):
            grad_norm = next(read_norms) if step.grad_norm is not None else None
            self.recorder.train(step.done, loss, step.lr, grad_norm, step.tokens, step.flops,
                                share, model, at=window[0].started + (i + 1) * share)
            if not math.isfinite(loss):
                raise DivergedError(self.diverged(loss, step.done))
            self.recorder.show(loss, step.lr, step.tokens / share)

    def flush_after_error(self, model: nn.Module) -> None:
        """:meth:`flush` while an error stops the run: the records of the steps done are kept,
        and a divergence among them, which came first, is the error raised."""
        try:
            self.flush(model)
        except DivergedError as exc:
            raise exc from None
        except Exception:
            pass  # the device failed too: the error being raised says how
