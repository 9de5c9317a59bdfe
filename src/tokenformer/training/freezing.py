"""Frozen old tokens: after a growth with ``freeze_old``, the parameter tokens the growth kept
receive no update for a stated number of steps, or for ever.

"No update" means bitwise unchanged, which zeroing their gradients alone does not give with
AdamW: decoupled weight decay still shrinks every row (p ← p·(1 − lr·wd)), and carried moments
keep moving a row whose gradient is zero (m/√v ≠ 0). So :class:`FrozenRows` keeps a copy of the
frozen rows of each parameter *and of its optimizer moments*, taken when the freeze starts, and
each step

1. zeroes the gradient of the frozen rows after the backward pass, so gradient clipping measures
   only what trains;
2. lets the optimizer step every parameter whole (one fused/foreach AdamW over unsplit tensors);
3. writes the saved rows back into the parameter and into every state tensor shaped like it
   (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``).

So while frozen the rows neither move nor accumulate or decay moments: when the freeze ends they
continue from the moments they had at the growth (zero after a reset optimizer), not from moments
inflated or decayed by steps they did not take. Only the optimizer's per-tensor ``step`` count
advances (it is shared with the unfrozen rows); AdamW's bias corrections are ≈ 1 by then.
The copy costs the frozen rows' size three times over (weights and two moments) while it lasts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..ops.growth import FOREVER, old_tokens


@dataclass
class FrozenRows:
    """The first ``rows[name]`` rows of parameter ``name`` frozen until step ``until`` (the first
    step they train again; None: for ever). :meth:`attach` before use."""

    rows: dict[str, int]
    until: int | None
    _saved: list[tuple[nn.Parameter, int, torch.Tensor, dict[str, torch.Tensor]]] = field(
        default_factory=list, repr=False)
    _optimizer: torch.optim.Optimizer | None = field(default=None, repr=False)

    @classmethod
    def after_growth(cls, model: nn.Module, step: int) -> FrozenRows | None:
        """The freeze the growth that made ``model`` asked for (``freeze_old``), starting at
        ``step``; None when it asked for none."""
        record = old_tokens(model)
        if record is None or record.freeze is None:
            return None
        until = None if record.freeze == FOREVER else step + int(record.freeze)
        return cls(dict(record.rows), until)

    def active(self, step: int) -> bool:
        return self.until is None or step < self.until

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> FrozenRows:
        """Save the frozen rows of ``model``'s parameters and of ``optimizer``'s moments as they
        are now (at the growth, or on resume: unchanged since)."""
        params = dict(model.named_parameters())
        missing = sorted(set(self.rows) - set(params))
        if missing:
            raise ConfigError(f"frozen rows name parameter {missing[0]!r}, which the model "
                              f"does not have")
        self._optimizer, self._saved = optimizer, []
        for name, n in self.rows.items():
            param = params[name]
            moments = {k: v[:n].clone() for k, v in optimizer.state.get(param, {}).items()
                       if torch.is_tensor(v) and v.shape == param.shape}
            self._saved.append((param, n, param.detach()[:n].clone(), moments))
        return self

    def zero_grads(self) -> None:
        """Before clipping and the optimizer step: the frozen rows contribute no gradient."""
        for param, n, _, _ in self._saved:
            if param.grad is not None:
                param.grad[:n] = 0

    @torch.no_grad()
    def restore(self) -> None:
        """After the optimizer step: the frozen rows and their moments as saved (moments the
        optimizer created after the freeze started are zero there)."""
        assert self._optimizer is not None, "attach() first"
        for param, n, weights, moments in self._saved:
            param[:n] = weights
            for key, value in self._optimizer.state.get(param, {}).items():
                if torch.is_tensor(value) and value.shape == param.shape:
                    if key in moments:
                        value[:n] = moments[key]
                    else:
                        value[:n] = 0

    def to_state(self) -> dict[str, Any]:
        """What a checkpoint saves (JSON): the rows and the end step."""
        return {"rows": dict(self.rows), "until": self.until}

    @classmethod
    def from_state(cls, data: Any, where: str) -> FrozenRows:
        """The freeze a checkpoint saved (:meth:`to_state`); CheckpointError if malformed."""
        if not (isinstance(data, dict) and isinstance(data.get("rows"), dict)
                and all(isinstance(k, str) and _count(v) for k, v in data["rows"].items())
                and (data.get("until") is None or _count(data.get("until")))):
            raise CheckpointError(f"{where}: frozen_rows is malformed (expected rows: "
                                  f"{{name: count}} and until: a step or null); resume from an "
                                  f"earlier checkpoint or restore the file")
        return cls(dict(data["rows"]), data.get("until"))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
