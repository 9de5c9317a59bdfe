"""Whether a model fits: the memory a model of a config needs (from the config alone, nothing
allocated) against the memory available now. Growth plans, training runs and every loader that
builds a model from a config read from disk ask here first."""

from __future__ import annotations

from typing import Any

from ..errors import GrowthError, TokenFormerError

try:
    import resource
except ImportError:  # Windows: no address-space limit to read
    resource = None  # type: ignore[assignment]


def check_memory(config: Any, copies: float, what: str,
                 error: type[TokenFormerError] = GrowthError) -> None:
    """Refuse up front a model of ``config`` whose ``copies`` fp32 copies of the parameters
    (weights, gradients, optimizer moments...), plus its rotary cache, exceed the memory available
    now. Computed from the config alone (nothing is allocated): growth plans, and every loader
    that builds a model from a config read from disk
    (:func:`tokenformer.models.checks.check_buildable`, which raises ``error`` =
    CheckpointError)."""
    params = config.num_parameters()
    # RotaryEmbedding's cos/sin caches and the temporaries that build them: ~4 fp32 values per
    # position and rotary dimension (a config read from disk can ask for 10⁹ positions).
    positions = getattr(config, "max_seq_len", 0)
    need = params * 4 * copies + positions * (4 * getattr(config, "rotary_dim", 0) + 1) * 4
    available = available_memory()
    if available is not None and need > available:
        raise error(f"{what}: {params:,} parameters need about {need / 2**30:,.1f} GiB of "
                    f"memory; {available / 2**30:,.1f} GiB are available")


def available_memory() -> int | None:
    """Bytes of memory available without swapping (Linux MemAvailable), lowered to what an
    address-space limit (``ulimit -v``, RLIMIT_AS) leaves this process; None when unknown."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if resource is None:
        return available
    try:
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY:
            with open("/proc/self/status") as f:
                used = next(int(line.split()[1]) * 1024 for line in f
                            if line.startswith("VmSize:"))
            room = max(limit - used, 0)
            available = room if available is None else min(available, room)
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    return available
