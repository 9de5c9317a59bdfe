"""The Triton kernels of :mod:`tokenformer.nn.kernels.triton_theta` (see there), imported by
it on first use. Kernel helpers are module globals: Triton resolves called functions there, not
in closures.

Every address a kernel stores to is computed from the output pointer and from integers alone,
never from a value a helper returned after taking an input pointer: inductor's analysis of a
user kernel (``identify_accessed_tensors``) counts an input pointer reaching a store's address
or mask through a call as written, and clones every input it thinks written before each launch
(tests/nn/test_triton_theta.py checks the analysis finds no input written)."""

import triton
import triton.language as tl

INV_SQRT2: tl.constexpr = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI: tl.constexpr = tl.constexpr(0.3989422804014327)


@triton.jit
def gelu(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * INV_SQRT2))


@triton.jit
def gelu_grad(x):
    return 0.5 * (1.0 + tl.math.erf(x * INV_SQRT2)) + x * tl.exp(-0.5 * x * x) * INV_SQRT_2PI


@triton.jit
def block_of(start, n, BLOCK: tl.constexpr):
    """The offsets of positions ``start`` … ``start + BLOCK`` of a row of n and the in-row mask:
    every sweep of both kernels reads and writes its blocks so (from integers alone: module
    docstring)."""
    off = start + tl.arange(0, BLOCK)
    return off, off < n


@triton.jit
def load(row_ptr, off, mask):
    """A block of a row as float32, 0 past the row's end."""
    return tl.load(row_ptr + off, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def rows_of(rows, n, stride, GROUPS: tl.constexpr):
    """(offset of this program's scores, offset of its Θ or dΘ, p) for scores [rows, GROUPS·n]
    with row stride ``stride``: program p computes segment p mod GROUPS of row p div GROUPS,
    whose Θ and dΘ are that row of that segment in [GROUPS, rows, n] (segment-major), and whose r
    and dS are row p of [rows·GROUPS] and of [rows·GROUPS, n] = [rows, GROUPS·n], the scores'
    layout (GROUPS = 1: the plain row-wise layout)."""
    p = tl.program_id(0).to(tl.int64)
    row = p // GROUPS
    seg = p % GROUPS
    return row * stride + seg * n, (seg * rows + row) * n, p


@triton.jit
def row_term(s, mask, NORM: tl.constexpr):
    """What the row's norm r sums (before a square root for the L2 variants)."""
    if NORM == 0:
        v = s * s
    elif NORM == 1:
        a = gelu(s)
        v = a * a
    elif NORM == 2:
        v = tl.abs(gelu(s))
    else:
        v = tl.where(mask, tl.exp(s), 0.0)
    return v


@triton.jit
def theta_of(s, c, NORM: tl.constexpr):
    if NORM == 0:
        t = gelu(c * s)
    elif NORM == 3:
        t = c * tl.exp(s)
    else:  # gelu_l2_norm, gelu_l1_norm, gelu (c = scale)
        t = c * gelu(s)
    return t


@triton.jit
def row_factor(total, scale, eps, NORM: tl.constexpr):
    """(r, c = scale / (r + eps)) from the row's sum of :func:`row_term`."""
    r = tl.sqrt(total) if NORM <= 1 else total
    return r, scale / (r + eps)


@triton.jit
def fwd(s_ptr, out_ptr, r_ptr, n, stride, rows, scale, eps, NORM: tl.constexpr,
        BLOCK: tl.constexpr, SINGLE: tl.constexpr, GROUPS: tl.constexpr):
    s_at, out_at, p = rows_of(rows, n, stride, GROUPS)
    s_row = s_ptr + s_at
    out_row = out_ptr + out_at
    if SINGLE:  # the whole row in registers: one read, one write
        off, mask = block_of(0, n, BLOCK)
        s = load(s_row, off, mask)
        c = scale
        if NORM != 4:
            r, c = row_factor(tl.sum(row_term(s, mask, NORM), axis=0), scale, eps, NORM)
            tl.store(r_ptr + p, r)
        t = theta_of(s, c, NORM)
        tl.store(out_row + off, t.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        c = scale
        if NORM != 4:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n, BLOCK):
                off, mask = block_of(start, n, BLOCK)
                acc += row_term(load(s_row, off, mask), mask, NORM)
            r, c = row_factor(tl.sum(acc, axis=0), scale, eps, NORM)
            tl.store(r_ptr + p, r)
        for start in range(0, n, BLOCK):
            off, mask = block_of(start, n, BLOCK)
            t = theta_of(load(s_row, off, mask), c, NORM)
            tl.store(out_row + off, t.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dot_term(s, g, c, NORM: tl.constexpr):
    """The backward's row dot: S·(GELU'(u)⊙dΘ) for l2_norm_gelu, Θ·dΘ for the others."""
    if NORM == 0:
        v = s * (gelu_grad(c * s) * g)
    else:
        v = theta_of(s, c, NORM) * g
    return v


@triton.jit
def grad_of(s, g, r, c, dot, scale, eps, NORM: tl.constexpr):
    if NORM == 0:
        du = gelu_grad(c * s) * g
        k = tl.where(r > 0, c * dot / tl.where(r > 0, r * (r + eps), 1.0), 0.0)
        ds = c * du - s * k
    elif NORM == 1:
        t = c * gelu(s)
        k = tl.where(r > 0, (r + eps) / tl.where(r > 0, scale * scale * r, 1.0), 0.0)
        ds = c * gelu_grad(s) * (g - t * (k * dot))
    elif NORM == 2:
        t = c * gelu(s)
        sign = tl.where(t > 0, 1.0, tl.where(t < 0, -1.0, 0.0))
        ds = c * gelu_grad(s) * (g - sign * (dot / scale))
    elif NORM == 3:
        t = c * tl.exp(s)
        ds = t * (g - dot / scale)
    else:
        ds = scale * gelu_grad(s) * g
    return ds


@triton.jit
def bwd(g_ptr, s_ptr, r_ptr, ds_ptr, n, stride, rows, scale, eps, NORM: tl.constexpr,
        BLOCK: tl.constexpr, SINGLE: tl.constexpr, GROUPS: tl.constexpr):
    s_at, g_at, p = rows_of(rows, n, stride, GROUPS)
    s_row = s_ptr + s_at
    g_row = g_ptr + g_at
    ds_row = ds_ptr + p * n
    r = 0.0
    c = scale
    if NORM != 4:
        r = tl.load(r_ptr + p)
        c = scale / (r + eps)
    if SINGLE:
        off, mask = block_of(0, n, BLOCK)
        s = load(s_row, off, mask)
        g = load(g_row, off, mask)
        dot = 0.0
        if NORM != 4:
            dot = tl.sum(dot_term(s, g, c, NORM), axis=0)
        ds = grad_of(s, g, r, c, dot, scale, eps, NORM)
        tl.store(ds_row + off, ds.to(ds_ptr.dtype.element_ty), mask=mask)
    else:
        dot = 0.0
        if NORM != 4:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n, BLOCK):
                off, mask = block_of(start, n, BLOCK)
                acc += dot_term(load(s_row, off, mask), load(g_row, off, mask), c, NORM)
            dot = tl.sum(acc, axis=0)
        for start in range(0, n, BLOCK):
            off, mask = block_of(start, n, BLOCK)
            ds = grad_of(load(s_row, off, mask), load(g_row, off, mask), r, c, dot, scale, eps,
                         NORM)
            tl.store(ds_row + off, ds.to(ds_ptr.dtype.element_ty), mask=mask)
