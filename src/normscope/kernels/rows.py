# ruff: noqa: UP007, UP045  -- torch.library reads custom-op schemas from typing.Optional annotations
"""Fused Triton kernels for normalization over rows: LayerNorm and RMSNorm, forward and backward.

What this covers
----------------
The canonical view is a matrix of ``M`` rows by ``N`` columns whose last axis is unit-stride (rows
may have any stride): every row is one scope. LayerNorm and RMSNorm over the last axes of any
tensor map onto it, and so does the fused "residual add, then RMSNorm" of pre-norm transformers.
One kernel family covers all of them through compile-time flags:

    CENTERED       subtract the mean (LayerNorm) or not (RMSNorm: the "variance" is the mean square)
    HAS_WEIGHT     multiply by ``weight + weight_offset`` (offset 1.0 gives Gemma's ``(1 + w)``)
    HAS_BIAS       add ``bias``
    HAS_RESIDUAL   normalize ``s = x + residual`` and also return ``s`` (in the residual's dtype, or
                   fp32 with ``residual_fp32``); the normalized value is ``s`` *after* that rounding, so
                   the fused op equals "add, then norm" exactly

Numerics: statistics are accumulated in fp32 and saved (mean, rstd) in fp32 whatever the input
dtype. The variance is the mean of squared deviations from the mean (single block: two passes
over registers; long rows: Chan's parallel combination of per-chunk mean and M2), never
E[x^2] - E[x]^2. dW/dB are deterministic: each program writes fp32 partial sums for its rows to
its own row of a ``(programs, N)`` buffer, and one ``.sum(0)`` finishes them -- no atomics.

Limits and trade-offs
---------------------
* Rows with ``next_pow2(N) <= ROWS_MAX_FUSED_N`` (16K elements) live in registers: one read of x, one
  write of y. Longer rows (any length; 262K is tested in the benchmark) take the looped path: one
  program per row walks the row in chunks of ``ROWS_LOOP_BLOCK`` -- statistics pass, then a normalize
  pass that reads x again (usually from L2) -- so they move about 1.5x the minimal bytes.
* Long-row backward keeps each program's dW/dB partial in global memory (read-modify-write per
  row): extra traffic of ``8N`` bytes per row when a weight is present.
* fp64 inputs are declined by the engine backend (the kernels accumulate in fp32); the reference
  runs them.
* Launch settings (``ROWS_MAX_FUSED_N``, ``ROWS_LOOP_BLOCK``, tile, warps, backward programs) live
  in :mod:`normscope.kernels.config`, read at launch, so tests can force the looped path on tiny
  rows; none is measured on a GPU yet.
* Triton's CPU interpreter (``TRITON_INTERPRET=1``, how the tests run the kernels; Triton 3.6)
  converts fp32 to bf16 toward zero, where compiled Triton and torch round to nearest even: there a
  bf16 output -- the residual sum ``s`` included -- can be 1 ulp from torch's. The kernels' arithmetic
  is the same on both; fp16 and fp32 are converted to nearest even in the interpreter too.

The single-block body (a row's load, statistics, normalize and affine, and the backward's row
reductions) is spelled once in :mod:`._rowbody`, shared with the modern row kernels. The plain-PyTorch
reference (:func:`rows_ref`, :func:`._ref.rows_fwd_ref`, :func:`._ref.rows_bwd_ref`) is
the engine's :mod:`normscope.reference` on the rows view; on a CPU tensor without
``TRITON_INTERPRET=1`` the registered ops run it.
"""

from typing import Optional  # noqa: F401  (custom_op schemas are read from these annotations)

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _eager, config
from ._common import bwd_grid, dense, use_kernel
from ._common import chan_combine as _chan_combine
from ._common import next_pow2 as _next_pow2
from ._common import programs as _programs
from ._common import rows2d as _rows2d
from ._common import rows_config as _config
from ._ref import res_dtype as _res_dtype
from ._ref import rows_bwd_ref as _ref_bwd
from ._ref import rows_fwd_ref, rows_ref
from ._rowbody import load_cols, load_rows, normalize_rows, row_block, row_dx, row_xhat

__all__ = ["rows_norm", "rows_ref"]


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _rows_fwd_kernel(
    X, R, W, B, Y, RES, MEAN, RSTD,
    stride_x, stride_r, stride_y, stride_res,
    M, N, eps, w_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOPED: tl.constexpr,
    CENTERED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if not LOOPED:
        # BLOCK_M whole rows per program, each row in registers
        rows, cols, rmask, cmask, mask, r64 = row_block(pid * BLOCK_M, M, N, BLOCK_M, BLOCK_N)
        x = load_rows(X, r64, stride_x, cols, mask)
        if HAS_RESIDUAL:
            x += load_rows(R, r64, stride_r, cols, mask)
            s = x.to(RES.dtype.element_ty)
            tl.store(RES + r64 * stride_res + cols[None, :], s, mask=mask)
            x = s.to(tl.float32)  # normalize what "add, then norm" would see
        y = normalize_rows(x, W, B, MEAN, RSTD, rows, rmask, cols, cmask, mask, N, eps, w_offset,
                           BLOCK_M, CENTERED, HAS_WEIGHT, HAS_BIAS)  # fmt: skip
        tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # one long row per program, walked in chunks
        row = pid.to(tl.int64)
        X += row * stride_x
        Y += row * stride_y
        offs = tl.arange(0, BLOCK_N)
        if HAS_RESIDUAL:
            R += row * stride_r
            RES += row * stride_res
        n_a = 0.0
        mean_a = 0.0  # of x - k, k the mean of the row's first chunk (see the single-block path)
        m2_a = 0.0
        c0 = offs < N
        k = tl.load(X + offs, mask=c0, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            k = (k + tl.load(R + offs, mask=c0, other=0.0).to(tl.float32)).to(RES.dtype.element_ty).to(tl.float32)
        k = tl.sum(k * (1.0 / tl.minimum(N, BLOCK_N)), axis=0)  # scaled first: no overflow near fp32's max
        for start in range(0, N, BLOCK_N):
            cols = start + offs
            cmask = cols < N
            x = tl.load(X + cols, mask=cmask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                x += tl.load(R + cols, mask=cmask, other=0.0).to(tl.float32)
                s = x.to(RES.dtype.element_ty)
                tl.store(RES + cols, s, mask=cmask)
                x = s.to(tl.float32)
            if CENTERED:
                # Chan et al.: combine (n_a, mean_a, M2_a) with this chunk's (n_b, mean_b, M2_b)
                x = tl.where(cmask, x - k, 0.0)
                n_b = tl.minimum(N - start, BLOCK_N).to(tl.float32)
                mean_b = tl.sum(x, axis=0) / n_b
                dd = tl.where(cmask, x - mean_b, 0.0)
                m2_b = tl.sum(dd * dd, axis=0)
                n_a, mean_a, m2_a = _chan_combine(n_a, mean_a, m2_a, n_b, mean_b, m2_b)
            else:
                m2_a = m2_a + tl.sum(x * x, axis=0)
        if CENTERED:
            mean = k + mean_a
        else:
            mean = 0.0
        rstd = tl.rsqrt(m2_a / N + eps)
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)
        if HAS_RESIDUAL:
            tl.debug_barrier()  # the sum stored above is read back below, by other threads
        for start in range(0, N, BLOCK_N):
            cols = start + offs
            cmask = cols < N
            if HAS_RESIDUAL:
                x = tl.load(RES + cols, mask=cmask, other=0.0).to(tl.float32)
            else:
                x = tl.load(X + cols, mask=cmask, other=0.0).to(tl.float32)
            if CENTERED:
                y = (x - mean) * rstd
            else:
                y = x * rstd
            if HAS_WEIGHT:
                y = y * (load_cols(W, cols, cmask) + w_offset)
            if HAS_BIAS:
                y = y + load_cols(B, cols, cmask)
            tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=cmask)


@triton.jit
def _rows_bwd_kernel(
    DY, DRES, X, W, MEAN, RSTD, DX, DW, DB,
    stride_dy, stride_dres, stride_x, stride_dx,
    M, N, w_offset, rows_per_prog,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOPED: tl.constexpr,
    CENTERED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DRES: tl.constexpr,
):  # fmt: skip
    # xhat = (x - mean) * rstd,  g = dy * w
    # dx = rstd * (g - xhat * mean(g * xhat) - mean(g))     (RMSNorm: without the last term)
    # dW[pid] = sum over this program's rows of dy * xhat,  dB[pid] = sum of dy
    pid = tl.program_id(0)
    if not LOOPED:
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        if HAS_WEIGHT:
            w = load_cols(W, cols, cmask) + w_offset
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        first = pid * rows_per_prog
        for i in range(0, rows_per_prog, BLOCK_M):
            rows, cols, rmask, cmask, mask, r64 = row_block(first + i, M, N, BLOCK_M, BLOCK_N)
            x = load_rows(X, r64, stride_x, cols, mask)
            dy = load_rows(DY, r64, stride_dy, cols, mask)
            xhat, rstd = row_xhat(x, MEAN, RSTD, rows, rmask, mask, CENTERED)
            if HAS_WEIGHT:
                g = dy * w[None, :]
            else:
                g = dy
            dx = row_dx(g, xhat, rstd, N, CENTERED)
            if HAS_DRES:
                dx += load_rows(DRES, r64, stride_dres, cols, mask)
            tl.store(DX + r64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            if HAS_WEIGHT:
                dw += tl.sum(dy * xhat, axis=0)
            if HAS_BIAS:
                db += tl.sum(dy, axis=0)
        if HAS_WEIGHT:
            tl.store(DW + pid.to(tl.int64) * N + cols, dw, mask=cmask)
        if HAS_BIAS:
            tl.store(DB + pid.to(tl.int64) * N + cols, db, mask=cmask)
    else:
        # long rows: program pid takes rows pid, pid + P, ...; its dW/dB partial row lives in
        # global memory (zero-initialised by the launcher) and only this program touches it
        offs = tl.arange(0, BLOCK_N)
        nprog = tl.num_programs(0)
        DWp = DW + pid.to(tl.int64) * N
        DBp = DB + pid.to(tl.int64) * N
        r64 = pid.to(tl.int64)
        for _ in range(pid, M, nprog):  # the loop variable is an int in the interpreter: carry our own
            rstd = tl.load(RSTD + r64)
            if CENTERED:
                mean = tl.load(MEAN + r64)
            else:
                mean = 0.0
            c1 = 0.0
            c2 = 0.0
            for start in range(0, N, BLOCK_N):
                cols = start + offs
                cmask = cols < N
                x = tl.load(X + r64 * stride_x + cols, mask=cmask, other=0.0).to(tl.float32)
                dy = tl.load(DY + r64 * stride_dy + cols, mask=cmask, other=0.0).to(tl.float32)
                xhat = tl.where(cmask, (x - mean) * rstd, 0.0)
                if HAS_WEIGHT:
                    g = dy * (load_cols(W, cols, cmask) + w_offset)
                else:
                    g = dy
                c1 += tl.sum(g * xhat, axis=0)
                c2 += tl.sum(g, axis=0)
            c1 = c1 / N
            c2 = c2 / N
            for start in range(0, N, BLOCK_N):
                cols = start + offs
                cmask = cols < N
                x = tl.load(X + r64 * stride_x + cols, mask=cmask, other=0.0).to(tl.float32)
                dy = tl.load(DY + r64 * stride_dy + cols, mask=cmask, other=0.0).to(tl.float32)
                xhat = tl.where(cmask, (x - mean) * rstd, 0.0)
                if HAS_WEIGHT:
                    g = dy * (load_cols(W, cols, cmask) + w_offset)
                else:
                    g = dy
                if CENTERED:
                    dx = (g - (xhat * c1 + c2)) * rstd
                else:
                    dx = (g - xhat * c1) * rstd
                if HAS_DRES:
                    dx += tl.load(DRES + r64 * stride_dres + cols, mask=cmask, other=0.0).to(tl.float32)
                tl.store(DX + r64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=cmask)
                if HAS_WEIGHT:
                    tl.store(DWp + cols, tl.load(DWp + cols, mask=cmask, other=0.0) + dy * xhat, mask=cmask)
                if HAS_BIAS:
                    tl.store(DBp + cols, tl.load(DBp + cols, mask=cmask, other=0.0) + dy, mask=cmask)
            r64 += nprog


# ----------------------------------------------------------------------------------------------
# launch configuration


def _bwd_config(N: int) -> tuple[int, int, bool, int, int]:
    """(BLOCK_M, BLOCK_N, looped, num_warps, programs per SM) of the backward for rows of length N: the
    forward's, or the measured settings of ``config.ROWS_BWD_LAUNCH`` / ``config.ROWS_LOOP_LAUNCH``."""
    block_m, block_n, looped, warps = _config(N)
    block = _next_pow2(N)
    if looped:
        tuned = config.ROWS_LOOP_LAUNCH.get(block)
        if tuned is not None:
            return 1, tuned[2], True, tuned[3], tuned[4]
        return block_m, block_n, True, warps, config.ROWS_LOOP_BWD_PROGRAMS_PER_SM
    tuned = config.ROWS_BWD_LAUNCH.get(block)
    if tuned is not None:
        return tuned[0], block_n, False, tuned[1], tuned[2]
    return block_m, block_n, False, warps, config.ROWS_BWD_PROGRAMS_PER_SM


def _rows_fwd_impl(x, weight, bias, residual, eps, centered, weight_offset, residual_fp32):
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    mean = torch.empty((M,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    if residual is not None:
        res = torch.empty((M, N), dtype=_res_dtype(residual, residual_fp32), device=x.device)
    else:
        res = x.new_empty(0)
    if M == 0:
        return y, res, mean, rstd
    if not use_kernel(x):
        yr, sr, mr, rr = rows_fwd_ref(x, weight, bias, residual, eps, centered, weight_offset, residual_fp32)
        y.copy_(yr), mean.copy_(mr), rstd.copy_(rr)
        if residual is not None:
            res.copy_(sr)
        return y, res, mean, rstd
    block_m, block_n, looped, warps = _config(N)
    has_r = residual is not None
    grid = (triton.cdiv(M, block_m),)
    _rows_fwd_kernel[grid](
        x, residual if has_r else x, weight if weight is not None else x, bias if bias is not None else x,
        y, res if has_r else y, mean, rstd,
        x.stride(0), residual.stride(0) if has_r else 0, y.stride(0), res.stride(0) if has_r else 0,
        M, N, eps, weight_offset,
        BLOCK_M=block_m, BLOCK_N=block_n, LOOPED=looped,
        CENTERED=centered, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, HAS_RESIDUAL=has_r,
        num_warps=warps,
    )  # fmt: skip
    return y, res, mean, rstd


def _rows_bwd_impl(dy, dres, xs, weight, mean, rstd, centered, has_bias, weight_offset):
    M, N = xs.shape
    dx = torch.empty((M, N), dtype=xs.dtype, device=xs.device)
    has_w = weight is not None
    if M == 0 or not use_kernel(xs):
        if M == 0:
            z = torch.zeros(N, dtype=torch.float32, device=xs.device)
            return dx, z if has_w else xs.new_empty(0), z.clone() if has_bias else xs.new_empty(0)
        dxr, dw, db = _ref_bwd(dy, dres, xs, weight, mean, rstd, centered, has_bias, weight_offset)
        dx.copy_(dxr)
        return dx, dw if has_w else xs.new_empty(0), db if has_bias else xs.new_empty(0)
    block_m, block_n, looped, warps, per_sm = _bwd_config(N)
    if looped:
        progs = _programs(xs, M, per_sm)
        rows_per_prog = 0  # unused: the looped path strides over rows
        alloc = torch.zeros
    else:
        progs, rows_per_prog = bwd_grid(xs, M, block_m, per_sm)
        alloc = torch.empty
    dw = alloc((progs, N), dtype=torch.float32, device=xs.device) if has_w else None
    db = alloc((progs, N), dtype=torch.float32, device=xs.device) if has_bias else None
    _rows_bwd_kernel[(progs,)](
        dy, dres if dres is not None else dy, xs, weight if has_w else xs, mean, rstd, dx,
        dw if has_w else dx, db if has_bias else dx,
        dy.stride(0), dres.stride(0) if dres is not None else 0, xs.stride(0), dx.stride(0),
        M, N, weight_offset, rows_per_prog,
        BLOCK_M=block_m, BLOCK_N=block_n, LOOPED=looped,
        CENTERED=centered, HAS_WEIGHT=has_w, HAS_BIAS=has_bias, HAS_DRES=dres is not None,
        num_warps=warps,
    )  # fmt: skip
    # the second, deterministic stage of the dW/dB reduction (a fixed-order sum, no atomics)
    return (
        dx,
        dw.sum(0) if has_w else xs.new_empty(0),
        db.sum(0) if has_bias else xs.new_empty(0),
    )


# ----------------------------------------------------------------------------------------------
# torch.library ops: opaque to torch.compile (fake impls give shapes), autograd registered

# The schema is inferred from these annotations, so they stay plain ``typing`` objects (no
# ``from __future__ import annotations``, no ``X | None``), which torch 2.4 through 2.13 all read.


@torch.library.custom_op("normscope::rows_fwd", mutates_args=())
def rows_fwd(
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    residual: Optional[Tensor],
    eps: float,
    centered: bool,
    weight_offset: float,
    residual_fp32: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, s, mean, rstd) for a 2-D ``x`` with unit-stride rows; ``s`` is empty without a residual."""
    return _rows_fwd_impl(x, weight, bias, residual, eps, centered, weight_offset, residual_fp32)


@rows_fwd.register_fake
def _rows_fwd_fake(x, weight, bias, residual, eps, centered, weight_offset, residual_fp32):
    M, N = x.shape
    y = x.new_empty((M, N))
    res = x.new_empty((M, N), dtype=_res_dtype(residual, residual_fp32)) if residual is not None else x.new_empty(0)
    return y, res, x.new_empty((M,), dtype=torch.float32), x.new_empty((M,), dtype=torch.float32)


@torch.library.custom_op("normscope::rows_bwd", mutates_args=())
def rows_bwd(
    dy: Tensor,
    dres: Optional[Tensor],
    xs: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    centered: bool,
    has_bias: bool,
    weight_offset: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx in xs's dtype, dW fp32 or empty, dB fp32 or empty)."""
    return _rows_bwd_impl(dy, dres, xs, weight, mean, rstd, centered, has_bias, weight_offset)


@rows_bwd.register_fake
def _rows_bwd_fake(dy, dres, xs, weight, mean, rstd, centered, has_bias, weight_offset):
    M, N = xs.shape
    dw = xs.new_empty((N,), dtype=torch.float32) if weight is not None else xs.new_empty(0)
    db = xs.new_empty((N,), dtype=torch.float32) if has_bias else xs.new_empty(0)
    return xs.new_empty((M, N)), dw, db


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, eps, centered, weight_offset, residual_fp32 = inputs
    _, res, mean, rstd = output
    has_r = residual is not None
    ctx.save_for_backward(res if has_r else x, weight, mean, rstd)
    ctx.centered, ctx.weight_offset, ctx.eps = centered, weight_offset, eps
    ctx.x_dtype = x.dtype
    ctx.r_dtype = residual.dtype if has_r else None
    ctx.b_dtype = bias.dtype if bias is not None else None
    ctx.has_r = has_r


def make_backward(bwd_op, bwd_impl):
    """The registered backward of a rows forward op whose backward op is ``bwd_op`` (launching
    ``bwd_impl`` in eager mode): this module's, and the read-once kernels' (:mod:`.rows_once`), which
    save the same tensors (:func:`_setup_context`) and share the differentiable form."""

    def backward(ctx, dy, dres, dmean, drstd):
        xs, weight, mean, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(xs)
        if torch.is_grad_enabled():  # create_graph=True: a backward that is itself differentiable
            return _backward_differentiable(ctx, dy, dres, xs, weight)
        dres = dres.contiguous() if ctx.has_r and dres is not None else None
        ds, dw, db = _eager.pick(
            bwd_op,
            bwd_impl,
            dy.contiguous(),
            dres,
            xs,
            weight,
            mean,
            rstd,
            ctx.centered,
            ctx.b_dtype is not None,
            ctx.weight_offset,
        )
        dx = ds.to(ctx.x_dtype)
        dr = ds.to(ctx.r_dtype) if ctx.has_r else None
        dw = dw.to(weight.dtype) if weight is not None else None
        db = db.to(ctx.b_dtype) if ctx.b_dtype is not None else None
        return dx, dw, db, dr, None, None, None, None

    return backward


def _backward_differentiable(ctx, dy, dres, xs, weight):
    """The gradients as differentiable ops, for ``create_graph=True`` (double backward, gradient
    penalties): the kernel's backward has no derivative of its own, so this evaluates the closed
    form of :func:`_ref_bwd` in plain torch ops, with the statistics recomputed from ``xs`` (the
    saved ones are outputs whose gradient this op does not propagate). ``xs`` is the normalized
    input: ``x``, or ``x + residual`` -- this op's own output, so second derivatives reach x and the
    residual through it. (Not ``autograd.grad`` of the reference: on a saved output that re-enters
    this very backward.)"""
    acc = torch.float64 if xs.dtype == torch.float64 else torch.float32
    xf = xs.to(acc)
    mean = xf.mean(-1) if ctx.centered else torch.zeros(xf.shape[:-1], dtype=acc, device=xf.device)
    rstd = torch.rsqrt((xf - mean[:, None]).square().mean(-1) + ctx.eps)
    has_r = ctx.has_r and dres is not None
    ds, dw, db = _ref_bwd(
        dy, dres if has_r else None, xs, weight, mean, rstd, ctx.centered, ctx.b_dtype is not None, ctx.weight_offset
    )
    need = ctx.needs_input_grad
    dx = ds.to(ctx.x_dtype) if need[0] else None
    dr = ds.to(ctx.r_dtype) if ctx.has_r and need[3] else None
    dw = dw.to(weight.dtype) if weight is not None and need[1] else None
    db = db.to(ctx.b_dtype) if ctx.b_dtype is not None and need[2] else None
    return dx, dw, db, dr, None, None, None, None


_backward = make_backward(rows_bwd, _rows_bwd_impl)
rows_fwd.register_autograd(_backward, setup_context=_setup_context)
#: rows_fwd with the same functions, for eager mode (see kernels/_eager.py)
_RowsEager = _eager.function(_rows_fwd_impl, _setup_context, _backward)


# ----------------------------------------------------------------------------------------------
# the entry point


def _unit_rows(t: Tensor, n: int) -> Tensor:
    """``t`` as rows of its last ``n`` elements with unit stride along a row (a copy only if they are not)."""
    t2 = _rows2d(t, n)  # rows of zero elements: no rows (a zero-width scope has no kernel work)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rows_norm(
    x: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    centered: bool = True,
    residual: Optional[Tensor] = None,
    weight_offset: float = 0.0,
    residual_fp32: bool = False,
    n: Optional[int] = None,
    ops: Optional[tuple] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """Normalize every row of the last ``n`` elements of ``x`` (default: the weight's size, else
    the last axis): LayerNorm (``centered``) or RMSNorm, optionally after adding ``residual``.

    Returns ``(y, s)``: ``y`` shaped and typed like ``x``; ``s = x + residual`` (None without a
    residual). Inputs are assumed valid (the public wrappers check them). ``ops``: the forward's
    (custom op, eager Function, launch) -- this module's by default; :mod:`.rows_once` passes its own.
    """
    ops = ops or (rows_fwd, _RowsEager, _rows_fwd_impl)
    if n is None:
        n = weight.numel() if weight is not None else x.shape[-1]
    shape = x.shape
    # the kernels need unit-stride rows; any row stride is fine, so only a non-unit last stride
    # (or leading axes that cannot be flattened into one row stride) costs a copy. The stride is
    # read on the (rows, n) view, not on x: a row over several axes can be a view of stride != 1
    # although x's last stride is 1 -- x[..., ::2].unsqueeze(-1) over (k, 1) flattens to stride 2
    x2, r2 = _unit_rows(x, n), None
    if residual is not None:
        r2 = _unit_rows(residual, n)
    w, b = dense(weight), dense(bias)
    args = (x2, w, b, r2, float(eps), bool(centered), float(weight_offset), bool(residual_fp32))
    y, s, _, _ = _eager.call(*ops, *args)
    return y.view(shape), (s.view(shape) if residual is not None else None)
