"""The machine an experiment ran on (CPU, cores, threads, versions), for its results.json."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch


def machine_summary() -> dict[str, Any]:
    """The CPU model, core and thread counts and versions, recorded in every results.json."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__}
    info["summary"] = (f"{cpu}, {info['cpus']} CPUs ({info['torch_threads']} torch threads), "
                       f"torch {torch.__version__}, Python {info['python']}")
    return info
