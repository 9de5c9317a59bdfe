"""``tokenformer build-kernels``: compile the C++ Θ kernel now rather than on first use."""

from __future__ import annotations

import argparse

from ...errors import TokenFormerError
from ...nn.kernels import cpu_theta as kernels


def build_kernels(args: argparse.Namespace) -> int:
    try:
        name = kernels.build()
    except RuntimeError as exc:
        raise TokenFormerError(f"{exc} (the default Pattention impl runs the PyTorch 'fused' "
                               f"path without it)") from None
    library = kernels.built_library(name)
    print(f"Θ kernel {name} ready" + (f": {library}" if library else ""))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "build-kernels", help="compile the C++ Θ kernel the default Pattention impl uses",
        description="Compile (once per machine and torch version; cached in torch's extension "
                    "directory, TORCH_EXTENSIONS_DIR) the C++ CPU kernel for Θ = l2_norm_gelu "
                    "that impl 'auto' uses where it applies. Without this it is compiled on "
                    "first use (≈ 15 s); run it in an image build or before launching several "
                    "processes. Needs a C++ compiler and ninja (the kernels extra).")
    p.set_defaults(func=build_kernels)
