"""Which backend computes a Pattention: the one place that decides it.

A Pattention's ``impl`` is one of :data:`IMPLS`, each a rule: for a call that autograd records
(training) and for one it does not (inference), the backends of
:data:`~tokenformer.nn.kernels.backends.BACKENDS` to try in order. :func:`select_impl` runs the
first that covers the call (device, dtype, Θ; built or installed); the last covers every call.
:meth:`tokenformer.nn.pattention.Pattention.attend` runs what it returns. The rules, as the table
below writes them:

=============  ======================================  ===================================
impl           training                                inference
=============  ======================================  ===================================
``auto``       cpu_kernel, fused, (reference)          cpu_kernel, reference_vt
``fused``      fused, (reference)                      fused, (reference)
``reference``  reference                               reference
``kernel``     cpu_kernel!, fused, (reference)         cpu_kernel!, fused, (reference)
``torch``      fused, (reference)                      reference
``triton``     triton!, fused, (reference)             triton!, fused, (reference)
=============  ======================================  ===================================

* ``!``: the impl names that backend (``named``): where it cannot run a call it would cover
  (not built, not installed; for Triton also a device or dtype it has no kernels for), one
  warning says so before the fallback runs; choosing the impl readies that backend
  (:func:`choose_impl`). ``auto`` takes the C++ kernel silently where it is built.
* In parentheses: reached only by a Θ without fused closed forms (``THETAS[norm].fused is
  None``, e.g. one registered with its reference formula alone), which has no fast path: it runs
  the last backend of the list, silently, whatever ``impl`` says.
* ``auto`` (the default) never picks Triton (its speed is unmeasured, docs/performance.md); on a
  GPU it runs ``fused`` in training and the reference at inference (at a few rows per call, as in
  decoding, the Function's per-call overhead outweighs the pass it saves). ``torch`` is ``auto``
  without the C++ kernel and without the bf16 value layout: what the documented experiments ran
  with, bit for bit.

What each backend covers is in the Θ's row of :data:`tokenformer.nn.theta.THETAS` (``fused``,
``cpu_kernel``, ``triton``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import ConfigError
from ..theta import THETAS
from . import cpu_theta
from .backends import BACKENDS, ThetaBackend


@dataclass(frozen=True)
class Impl:
    """One value of a Pattention's ``impl``: the backends it tries, in order, for a call that
    autograd records and for one it does not; ``named``: it asks for its first backend by name
    (module docstring)."""

    training: tuple[str, ...]
    inference: tuple[str, ...]
    named: bool = False


# The rules (module docstring), in the order the choices are listed to users.
IMPLS: dict[str, Impl] = {
    "auto": Impl(training=("cpu_kernel", "fused", "reference"),
                 inference=("cpu_kernel", "reference_vt")),
    "fused": Impl(training=("fused", "reference"), inference=("fused", "reference")),
    "reference": Impl(training=("reference",), inference=("reference",)),
    "kernel": Impl(training=("cpu_kernel", "fused", "reference"),
                   inference=("cpu_kernel", "fused", "reference"), named=True),
    "torch": Impl(training=("fused", "reference"), inference=("reference",)),
    "triton": Impl(training=("triton", "fused", "reference"),
                   inference=("triton", "fused", "reference"), named=True),
}
DEFAULT_IMPL = "auto"


def select_impl(impl: str, device: torch.device, dtype: torch.dtype, norm: str, *,
                training: bool) -> ThetaBackend:
    """The backend (of :data:`~tokenformer.nn.kernels.backends.BACKENDS`) that computes a
    Pattention set to ``impl`` on scores of ``device`` and ``dtype`` with Θ ``norm``;
    ``training``: autograd records the call. The rule is ``impl``'s row of :data:`IMPLS`."""
    rule = IMPLS[impl]
    order = rule.training if training else rule.inference
    variant = THETAS.get(norm)  # unknown: the last (a reference), whose theta() names the choices
    if variant is not None and variant.fused is not None:  # else no fast path: the last
        for position, name in enumerate(order[:-1]):
            backend = BACKENDS[name]
            if backend.available(device, dtype, norm, warn=rule.named and position == 0):
                return backend
    return BACKENDS[order[-1]]


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ConfigError(f"unknown Pattention impl {impl!r}; choose one of "
                          f"{', '.join(IMPLS)}")


def prepare_impl(impl: str) -> None:
    """Do now, for every backend ``impl`` may run, what ``torch.compile``'s tracing cannot
    (:meth:`ThetaBackend.prepare`: build the C++ kernel, register the Triton ops): the trainer
    calls it before compiling."""
    check_impl(impl)
    rule = IMPLS[impl]
    for name in dict.fromkeys((*rule.training, *rule.inference)):
        BACKENDS[name].prepare()


def choose_impl(impl: str) -> str:
    """``impl`` checked (ConfigError naming the choices) and, when it names a backend
    (``kernel``, ``triton``), that backend readied (:func:`prepare_impl`), so that a
    ``torch.compile`` right after traces it: what setting a Pattention's ``impl`` does. ``auto``
    readies nothing: it would build the C++ kernel (≈ 15 s once per machine) on machines that
    never run a Pattention on the CPU; the trainer readies it before compiling."""
    check_impl(impl)
    if IMPLS[impl].named:
        prepare_impl(impl)
    return impl


def describe_impl(impl: str) -> str:
    """``impl`` in words, as a run's results record it: ``auto`` with what it resolves to on this
    machine (whether the C++ kernel is built), any other as its name."""
    if impl != DEFAULT_IMPL:
        return impl
    if cpu_theta.available():
        return "auto (C++ Θ kernel for l2_norm_gelu on the CPU, fused elsewhere)"
    return (f"auto (fused in training, reference in evaluation: the C++ kernel is unavailable, "
            f"{cpu_theta.unavailable_reason()})")
