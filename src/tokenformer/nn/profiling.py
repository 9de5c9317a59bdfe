"""Measuring tensor memory on the CPU, where torch has no ``max_memory_allocated``.

The profiler records every tensor allocation and free (``profile_memory=True``); their running sum
over one call is the exact high-water mark of tensor memory the call adds, independent of the
allocator's caching and of the process's resident set. Used by ``benchmarks/fused.py`` and the
memory tests of the fused Pattention.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """Highest point, in bytes, of the tensor memory allocated and not yet freed during ``fn()``
    (memory that existed before the call is not counted)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # The per-allocation events are only reachable through the profiler's kineto results (the
    # public key_averages() sums them per op and loses their order); torch is pinned.
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return peak
