"""A hand-written CPU kernel for Θ = ``l2_norm_gelu`` (``csrc/theta_cpu.cpp``), built once.

PyTorch runs Θ as separate elementwise kernels, each a pass over the [L, n] scores; on a CPU those
passes are memory-bound and cost a Pattention step 5–10 % over a GELU MLP of the same shapes
(docs/performance.md). The kernel does the whole Θ — row norm, scale, GELU — in one pass per
direction, a row at a time while the row sits in cache, so a Pattention step costs what the MLP's
does. The default ``impl="auto"`` uses it wherever it applies
(:func:`tokenformer.nn.kernels.dispatch.select_impl`).

It is compiled from source with :func:`torch.utils.cpp_extension.load` the first time it is asked
for (≈ 15 s, with one line on stderr; ``tokenformer build-kernels`` does it ahead of time) for the
vector ISA torch itself uses on this CPU, into torch's extension cache (``TORCH_EXTENSIONS_DIR``)
under a name carrying a hash of the source, the flags and the torch version: later processes load
that build directly (milliseconds), and a changed source or torch gets a build of its own. It is
not built at install time: a wheel's C++ extension is tied to the exact torch it was compiled
against, and building it in pip's isolated environment would download a (CUDA) torch there
(docs/performance.md, "Build"). Without a C++ compiler and ninja, or with
``TOKENFORMER_KERNELS=0``, :func:`available` is False and the reason is in
:func:`unavailable_reason`: ``auto`` then runs the PyTorch ``fused`` path silently (one debug log
line), ``impl="kernel"`` after one warning.

The two operators are registered as ``torch.ops.tokenformer_kernels.theta_forward`` /
``theta_backward`` with fake (meta) implementations, so ``torch.compile`` traces through them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path

import torch

from ...errors import TokenFormerWarning
from ..theta import THETAS

SOURCE = Path(__file__).with_name("csrc") / "theta_cpu.cpp"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the kernel computes in float32

# Compiler flags per vector ISA, the ones ATen builds its own kernels of that capability with.
_ISA_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw",
               "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "reason": str, "warned": bool, "logged": bool
_log = logging.getLogger(__name__)


def isa() -> str:
    """The vector ISA the kernel is built for: torch's own CPU capability where it is one the
    kernel has flags for, else DEFAULT (portable code the compiler vectorises as it can)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in _ISA_FLAGS else "DEFAULT"


def _cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists ``flag`` (False where there is no such file)."""
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def _flags() -> list[str]:
    target = isa()
    flags = ["-O3", *_ISA_FLAGS.get(target, ["-DCPU_CAPABILITY=DEFAULT"])]
    if target == "AVX512" and _cpu_has("avx512_bf16"):  # native float32 → bf16 (the store)
        flags.append("-mavx512bf16")
    return flags


def build_name() -> str:
    """The extension's name: the ISA it is compiled for and a hash of what it is built from
    (source, flags, torch version), e.g. ``tokenformer_theta_avx512_bf16_1a2b3c4d``."""
    target, flags = isa(), _flags()
    if "-mavx512bf16" in flags:
        target += "_BF16"
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join([*flags, torch.__version__]).encode())
    return f"tokenformer_theta_{target.lower()}_{digest.hexdigest()[:8]}"


def built_library(name: str) -> Path | None:
    """The shared library of an earlier build of ``name`` in torch's extension cache, if any."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        library = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
    except Exception:
        return None
    return library if library.is_file() else None


def _build() -> None:
    name = build_name()
    library = built_library(name)
    loaded = False
    if library is not None:  # the name says it is this source, flags and torch: just load it
        try:
            torch.ops.load_library(str(library))
            loaded = True
        except OSError:  # e.g. another process is still linking it: load() waits for its lock
            pass
    if not loaded:
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # the pip package's binary, venv not activated
            with contextlib.suppress(ImportError):
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        # Say so plainly (and skip torch's attempt and its warnings) when a tool is missing.
        compiler = os.environ.get("CXX", "c++")
        for tool, what in ((compiler, "C++ compiler"), ("ninja", "ninja (pip install ninja)")):
            if shutil.which(tool) is None:
                raise RuntimeError(f"no {what} found ({tool!r} is not on PATH)")
        print(f"tokenformer: compiling the Θ kernel {name} (once per machine, ≈ 15 s; "
              f"TOKENFORMER_KERNELS=0 skips it)", file=sys.stderr, flush=True)
        load(name, [str(SOURCE)], extra_cflags=_flags(), is_python_module=False, verbose=False)

    # Shapes and dtypes of the outputs, for torch.compile's tracing with fake tensors.
    @torch.library.register_fake("tokenformer_kernels::theta_forward")
    def _(scores, scale, eps):
        return torch.empty_like(scores), scores.new_empty(scores.shape[0], dtype=torch.float32)

    @torch.library.register_fake("tokenformer_kernels::theta_backward")
    def _(grad, scores, norms, scale, eps):
        return None


def available() -> bool:
    """True once the kernel is built and loaded (builds it on the first call)."""
    if "ok" in _state:  # lock-free once decided (torch.compile traces this call)
        return bool(_state["ok"])
    return _decide()


@torch.compiler.disable  # a first call inside torch.compile's tracing builds eagerly
def _decide() -> bool:
    with _lock:
        if "ok" not in _state:
            if os.environ.get("TOKENFORMER_KERNELS", "1") == "0":
                _state.update(ok=False, reason="disabled by TOKENFORMER_KERNELS=0")
            else:
                try:
                    _build()
                    _state.update(ok=True, reason="")
                except Exception as e:  # no compiler, no ninja, unsupported platform, ...
                    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    _state.update(ok=False, reason=f"could not build {SOURCE.name}: {first}")
        return bool(_state["ok"])


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    available()
    return str(_state["reason"])


def build() -> str:
    """Build (or load) the kernel now; returns its name. Raises RuntimeError saying why not."""
    if not available():
        raise RuntimeError(f"the Θ kernel is unavailable: {unavailable_reason()}")
    return build_name()


def covers(device: torch.device, dtype: torch.dtype, norm: str) -> bool:
    """Whether the kernel computes Θ ``norm`` for scores on ``device`` in ``dtype`` (the Θs
    whose :data:`~tokenformer.nn.theta.THETAS` row says ``cpu_kernel``: l2_norm_gelu)."""
    variant = THETAS.get(norm)
    return (variant is not None and variant.cpu_kernel and device.type == "cpu"
            and dtype in DTYPES)


def usable(device: torch.device, dtype: torch.dtype, norm: str) -> bool:
    """:func:`covers` and :func:`available`, silently: what ``impl="auto"`` asks. When the
    kernel cannot be built, one debug-level log line says why (auto then runs ``fused``)."""
    if not covers(device, dtype, norm):
        return False
    if "ok" not in _state and torch.compiler.is_compiling():
        # Undecided inside torch.compile's tracing (a compiled model's first call): deciding
        # means building, which cannot be traced, and a graph break would fail fullgraph=True.
        # This graph takes the PyTorch path; the first eager call decides for the rest.
        return False
    if available():
        return True
    if not _state.get("logged"):
        _state["logged"] = True
        _log.debug("Pattention impl 'auto' runs the PyTorch paths (fused, reference): %s",
                   unavailable_reason())
    return False


def supports(device: torch.device, dtype: torch.dtype, norm: str) -> bool:
    """Whether the kernel computes Θ ``norm`` for scores on ``device`` in ``dtype``; warns once
    when it would but cannot be built."""
    if not covers(device, dtype, norm):
        return False
    if available():
        return True
    if not _state.get("warned"):
        _state["warned"] = True
        warnings.warn(f"Pattention impl 'kernel' falls back to 'fused': {unavailable_reason()} "
                      f"(TOKENFORMER_KERNELS=0 skips the attempt)", TokenFormerWarning,
                      stacklevel=4)
    return False


def _require() -> None:
    if not available():
        raise RuntimeError(f"the Θ kernel is unavailable: {unavailable_reason()}")


def theta_forward(scores: torch.Tensor, scale: float, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Θ of contiguous 2-D ``scores`` and the float32 row norms the backward needs."""
    _require()
    return torch.ops.tokenformer_kernels.theta_forward(scores, scale, eps)


def theta_backward(grad: torch.Tensor, scores: torch.Tensor, norms: torch.Tensor, scale: float,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(Θ, dScores), computed in place of (``grad`` = dΘ, ``scores``) in one pass: no memory is
    allocated. ``scores``' version counter is bumped, so autograd refuses (rather than silently
    misusing) a second backward through a graph that saved them (``retain_graph=True``)."""
    _require()
    torch.ops.tokenformer_kernels.theta_backward(grad, scores, norms, scale, eps)
    torch.autograd.graph.increment_version(scores)
    return grad, scores
