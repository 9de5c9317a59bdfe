"""The Θ backends: what computes a Pattention once :func:`tokenformer.nn.kernels.dispatch.
select_impl` has chosen, one object each in :data:`BACKENDS`, all of one shape,
:class:`ThetaBackend`.

================  ===========================================================================
backend           what runs
================  ===========================================================================
``reference``     ``theta()`` (``nn/theta.py``) under plain autograd: the ground truth
``reference_vt``  the same, with a bf16/fp16 layer's V stored column by column on the CPU
                  (:func:`inference_value`): ``auto``'s inference where no kernel applies
``fused``         one autograd Function with an analytic backward (``fused.py``)
``cpu_kernel``    that Function with Θ from the C++ CPU kernel (``cpu_theta.py``); at inference
                  one C++ pass between two matmuls
``triton``        Θ as Triton custom ops, the matmuls from torch (``triton_theta.py``)
================  ===========================================================================

A backend answers whether it covers a call (``available``), readies itself for ``torch.compile``
(``prepare``), and computes Θ alone (``theta``, ``theta_segments``: top-k and the one-GEMM Q/K/V
of :mod:`tokenformer.nn.grouped`) or the whole Pattention (``pattention``). Every method that
computes takes the layer (its ``norm``, ``scale``, ``eps`` and own value tokens) and whether
autograd records the call (``training``, what :func:`select_impl` was told), so a layer's
``attend`` is one call to whichever backend was chosen. Adding one: docs/architecture.md,
"Adding a Θ backend".
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from ..theta import theta
from . import cpu_theta, triton_theta
from .fused import fused_pattention


class ThetaSettings(Protocol):
    """What a backend reads of a layer (a :class:`~tokenformer.nn.pattention.Pattention`)."""

    norm: str
    scale: float
    eps: float
    value_param_tokens: torch.Tensor


@runtime_checkable
class ThetaBackend(Protocol):
    """One way to compute a Pattention ``Θ(x·keysᵀ)·values`` (module docstring)."""

    name: str  # its key in BACKENDS, what select_impl's callers record

    def available(self, device: torch.device, dtype: torch.dtype, norm: str, *,
                  warn: bool) -> bool:
        """Whether it computes Θ ``norm`` for scores on ``device`` in ``dtype`` here (built,
        installed). ``warn``: the layer's impl names this backend, so when it cannot run a call
        it was asked for, it says so once (a TokenFormerWarning) before the fallback runs."""
        ...

    def prepare(self) -> None:
        """Do now what ``torch.compile``'s tracing cannot do when it first reaches this backend
        (register ops, build a kernel); idempotent."""
        ...

    def theta(self, scores: torch.Tensor, layer: ThetaSettings, training: bool) -> torch.Tensor:
        """Θ of ``scores`` [..., n] with ``layer``'s settings, row-wise over the last dimension."""
        ...

    def theta_segments(self, scores: torch.Tensor, groups: int, layer: ThetaSettings,
                       training: bool) -> torch.Tensor:
        """Θ of each of the ``groups`` equal segments of every row of ``scores`` [rows, groups·n],
        as [groups, rows, n] (the layout a batched value product reads): here Θ over the scores'
        [rows, groups, n] view, handed over transposed (a strided view, nothing copied)."""
        rows, n = scores.shape[0], scores.shape[1] // groups
        return self.theta(scores.view(rows, groups, n), layer, training).transpose(0, 1)

    def pattention(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   layer: ThetaSettings, training: bool) -> torch.Tensor:
        """``Θ(x·keysᵀ)·values`` for ``x`` [..., d_in] with ``layer``'s Θ settings."""
        ...


def inference_value(value: torch.Tensor, layer: ThetaSettings) -> torch.Tensor:
    """V for a matmul autograd does not record. In bf16/fp16, the CPU's matrix-vector kernels are
    1.3–1.5x faster for Θ·V when V [n, d_out] is stored column by column (Vᵀ contiguous,
    nn.Linear's layout; docs/performance.md, "Inference"): the first such call changes the
    parameter's memory layout to that, in place. Same values, shape and size; fp32 (where it makes
    no difference) and tokens that are not ``layer``'s own parameter are left alone. Training
    never calls it: the parameter stays a normal one in its usual layout there."""
    if (value is layer.value_param_tokens and value.dtype in (torch.bfloat16, torch.float16)
            and value.device.type == "cpu" and value.dim() == 2 and min(value.shape) > 1
            and value.stride(1) == 1
            and not torch.compiler.is_compiling()):
        with torch.inference_mode(False), torch.no_grad():
            value.data = value.t().contiguous().t()
    return value


class Reference(ThetaBackend):
    """``theta()`` under plain autograd: the readable ground truth every other backend is tested
    against; it covers every Θ, including one registered with its formula alone."""

    name = "reference"

    def available(self, device: torch.device, dtype: torch.dtype, norm: str, *,
                  warn: bool) -> bool:
        return True

    def prepare(self) -> None:
        pass

    def theta(self, scores: torch.Tensor, layer: ThetaSettings, training: bool) -> torch.Tensor:
        return theta(scores, layer.norm, layer.scale, layer.eps)

    def pattention(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   layer: ThetaSettings, training: bool) -> torch.Tensor:
        return torch.matmul(self.theta(torch.matmul(x, keys.t()), layer, training), values)


class ReferenceVt(Reference):
    """The reference, with a bf16/fp16 layer's V re-laid-out column by column on the CPU at
    inference (:func:`inference_value`): ``auto``'s inference path where the C++ kernel does not
    apply. ``torch`` runs the plain reference, keeping the layout, so that it reproduces the
    documented experiments bit for bit."""

    name = "reference_vt"

    def pattention(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   layer: ThetaSettings, training: bool) -> torch.Tensor:
        values = values if training else inference_value(values, layer)
        return super().pattention(x, keys, values, layer, training)


class Fused(Reference):
    """:class:`~tokenformer.nn.kernels.fused.PattentionFunction`: Θ in few passes, an analytic
    backward that saves almost nothing; Θ alone is the reference formula (what autograd records
    for top-k and the one-GEMM Q/K/V). For Θs with fused closed forms (select_impl checks)."""

    name = "fused"

    def pattention(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   layer: ThetaSettings, training: bool) -> torch.Tensor:
        return fused_pattention(x, keys, values, layer.norm, layer.scale, layer.eps)


class CpuKernel(ThetaBackend):
    """The C++ CPU kernel (``l2_norm_gelu``, float32/bf16/fp16): in training and under autocast
    the fused Function with Θ from it; at inference one C++ pass between two matmuls, as few
    Python steps as possible (decoding: one row per call)."""

    name = "cpu_kernel"

    def available(self, device: torch.device, dtype: torch.dtype, norm: str, *,
                  warn: bool) -> bool:
        if warn:
            return cpu_theta.supports(device, dtype, norm)
        return cpu_theta.usable(device, dtype, norm)

    def prepare(self) -> None:
        cpu_theta.available()  # builds or loads it: a decision made mid-trace breaks graphs

    def theta(self, scores: torch.Tensor, layer: ThetaSettings, training: bool) -> torch.Tensor:
        if training or torch.is_autocast_enabled(scores.device.type):
            return theta(scores, layer.norm, layer.scale, layer.eps)
        rows = scores.reshape(-1, scores.shape[-1]).contiguous()  # a segment's rows are strided
        return cpu_theta.theta_forward(rows, layer.scale, layer.eps)[0].view(scores.shape)

    def pattention(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   layer: ThetaSettings, training: bool) -> torch.Tensor:
        if training or torch.is_autocast_enabled(x.device.type):
            return fused_pattention(x, keys, values, layer.norm, layer.scale, layer.eps,
                                    kernel=True)
        theta_ = self.theta(F.linear(x, keys), layer, training)
        return torch.matmul(theta_, inference_value(values, layer))


class Triton(ThetaBackend):
    """Θ from the Triton kernels (every built-in Θ, CUDA, or the CPU under Triton's interpreter),
    forward and backward as custom ops; the matmuls from torch."""

    name = "triton"

    def available(self, device: torch.device, dtype: torch.dtype, norm: str, *,
                  warn: bool) -> bool:
        if warn:
            return triton_theta.supports(device, dtype, norm)
        return triton_theta.available() and triton_theta.covers(device, dtype, norm)

    def prepare(self) -> None:
        triton_theta.prepare()  # registers the ops: tracing cannot

    def theta(self, scores: torch.Tensor, layer: ThetaSettings, training: bool) -> torch.Tensor:
        return triton_theta.theta(scores, layer.norm, layer.scale, layer.eps)

    def theta_segments(self, scores: torch.Tensor, groups: int, layer: ThetaSettings,
                       training: bool) -> torch.Tensor:
        # the kernels write Θ segment-major themselves: contiguous, and dS in the scores' layout
        return triton_theta.theta_segments(scores, groups, layer.norm, layer.scale, layer.eps)

    def pattention(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   layer: ThetaSettings, training: bool) -> torch.Tensor:
        return triton_theta.pattention(x, keys, values, layer.norm, layer.scale, layer.eps)


# Every backend under its name: select_impl's rules (dispatch.IMPLS) name them from here.
BACKENDS: dict[str, ThetaBackend] = {backend.name: backend for backend in (
    Reference(), ReferenceVt(), Fused(), CpuKernel(), Triton())}
