"""Which implementation computes a Pattention: the one place that decides it.

:func:`select_impl` maps a layer's ``impl`` setting and a call's device, dtype, Θ and whether
autograd records it to one of :data:`BACKENDS`; :meth:`tokenformer.nn.pattention.Pattention.attend`
runs what it says. The backends live beside this module:

===============  =================================================  ============================
backend          what runs                                          module
===============  =================================================  ============================
``reference``    ``theta()`` under plain autograd (the ground truth)  ``nn/theta.py``
``fused``        one autograd Function, analytic backward, PyTorch  ``nn/kernels/fused.py``
``cpu_kernel``   the fused Function with Θ from the C++ CPU kernel  ``nn/kernels/cpu_theta.py``
``triton``       Θ as Triton custom ops, the matmuls from torch     ``nn/kernels/triton_theta.py``
===============  =================================================  ============================

What runs on a GPU: ``auto`` (the default) runs ``fused`` when autograd records the call and
``reference`` otherwise; ``impl="triton"`` runs the Triton Θ (opt-in: its speed has not been
measured on a GPU yet, docs/performance.md). On the CPU ``auto`` runs the C++ kernel for
``l2_norm_gelu`` in float32/bf16/fp16 wherever it can be built.

What each backend covers is in the Θ's row of :data:`tokenformer.nn.theta.THETAS` (``fused``,
``cpu_kernel``, ``triton``); a Θ without fused closed forms (one registered with its reference
formula alone) runs ``reference`` whatever ``impl`` asks.
"""

from __future__ import annotations

import torch

from ..theta import THETAS
from . import cpu_theta, triton_theta

BACKENDS: tuple[str, ...] = ("reference", "fused", "cpu_kernel", "triton")


def select_impl(impl: str, device: torch.device, dtype: torch.dtype, norm: str, *,
                training: bool) -> str:
    """The backend (one of :data:`BACKENDS`) that computes a Pattention set to ``impl`` on
    scores of ``device`` and ``dtype`` with Θ ``norm``; ``training``: autograd records the call.

    * ``reference``: always ``reference``.
    * ``triton``: ``triton`` where the Triton Θ covers the call (CUDA, or the CPU under Triton's
      interpreter; float32/bf16/fp16; every Θ) and triton is installed, else ``fused`` after one
      warning.
    * ``kernel``: ``cpu_kernel`` where the C++ kernel covers the call and can be built, else
      ``fused`` after one warning.
    * ``auto``: ``cpu_kernel`` where it covers the call and can be built (silently otherwise),
      else ``fused`` when training and ``reference`` when not (at a few rows per call, as in
      decoding, the Function's per-call overhead outweighs the pass it saves).
    * ``torch``: that last rule alone (``auto`` without the kernel), what the documented
      experiments ran with.
    * ``fused``: ``fused``.

    A Θ that has no fused closed forms (``THETAS[norm].fused is None``) has no fast path either:
    ``reference``, silently, whatever ``impl`` says.
    """
    variant = THETAS.get(norm)  # unknown: reference, whose theta() names the choices
    if impl == "reference" or variant is None or variant.fused is None:
        return "reference"
    if impl == "triton":
        return "triton" if triton_theta.supports(device, dtype, norm) else "fused"
    if impl == "auto" and cpu_theta.usable(device, dtype, norm):  # silent fallback
        return "cpu_kernel"
    if impl == "kernel" and cpu_theta.supports(device, dtype, norm):  # warns once
        return "cpu_kernel"
    return "fused" if training or impl in ("fused", "kernel") else "reference"
