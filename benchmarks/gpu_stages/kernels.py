"""What a torch.profiler profile says about kernels: the top-kernels table, device time split into
GEMMs, attention, the Triton Θ and the rest, and how many kernels and launches it holds.

On CUDA a "kernel" is a device event of the profile (CUPTI's record of a kernel run, also inside
a replayed CUDA graph), memory copies and sets excepted; a "launch" is a host call that starts
device work (``cudaLaunchKernel`` and its kin, or ``cudaGraphLaunch``: one per replayed graph).
On a CPU there are no device events: the ``aten::`` operators stand in for kernels (nested ones
counted too), so the smoke runs exercise the same code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from common import synchronized

# by name: cuBLAS (sm90_xmma_gemm_*, nvjet_*), CUTLASS, inductor's mm templates, CPU aten
GEMM = ("gemm", "xmma", "nvjet", "cutlass", "cublas", "wgmma", "matmul", "_mm", "::mm", "addmm",
        "bmm")
ATTENTION = ("flash", "fmha", "attention", "attn")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
            "cudaLaunchCooperativeKernel")
GRAPH_LAUNCH = "cudaGraphLaunch"


def profiled(fn: Callable[[], object], device: torch.device, cpu_ops: bool = True) -> Any:
    """One call of ``fn`` under torch.profiler: the profile. On CUDA its kernels and the host's
    runtime calls, and the host's operators unless not ``cpu_ops``; on a CPU the operators."""
    from torch.profiler import ProfilerActivity

    cuda = device.type == "cuda"
    activities = ([ProfilerActivity.CPU] if cpu_ops or not cuda else []) + (
        [ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        synchronized(fn, device)()
    return prof


def profile_table(prof: Any, device: torch.device, rows: int = 20) -> str:
    """The top ``rows`` operators and kernels of a profile by self device time (CPU time on a
    CPU): where the time goes."""
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def theta_kernel_names() -> tuple[str, ...]:
    """The Triton Θ's kernel names (its ``@triton.jit`` functions), as a profile shows them."""
    with contextlib.suppress(Exception):  # no triton here: no such kernels either
        from tokenformer.nn.kernels import triton_theta_jit as jit

        return tuple(getattr(k, "__name__", None) or k.fn.__name__ for k in (jit.fwd, jit.bwd))
    return ("fwd", "bwd")


def _is_kernel(event: Any, device: torch.device) -> bool:
    if device.type == "cuda":
        return (event.device_type == torch.autograd.DeviceType.CUDA
                and not event.name.startswith(("Memcpy", "Memset")))
    return event.name.startswith("aten::")


def kernel_summary(prof: Any, device: torch.device) -> dict[str, float]:
    """Counts and device milliseconds of a profile: ``kernels``, ``launches``,
    ``graph_launches``; ``device_ms`` split into ``gemm_ms``, ``attention_ms``, ``theta_ms``
    (the Triton Θ, by kernel name) and ``other_ms`` (elementwise, reductions, inductor's fused
    kernels: a compiled Θ of the PyTorch impls lands here, with norms and the optimizer)."""
    theta = theta_kernel_names()
    out = dict.fromkeys(("kernels", "launches", "graph_launches", "device_ms", "gemm_ms",
                         "attention_ms", "theta_ms", "other_ms"), 0.0)
    for event in prof.events():
        if event.name in LAUNCHES:
            out["launches"] += 1
        elif event.name == GRAPH_LAUNCH:
            out["graph_launches"] += 1
        if not _is_kernel(event, device):
            continue
        out["kernels"] += 1
        ms = (event.self_device_time_total if device.type == "cuda"
              else event.self_cpu_time_total) / 1e3
        name = event.name.lower()
        kind = ("theta_ms" if event.name in theta or event.name.startswith(
                    tuple(f"{t}_" for t in theta))
                else "gemm_ms" if any(g in name for g in GEMM)
                else "attention_ms" if any(a in name for a in ATTENTION) else "other_ms")
        out[kind] += ms
        out["device_ms"] += ms
    return out


def per_unit(summary: dict[str, float], units: float) -> dict[str, float]:
    """A summary divided by ``units`` (steps, tokens)."""
    return {k: v / units for k, v in summary.items()}
