"""The environment every call records first: versions (Python, torch, CUDA, cuDNN, triton,
transformers), the GPU, its driver and ``nvidia-smi``, the CPU count, and the two ceilings
measured on this device (the bf16 matmul rate that MFU divides by, the copy bandwidth that
bounds decoding)."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch
from common import machine
from train_throughput import matmul_ceiling

from tokenformer import __version__

from .base import ROOT, Sizes, copy_bandwidth, output, version


def environment(device: torch.device, sizes: Sizes) -> dict[str, Any]:
    """Versions, the GPU and its driver, nvidia-smi, and the two ceilings measured here."""
    from tokenformer.nn.kernels import cpu_theta as kernels

    smi = output(["nvidia-smi"])
    print(smi or "nvidia-smi: not available", flush=True)
    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "triton": version("triton"), "transformers": version("transformers"),
        "tokenformer": __version__, "commit": output(["git", "-C", str(ROOT), "rev-parse",
                                                       "--short", "HEAD"]),
        "device": str(device), "host": machine(), "cpu_count": os.cpu_count(),
        "nvidia_smi": smi,
        "theta_kernel": "available" if kernels.available() else kernels.unavailable_reason(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        driver = output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count,
                    memory_gib=props.total_memory / 2**30,
                    driver=driver.splitlines()[0] if driver else None)
    info["bf16_matmul_tflops"] = matmul_ceiling(torch.bfloat16, sizes.matmul_n,
                                                device=device) / 1e12
    info["copy_gbps"] = copy_bandwidth(device, sizes.copy_bytes) / 1e9
    info["summary"] = describe_device(info)
    return info


def describe_device(info: dict[str, Any]) -> str:
    if info.get("gpu"):
        return (f"{info['gpu']} (driver {info['driver']}, CUDA {info['cuda']}), torch "
                f"{info['torch']}, triton {info['triton']}, transformers {info['transformers']}")
    return f"CPU: {info['host']}"
