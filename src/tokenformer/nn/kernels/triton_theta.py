"""Triton kernels for Θ on CUDA, forward and backward, registered as custom ops (``impl="triton"``).

**Unmeasured**: opt-in until a GPU run of ``benchmarks/gpu.py`` shows it is the fastest
(docs/performance.md, "A Triton Θ"); ``impl="auto"`` does not choose it.

Every Θ variant of :mod:`tokenformer.nn.theta` is one row-wise kernel per direction, one
program per row of the scores S [rows, n] (computing in float32, storing in S's dtype):

* forward: one read of S, one write of Θ(S) and of one float32 number per row (r, the norm:
  ‖S‖₂, ‖GELU(S)‖₂, ‖GELU(S)‖₁ or Σexp(S); nothing for plain ``gelu``);
* backward: one read of dΘ and S, one write of dS, from the closed forms of
  :mod:`tokenformer.nn.kernels.fused` (c = scale / (r + eps)):

  - ``l2_norm_gelu``: u = c·S, g = GELU'(u)⊙dΘ, dS = c·g − c·S·(S·g) / (r·(r + eps)), i.e.
    c·(g − ŝ·(ŝ·g)·r/(r + eps)) with ŝ = S/r; a zero row (finite only with eps > 0) gets
    dS = c·g, the reference's subgradient 0 for the norm;
  - ``gelu_l2_norm``: Θ = c·GELU(S), dS = c·GELU'(S)⊙(dΘ − Θ·(Θ·dΘ)·(r + eps)/(s²·r));
  - ``gelu_l1_norm``: dS = c·GELU'(S)⊙(dΘ − sign(Θ)·(Θ·dΘ)/s);
  - ``softmax``: Θ = c·exp(S), dS = Θ⊙(dΘ − (Θ·dΘ)/s);
  - ``gelu``: Θ = s·GELU(S), dS = s·GELU'(S)⊙dΘ.

A row that fits one block (n ≤ :data:`MAX_BLOCK`) is loaded once and kept in registers; a longer
row is swept twice (the norm, then Θ), the second sweep reading what the first left in L2.

**Segments** (:func:`theta_segments`, the one-GEMM Q/K/V of :mod:`tokenformer.nn.grouped`): for
scores [rows, G·n], the G segments of n of each row are normalised each on its own and Θ is
written segment-major, [G, rows, n], the layout a batched value product reads; the backward reads
dΘ in that layout and writes dS in the scores'. Same passes: the layout changes inside the kernels.

The Θ op saves S and r for its backward and returns Θ, which the value product's autograd keeps:
a Pattention then keeps exactly what a GELU MLP keeps (its hidden pre-activation and GELU output)
and moves the same bytes over them (2 passes forward, 3 backward). The byte counts of this and
the other designs are in docs/performance.md.

The ops are ``torch.ops.tokenformer_triton.theta_fwd`` / ``theta_bwd``, defined on first use
with :func:`torch.library.triton_op`, so ``torch.compile`` traces them without a graph break
(inductor sees the kernels and fuses around them); under the interpreter they are opaque custom
ops of their own (:func:`_ops`). Inductor clones, before every launch, each argument its analysis
of the kernel finds written (all of them if the analysis fails: "assuming every input is
mutated"); the kernels are written so that it finds their outputs alone (triton_theta_jit's
docstring; tests/nn/test_triton_theta.py traces the ops as torch.compile does and checks).
Without triton installed (the ``triton`` extra) nothing is registered and :func:`available`
says why. On a CPU the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1`` set
before triton is imported), which is how CI tests them (tests/nn/test_triton_theta.py runs the
device tests so in a child process).
"""

from __future__ import annotations

import os
import warnings

import torch
from torch.library import custom_op, triton_op

from ...errors import TokenFormerWarning
from ..theta import THETAS
from .fused import no_autocast

try:  # an optional dependency (the triton extra; CUDA builds of torch bring it)
    import triton

    from . import triton_theta_jit  # the kernels (decorating them compiles nothing yet)

    _IMPORT_ERROR = ""
    _INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
except ImportError as e:  # pragma: no cover - depends on the environment
    triton = triton_theta_jit = None
    _INTERPRET = False
    _IMPORT_ERROR = f"triton is not installed ({e}); pip install 'tokenformer[triton]'"

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The longest row kept in registers by one program (8192 float32 over 16 warps: 16 per thread);
# longer rows are swept in blocks of this size.
MAX_BLOCK = 8192
_state: dict[str, bool] = {}


def interpreting() -> bool:
    """Whether Triton runs its interpreter (kernels on CPU tensors): ``TRITON_INTERPRET=1`` was
    set when this module was imported. Triton decides it for its own ``@jit`` functions
    (``tl.sum`` among them) when triton is imported (torch itself may import it first), so the
    variable must be set before the process imports torch, triton or this module."""
    return _INTERPRET


def available() -> bool:
    """True when triton can be imported (the ops are registered)."""
    return triton is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    return _IMPORT_ERROR


def covers(device: torch.device, dtype: torch.dtype, norm: str) -> bool:
    """Whether the kernels compute Θ ``norm`` for scores on ``device`` in ``dtype``: CUDA, or
    the CPU under the interpreter; float32, bf16 or fp16; every built-in Θ (those with a Triton
    id, the kernels' NORM constexpr, in :data:`~tokenformer.nn.theta.THETAS`)."""
    on_device = device.type == "cuda" or (device.type == "cpu" and interpreting())
    variant = THETAS.get(norm)
    return on_device and dtype in DTYPES and variant is not None and variant.triton is not None


def supports(device: torch.device, dtype: torch.dtype, norm: str) -> bool:
    """:func:`covers` and :func:`available`; warns once when the caller asked for the Triton
    path (``impl="triton"``) and gets the fused PyTorch path instead."""
    if available() and covers(device, dtype, norm):
        return True
    if not _state.get("warned"):
        _state["warned"] = True
        dtype_name = str(dtype).removeprefix("torch.")
        why = (unavailable_reason() if not available() else
               f"no Triton Θ for {norm} {dtype_name} scores on {device.type}"
               + ("; set TRITON_INTERPRET=1 before starting to run it on the CPU (Triton's "
                  "interpreter, slow)" if device.type == "cpu" else ""))
        warnings.warn(f"Pattention impl 'triton' falls back to 'fused': {why}",
                      TokenFormerWarning, stacklevel=4)
    return False


def block_size(n: int) -> int:
    """The block of a row of ``n`` scores: the whole row up to :data:`MAX_BLOCK`."""
    return min(triton.next_power_of_2(n), MAX_BLOCK)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 4096 else 16


def _check(scores: torch.Tensor, groups: int) -> None:
    if scores.dim() != 2 or scores.stride(1) != 1:
        raise ValueError(f"Triton Θ takes 2-D scores with contiguous rows, got shape "
                         f"{tuple(scores.shape)} strides {scores.stride()}")
    if groups < 1 or scores.shape[1] % groups:
        raise ValueError(f"Triton Θ: {scores.shape[1]} scores per row do not split into "
                         f"{groups} equal segments")


def _launch(kernel, interpret: bool):
    """``kernel`` as a triton_op body calls it: through :func:`torch.library.wrap_triton`
    (compiled kernels), or as it is (the interpreter, which runs on real CPU tensors only)."""
    return kernel if interpret else torch.library.wrap_triton(kernel)


def _theta_fwd_impl(interpret: bool, scores: torch.Tensor, norm: str, scale: float, eps: float,
                    block: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Θ [groups·rows, n] contiguous, r [rows·groups] float32) of ``scores`` [rows, groups·n]
    (rows may be strided), Θ segment-major: rows 0 … rows−1 are segment 0's (the kernels'
    :func:`~tokenformer.nn.kernels.triton_theta_jit.rows_of`)."""
    _check(scores, groups)
    rows, n = scores.shape[0], scores.shape[1] // groups
    out = torch.empty((groups * rows, n), dtype=scores.dtype, device=scores.device)
    r = torch.zeros(rows * groups, dtype=torch.float32, device=scores.device)
    if rows and n:
        _launch(triton_theta_jit.fwd, interpret)[(rows * groups,)](
            scores, out, r, n, scores.stride(0), rows, scale, eps, NORM=THETAS[norm].triton,
            BLOCK=block, SINGLE=n <= block, GROUPS=groups, num_warps=_warps(block))
    return out, r


def _theta_bwd_impl(interpret: bool, grad: torch.Tensor, scores: torch.Tensor, r: torch.Tensor,
                    norm: str, scale: float, eps: float, block: int, groups: int
                    ) -> torch.Tensor:
    """dS [rows, groups·n] (the scores' shape, contiguous) from dΘ (``grad``, segment-major as
    the forward wrote Θ), the scores and the forward's r."""
    _check(scores, groups)
    rows, n = scores.shape[0], scores.shape[1] // groups
    grad = grad.contiguous()  # it is (dΘ of the value product): no copy
    ds = torch.empty((rows, groups * n), dtype=scores.dtype, device=scores.device)
    if rows and n:
        _launch(triton_theta_jit.bwd, interpret)[(rows * groups,)](
            grad, scores, r, ds, n, scores.stride(0), rows, scale, eps, NORM=THETAS[norm].triton,
            BLOCK=block, SINGLE=n <= block, GROUPS=groups, num_warps=_warps(block))
    return ds


_OPS: list[tuple] = []


def prepare() -> None:
    """Register the ops now, outside any ``torch.compile`` tracing (which cannot register an
    op): the Triton backend's ``prepare``, run when a layer is set to ``impl="triton"``
    (:func:`tokenformer.nn.kernels.dispatch.choose_impl`)."""
    if available():
        _ops()


def _ops() -> tuple:
    """The registered (forward, backward) ops, registering them on the first call."""
    if not _OPS:
        if torch.compiler.is_compiling():
            raise RuntimeError("the Triton Θ ops are registered outside torch.compile: set "
                               "impl='triton' (or call tokenformer.nn.kernels.dispatch."
                               "prepare_impl('triton')) before compiling")
        _OPS.append(_register(interpreting()))
    return _OPS[0]


def _register(interpret: bool) -> tuple:
    """The (forward, backward) custom ops. Compiled kernels: :func:`torch.library.triton_op`,
    whose body inductor traces (it sees and schedules the kernels; no graph break, no Python
    call per step), ``tokenformer_triton::theta_fwd``/``theta_bwd``. Under the interpreter,
    which cannot run on fake tensors: opaque :func:`torch.library.custom_op` with fake
    implementations (``..._interpreted``) — the same kernels, bodies and autograd formula, so
    CPU tests check all but the triton_op wrapper (tests/test_device.py does on CUDA)."""
    suffix = "_interpreted" if interpret else ""

    def fwd(scores: torch.Tensor, norm: str, scale: float, eps: float, block: int,
            groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        return _theta_fwd_impl(interpret, scores, norm, scale, eps, block, groups)

    def bwd(grad: torch.Tensor, scores: torch.Tensor, r: torch.Tensor, norm: str, scale: float,
            eps: float, block: int, groups: int = 1) -> torch.Tensor:
        return _theta_bwd_impl(interpret, grad, scores, r, norm, scale, eps, block, groups)

    if interpret:
        fwd_op = custom_op(f"tokenformer_triton::theta_fwd{suffix}", fwd, mutates_args=())
        bwd_op = custom_op(f"tokenformer_triton::theta_bwd{suffix}", bwd, mutates_args=())

        @fwd_op.register_fake
        def _(scores, norm, scale, eps, block, groups=1):
            return (scores.new_empty(groups * scores.shape[0], scores.shape[1] // groups),
                    scores.new_empty(scores.shape[0] * groups, dtype=torch.float32))

        @bwd_op.register_fake
        def _(grad, scores, r, norm, scale, eps, block, groups=1):
            return scores.new_empty(scores.shape)
    else:
        fwd_op = triton_op(f"tokenformer_triton::theta_fwd{suffix}", fwd, mutates_args=())
        bwd_op = triton_op(f"tokenformer_triton::theta_bwd{suffix}", bwd, mutates_args=())

    def setup_context(ctx, inputs, output) -> None:
        scores, *args = inputs
        ctx.save_for_backward(scores, output[1])
        ctx.args = args  # norm, scale, eps, block, groups

    def backward(ctx, grad_theta, grad_r):
        scores, r = ctx.saved_tensors
        # r is an internal output: nothing downstream differentiates it (grad_r is None or 0).
        return bwd_op(grad_theta, scores, r, *ctx.args), *[None] * len(ctx.args)

    fwd_op.register_autograd(backward, setup_context=setup_context)
    return fwd_op, bwd_op


def theta(scores: torch.Tensor, norm: str, scale: float, eps: float = 0.0,
          block: int | None = None) -> torch.Tensor:
    """Θ of ``scores`` [..., n] (rows may be strided, the last dimension contiguous) through the
    Triton op, differentiable; ``block`` (tests) overrides :func:`block_size`."""
    n = scores.shape[-1]
    rows = scores.reshape(-1, n) if scores.dim() != 2 else scores
    return _theta(rows, 1, norm, scale, eps, block).view(scores.shape)


def theta_segments(scores: torch.Tensor, groups: int, norm: str, scale: float, eps: float = 0.0,
                   block: int | None = None) -> torch.Tensor:
    """Θ of each of the ``groups`` equal segments of every row of ``scores`` [rows, groups·n]
    (rows may be strided, the last dimension contiguous; one Pattention's n scores per segment),
    returned as [groups, rows, n], contiguous, differentiable: the layout a batched value product
    reads, so the one-GEMM Q/K/V (:mod:`tokenformer.nn.grouped`) copies nothing either way (the
    kernels read the scores' rows and write dS in that layout)."""
    rows, n = scores.shape[0], scores.shape[1] // groups
    return _theta(scores, groups, norm, scale, eps, block).view(groups, rows, n)


def _theta(scores: torch.Tensor, groups: int, norm: str, scale: float, eps: float,
           block: int | None) -> torch.Tensor:
    """The forward op's Θ of 2-D ``scores`` in ``groups`` segments ([groups·rows, n])."""
    if not available():
        raise RuntimeError(f"the Triton Θ is unavailable: {unavailable_reason()}")
    n = scores.shape[-1] // groups
    block = block_size(n) if block is None else block
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    return _ops()[0](scores, norm, float(scale), float(eps), block, groups)[0]


def pattention(x: torch.Tensor, key: torch.Tensor, value: torch.Tensor, norm: str, scale: float,
               eps: float = 0.0) -> torch.Tensor:
    """``Θ(x·keyᵀ)·value`` for ``x`` [..., d_in] with Θ from the Triton op and the matmuls from
    torch (cuBLAS), under autocast as the fused path runs it (cast once, autocast off inside)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    dtype, off = no_autocast(x2)
    x2, key, value = x2.to(dtype), key.to(dtype), value.to(dtype)
    with off:
        y = torch.matmul(theta(torch.matmul(x2, key.t()), norm, scale, eps), value)
    return y.view(*shape[:-1], y.shape[-1])
