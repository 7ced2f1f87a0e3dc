"""The body of a block of whole rows, as ``triton.jit`` helpers: the one spelling of a row's load,
fp32 statistics, normalize-and-affine and the backward's row reductions, shared by the rows kernel
(:mod:`.rows`, its single-block path) and the modern row kernels (:mod:`.modern`).

What this covers: a block of ``BLOCK_M`` rows of ``N <= BLOCK_N`` unit-stride columns held in
registers (rows any stride, int64 offsets). Triton inlines jit helpers, so a kernel built from them
compiles to what it would spelled out; the order of every reduction is the rows kernel's, so a row
gives the same bits in every kernel that normalizes it. Limits: single-block rows only -- the rows
kernel's looped path (rows longer than ``config.ROWS_MAX_FUSED_N``) walks a row in chunks and keeps
its own body.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_block(first, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows ``first .. first + BLOCK_M`` of ``M``: ``(rows, cols, rmask, cmask, mask, r64)``, ``r64``
    the int64 row index as a column (offsets past 2^31 elements stay exact)."""
    rows = first + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    return rows, cols, rmask, cmask, mask, rows.to(tl.int64)[:, None]


@triton.jit
def load_rows(P, r64, stride, cols, mask):
    """The block's elements of the rows at ``P`` (row stride ``stride``) in fp32, masked lanes 0."""
    return tl.load(P + r64 * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def load_cols(P, cols, cmask):
    """A per-column vector (weight, bias) in fp32, masked lanes 0."""
    return tl.load(P + cols, mask=cmask, other=0.0).to(tl.float32)


@triton.jit
def row_stats(x, cols, mask, N, eps, CENTERED: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(mean, d, rstd)`` of a block of whole rows held in registers (fp32, masked lanes 0): ``d`` is
    ``x - mean`` (``x`` itself, mean 0, for RMS), zero in masked lanes, and ``rstd = rsqrt(mean(d^2) +
    eps)`` -- divided by N, not BLOCK_N, so the masked lanes count as nothing (Liger #518). Centred,
    the row is first shifted by its fp32 mean ``k`` and re-centred by the mean of ``x - k``: with
    |mean| >> std the fp32 sum of raw values loses the digits the deviations live in, but ``x - k``
    is exact there and its mean gives them back. Not by the row's first element: an outlier there (a
    massive activation) rounded every other deviation to the outlier's spacing, ~25x torch's error."""
    if CENTERED:
        k = tl.sum(x * (1.0 / N), axis=1)  # masked lanes hold 0; scaled first: no overflow near fp32's max
        xk = tl.where(mask, x - k[:, None], 0.0)
        mk = tl.sum(xk, axis=1) / N
        mean = k + mk
        d = tl.where(mask, xk - mk[:, None], 0.0)
    else:
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        d = x
    return mean, d, tl.rsqrt(tl.sum(d * d, axis=1) / N + eps)


@triton.jit
def normalize_rows(
    x, W, B, MEAN, RSTD, rows, rmask, cols, cmask, mask, N, eps, w_offset,
    BLOCK_M: tl.constexpr, CENTERED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """The block's rows normalized, in fp32 and not yet rounded: statistics stored to ``MEAN``/``RSTD``
    (fp32), scaled by ``w + w_offset`` formed in fp32, then ``+ b``."""
    mean, d, rstd = row_stats(x, cols, mask, N, eps, CENTERED, BLOCK_M)
    tl.store(MEAN + rows, mean, mask=rmask)
    tl.store(RSTD + rows, rstd, mask=rmask)
    y = d * rstd[:, None]
    if HAS_WEIGHT:
        y = y * (load_cols(W, cols, cmask) + w_offset)[None, :]
    if HAS_BIAS:
        y = y + load_cols(B, cols, cmask)[None, :]
    return y


@triton.jit
def row_xhat(x, MEAN, RSTD, rows, rmask, mask, CENTERED: tl.constexpr):
    """``(xhat, rstd)`` of the block from the saved statistics: ``xhat = (x - mean) * rstd``, 0 in
    masked lanes (RMS: ``x * rstd``, whose masked lanes are already 0)."""
    rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
    if CENTERED:
        mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    else:
        xhat = x * rstd[:, None]
    return xhat, rstd


@triton.jit
def row_dx(g, xhat, rstd, N, CENTERED: tl.constexpr):
    """The input gradient of a row normalization, ``g`` the gradient of its output ``xhat`` (``dy * w``):
    ``rstd * (g - (xhat * mean(g * xhat) + mean(g)))``, RMS without ``mean(g)``."""
    c1 = tl.sum(g * xhat, axis=1) / N
    if CENTERED:
        c2 = tl.sum(g, axis=1) / N
        dx = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
    else:
        dx = (g - xhat * c1[:, None]) * rstd[:, None]
    return dx
