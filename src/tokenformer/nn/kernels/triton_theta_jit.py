"""The Triton kernels of :mod:`tokenformer.nn.kernels.triton_theta` (see there), imported by
it on first use. Kernel helpers are module globals: Triton resolves called functions there, not
in closures."""

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
def load_block(row_ptr, start, n, BLOCK: tl.constexpr):
    """Positions ``start`` … ``start + BLOCK`` of a row of n as float32 (0 past the end), their
    offsets and the in-row mask: every sweep of both kernels reads its blocks so."""
    off = start + tl.arange(0, BLOCK)
    mask = off < n
    return tl.load(row_ptr + off, mask=mask, other=0.0).to(tl.float32), off, mask


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
def fwd(s_ptr, out_ptr, r_ptr, n, stride, scale, eps, NORM: tl.constexpr,
        BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride
    out_row = out_ptr + row * n
    if SINGLE:  # the whole row in registers: one read, one write
        s, off, mask = load_block(s_row, 0, n, BLOCK)
        c = scale
        if NORM != 4:
            r, c = row_factor(tl.sum(row_term(s, mask, NORM), axis=0), scale, eps, NORM)
            tl.store(r_ptr + row, r)
        t = theta_of(s, c, NORM)
        tl.store(out_row + off, t.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        c = scale
        if NORM != 4:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n, BLOCK):
                s, off, mask = load_block(s_row, start, n, BLOCK)
                acc += row_term(s, mask, NORM)
            r, c = row_factor(tl.sum(acc, axis=0), scale, eps, NORM)
            tl.store(r_ptr + row, r)
        for start in range(0, n, BLOCK):
            s, off, mask = load_block(s_row, start, n, BLOCK)
            t = theta_of(s, c, NORM)
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
def bwd(g_ptr, s_ptr, r_ptr, ds_ptr, n, stride, scale, eps, NORM: tl.constexpr,
        BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride
    g_row = g_ptr + row * n
    ds_row = ds_ptr + row * n
    r = 0.0
    c = scale
    if NORM != 4:
        r = tl.load(r_ptr + row)
        c = scale / (r + eps)
    if SINGLE:
        s, off, mask = load_block(s_row, 0, n, BLOCK)
        g, _, _ = load_block(g_row, 0, n, BLOCK)
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
                s, off, mask = load_block(s_row, start, n, BLOCK)
                g, _, _ = load_block(g_row, start, n, BLOCK)
                acc += dot_term(s, g, c, NORM)
            dot = tl.sum(acc, axis=0)
        for start in range(0, n, BLOCK):
            s, off, mask = load_block(s_row, start, n, BLOCK)
            g, _, _ = load_block(g_row, start, n, BLOCK)
            ds = grad_of(s, g, r, c, dot, scale, eps, NORM)
            tl.store(ds_row + off, ds.to(ds_ptr.dtype.element_ty), mask=mask)
