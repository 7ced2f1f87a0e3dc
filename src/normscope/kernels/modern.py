# ruff: noqa: UP007, UP045  -- torch.library reads custom-op schemas from typing.Optional annotations
"""Fused Triton kernels of the modern norms: the modulated (AdaLN) norm, and q + k norm in one launch.

What this covers
----------------
``y = norm(x) * (1 + scale) + shift`` over rows of ``N`` unit-stride columns (the last axis), where
``norm`` is LayerNorm (``CENTERED``) or RMSNorm with an optional per-column weight and bias, and
``shift``/``scale`` hold one row per ``rows_per`` consecutive rows of x: ``rows_per = S`` for a
per-sample modulation (B, D) of x (B, S, D), 1 for a per-token one. One read of x, one write of y;
statistics in fp32, saved (mean, rstd) fp32; the result rounded once to x's dtype -- the
``casting="fp32"`` semantics of :func:`normscope.functional_modern.modulated_norm`.

Backward: one kernel computes dx and, per row, ``dscale_row = dy * norm(x)`` (fp32); dW/dB are
per-program fp32 partial rows summed once; dshift/dscale of a per-sample modulation are the
per-row terms summed over each sample's rows by one fixed-order ``sum`` -- deterministic, no
atomics (the price: an (M, N) fp32 buffer for dscale's per-row terms).

QK-norm: :func:`qk_rows` normalizes the rows of q and of k (``head_dim`` per head, or the whole
projected width) in **one** forward launch -- programs ``[0, q blocks)`` take q's rows, the rest
k's, each with its own weight -- scaled by ``w + weight_offset`` formed in fp32 and rounded once
(Gemma's casting; Qwen's "llama" casting rounds before scaling and is left to the unfused path).
Its backward runs the rows kernel's backward once for q and once for k.

PolyNorm (:func:`poly_rows`): the three RMSNorms of ``x^3``, ``x^2``, ``x`` of a row from one read of
x, powers formed in fp32 (``x^3`` of bf16 input in bf16 would keep 8 bits), one rounding; the
backward is one launch too, with dW (3,) and dB (1,) as per-program fp32 partials. Derf
(:func:`derf_rows`): element-wise over rows, the same partial scheme for d alpha, d shift, d gamma,
d beta.

The row body (load, fp32 statistics, normalize and affine, the backward's row reductions) is the rows
kernel's, from :mod:`._rowbody`, so a row normalizes to the same bits here as in :mod:`.rows`; the
references (:func:`modulated_ref`, ``poly_ref``, ``derf_ref``) are in :mod:`._ref`.

Limits
------
* Rows up to ``config.ROWS_MAX_FUSED_N`` (16K) elements, in registers; longer rows are declined by
  the door (:mod:`normscope.backends.triton`) with that reason, and run unfused.
* Offsets are int64 (rows * stride), so tensors past 2^31 elements index correctly.
* Double backward (``create_graph=True``) differentiates the plain-PyTorch reference instead.
* ``torch.compile(fullgraph=True)`` traces through them without a graph break: every forward and
  backward is a ``torch.library`` op (``normscope::modulated_fwd``, ``qk_fwd``, ``poly_fwd``,
  ``derf_fwd`` and their ``*_bwd``; q + k's backward is ``rows_bwd``) with a fake implementation and
  its autograd registered, as the rows and groups kernels are. Eager autograd runs the same registered
  backward: one code path, the same numbers (tests/kernels/test_modern_kernels_compile.py). Each op is opaque
  to the compiler, so nothing around it is fused into the kernel.
"""

from typing import Optional  # noqa: F401  (custom_op schemas are read from these annotations)

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _eager, config
from ._common import bwd_grid, dense, use_kernel
from ._common import rows2d as _rows2d
from ._common import rows_config as _config
from ._ref import derf_ref, modulated_ref, poly_ref, rows_ref
from ._rowbody import load_cols, load_rows, normalize_rows, row_block, row_dx, row_xhat
from .rows import _rows_bwd_impl, rows_bwd

__all__ = ["modulated_rows", "modulated_ref", "qk_rows", "poly_rows", "derf_rows"]


@triton.jit
def _mod_fwd_kernel(
    X, W, B, SHIFT, SCALE, Y, MEAN, RSTD,
    stride_x, stride_y, stride_shift, stride_scale,
    M, N, per_shift, per_scale, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CENTERED: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_SCALE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows, cols, rmask, cmask, mask, r64 = row_block(pid * BLOCK_M, M, N, BLOCK_M, BLOCK_N)
    x = load_rows(X, r64, stride_x, cols, mask)
    y = normalize_rows(x, W, B, MEAN, RSTD, rows, rmask, cols, cmask, mask, N, eps, 0.0,
                       BLOCK_M, CENTERED, HAS_WEIGHT, HAS_BIAS)  # fmt: skip
    if HAS_SCALE:
        y = y * (1.0 + load_rows(SCALE, (rows // per_scale).to(tl.int64)[:, None], stride_scale, cols, mask))
    if HAS_SHIFT:
        y = y + load_rows(SHIFT, (rows // per_shift).to(tl.int64)[:, None], stride_shift, cols, mask)
    tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _mod_bwd_kernel(
    DY, X, W, B, SCALE, MEAN, RSTD, DX, DW, DB, DSC,
    stride_dy, stride_x, stride_scale, stride_dx,
    M, N, per_scale, rows_per_prog,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CENTERED: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_WEIGHT:
        w = load_cols(W, cols, cmask)
    if HAS_BIAS:
        b = load_cols(B, cols, cmask)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_prog
    for start in range(0, rows_per_prog, BLOCK_M):  # rows_per_prog is a multiple of BLOCK_M (bwd_grid)
        rows, cols, rmask, cmask, mask, r64 = row_block(first + start, M, N, BLOCK_M, BLOCK_N)
        x = load_rows(X, r64, stride_x, cols, mask)
        dy = load_rows(DY, r64, stride_dy, cols, mask)
        xhat, rstd = row_xhat(x, MEAN, RSTD, rows, rmask, mask, CENTERED)
        if HAS_SCALE:
            sc = load_rows(SCALE, (rows // per_scale).to(tl.int64)[:, None], stride_scale, cols, mask)
            n = xhat
            if HAS_WEIGHT:
                n = n * w[None, :]
            if HAS_BIAS:
                n = n + b[None, :]
            # d y / d scale = norm(x): the per-row term, summed per sample outside (fixed order)
            tl.store(DSC + r64 * N + cols[None, :], dy * n, mask=mask)
            g = dy * (1.0 + sc)
        else:
            g = dy
        db += tl.sum(g, axis=0)
        dw += tl.sum(g * xhat, axis=0)
        if HAS_WEIGHT:
            g = g * w[None, :]
        dx = row_dx(g, xhat, rstd, N, CENTERED)
        tl.store(DX + r64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        tl.store(DW + pid.to(tl.int64) * N + cols, dw, mask=cmask)
    if HAS_BIAS:
        tl.store(DB + pid.to(tl.int64) * N + cols, db, mask=cmask)


# The ops below follow rows.py: the schema is read from plain ``typing`` annotations; optional
# outputs are empty tensors (an op returns no None); outputs never alias inputs.


def _modulated_fwd_impl(
    x: Tensor,
    shift: Optional[Tensor],
    scale: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    centered: bool,
    per_shift: int,
    per_scale: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd) for a 2-D ``x`` with unit-stride rows; ``shift``/``scale`` hold one row per
    ``per_shift``/``per_scale`` rows of x."""
    M, N = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    block_m, block_n, _, warps = _config(N)
    _mod_fwd_kernel[(triton.cdiv(M, block_m),)](
        x, weight if weight is not None else x, bias if bias is not None else x,
        shift if shift is not None else x, scale if scale is not None else x, y, mean, rstd,
        x.stride(0), y.stride(0), shift.stride(0) if shift is not None else 0,
        scale.stride(0) if scale is not None else 0,
        M, N, per_shift, per_scale, eps,
        BLOCK_M=block_m, BLOCK_N=block_n, CENTERED=centered, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None, HAS_SHIFT=shift is not None, HAS_SCALE=scale is not None,
        num_warps=warps,
    )  # fmt: skip
    return y, mean, rstd


modulated_fwd = torch.library.custom_op("normscope::modulated_fwd", mutates_args=())(_modulated_fwd_impl)


@modulated_fwd.register_fake
def _modulated_fwd_fake(x, shift, scale, weight, bias, eps, centered, per_shift, per_scale):
    M = x.shape[0]
    return torch.empty_like(x), x.new_empty((M,), dtype=torch.float32), x.new_empty((M,), dtype=torch.float32)


def _modulated_bwd_impl(
    dy: Tensor,
    x: Tensor,
    scale: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    centered: bool,
    per_scale: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx in x's dtype, dW fp32 (N,) or empty, dB fp32 (N,) or empty, d scale's per-row terms
    ``dy * norm(x)`` fp32 (M, N) or empty -- summed per sample by the caller, in a fixed order)."""
    M, N = x.shape
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()  # a stride-0 gradient from .sum() (QuACK #88)
    dx = torch.empty_like(x)
    block_m, block_n, _, warps = _config(N)
    progs, rows_per_prog = bwd_grid(x, M, block_m, config.ROWS_BWD_PROGRAMS_PER_SM)
    dw = torch.empty((progs, N), dtype=torch.float32, device=x.device) if weight is not None else None
    db = torch.empty((progs, N), dtype=torch.float32, device=x.device) if bias is not None else None
    dsc = torch.empty((M, N), dtype=torch.float32, device=x.device) if scale is not None else x.new_empty(0)
    _mod_bwd_kernel[(progs,)](
        dy, x, weight if weight is not None else x, bias if bias is not None else x,
        scale if scale is not None else x, mean, rstd, dx,
        dw if dw is not None else dx, db if db is not None else dx, dsc if scale is not None else dx,
        dy.stride(0), x.stride(0), scale.stride(0) if scale is not None else 0, dx.stride(0),
        M, N, per_scale, rows_per_prog,
        BLOCK_M=block_m, BLOCK_N=block_n, CENTERED=centered, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, num_warps=warps,
    )  # fmt: skip
    # the second, fixed-order stage of the dW/dB reduction: deterministic, no atomics
    return (
        dx,
        dw.sum(0) if dw is not None else x.new_empty(0),
        db.sum(0) if db is not None else x.new_empty(0),
        dsc,
    )


modulated_bwd = torch.library.custom_op("normscope::modulated_bwd", mutates_args=())(_modulated_bwd_impl)


@modulated_bwd.register_fake
def _modulated_bwd_fake(dy, x, scale, weight, bias, mean, rstd, centered, per_scale):
    M, N = x.shape
    vec = lambda present: x.new_empty((N,) if present else (0,), dtype=torch.float32)  # noqa: E731
    dsc = x.new_empty((M, N) if scale is not None else (0,), dtype=torch.float32)
    return torch.empty_like(x), vec(weight is not None), vec(bias is not None), dsc


def _modulated_setup_context(ctx, inputs, output):
    x, shift, scale, weight, bias, eps, centered, per_shift, per_scale = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, shift, scale, weight, bias, mean, rstd)
    ctx.args = (eps, centered, per_shift, per_scale)


def _modulated_backward(ctx, dy, dmean, drstd):
    x, shift, scale, weight, bias, mean, rstd = ctx.saved_tensors
    eps, centered, per_shift, per_scale = ctx.args
    if dy is None:
        dy = torch.zeros_like(x)
    if torch.is_grad_enabled():  # create_graph=True: differentiate the reference instead
        # on the saved inputs themselves, so the gradients stay connected to the caller's graph
        inputs = (x, shift, scale, weight, bias)
        with torch.enable_grad():
            y = modulated_ref(*inputs, eps, centered, per_shift, per_scale)
        live = [t for t in inputs if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(y, live, dy, create_graph=True, allow_unused=True))
        out = [next(grads) if t is not None and t.requires_grad else None for t in inputs]
        return (*out, None, None, None, None)
    N = x.shape[1]
    dx, dw, db, dsc = _eager.pick(
        modulated_bwd, _modulated_bwd_impl, dy, x, scale, weight, bias, mean, rstd, centered, per_scale
    )
    d_shift = d_scale = None
    need = ctx.needs_input_grad
    if shift is not None and need[1]:  # fixed-order sums over each sample's rows: deterministic
        d_shift = dy.float().reshape(-1, per_shift, N).sum(1).to(shift.dtype)
    if scale is not None and need[2]:
        d_scale = dsc.reshape(-1, per_scale, N).sum(1).to(scale.dtype)
    d_w = dw.to(weight.dtype) if weight is not None and need[3] else None
    d_b = db.to(bias.dtype) if bias is not None and need[4] else None
    return dx, d_shift, d_scale, d_w, d_b, None, None, None, None


modulated_fwd.register_autograd(_modulated_backward, setup_context=_modulated_setup_context)
_ModulatedEager = _eager.function(_modulated_fwd_impl, _modulated_setup_context, _modulated_backward)


def modulated_rows(
    x: Tensor,
    shift: Tensor | None,
    scale: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    centered: bool,
) -> Tensor:
    """``norm(x) * (1 + scale) + shift`` over x's last axis; ``shift``/``scale`` per sample (B, N)
    or per token (x's shape). Inputs are assumed checked (the door, :mod:`normscope.backends.triton`)."""
    shape, N = x.shape, x.shape[-1]
    x2 = _rows2d(x if x.stride(-1) == 1 else x.contiguous(), N)
    M = x2.shape[0]

    def rowwise(t: Tensor | None) -> tuple[Tensor | None, int]:
        if t is None:
            return None, 1
        per = 1 if tuple(t.shape) == tuple(shape) or t.shape[0] == 0 else M // t.shape[0]
        t2 = _rows2d(t, N)
        return (t2 if t2.stride(-1) == 1 else t2.contiguous()), per

    (sh, per_shift), (sc, per_scale) = rowwise(shift), rowwise(scale)
    if not use_kernel(x2) or M * N == 0:  # empty: the reference, whose output autograd reaches
        return modulated_ref(x2, sh, sc, weight, bias, eps, centered, per_shift, per_scale).view(shape)
    args = (x2, sh, sc, dense(weight), dense(bias), float(eps), bool(centered), per_shift, per_scale)
    y, _, _ = _eager.call(modulated_fwd, _ModulatedEager, _modulated_fwd_impl, *args)
    return y.view(shape)


@triton.jit
def _rows_block(
    X, W, B, Y, MEAN, RSTD, stride_x, stride_y, M, N, eps, w_offset, blk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CENTERED: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """One block of BLOCK_M rows: statistics in fp32, scale (w + offset) in fp32, one rounding."""
    rows, cols, rmask, cmask, mask, r64 = row_block(blk * BLOCK_M, M, N, BLOCK_M, BLOCK_N)
    x = load_rows(X, r64, stride_x, cols, mask)
    y = normalize_rows(x, W, B, MEAN, RSTD, rows, rmask, cols, cmask, mask, N, eps, w_offset,
                       BLOCK_M, CENTERED, HAS_WEIGHT, HAS_BIAS)  # fmt: skip
    tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _qk_fwd_kernel(
    Q, K, WQ, WK, BQ, BK, YQ, YK, MEANQ, RSTDQ, MEANK, RSTDK,
    stride_q, stride_k, stride_yq, stride_yk, Mq, Mk, N, eps, w_offset, q_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CENTERED: tl.constexpr,
    HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr, HAS_BQ: tl.constexpr, HAS_BK: tl.constexpr,
):  # fmt: skip
    # q and k each have their own affine: either may come without weight or bias
    pid = tl.program_id(0)
    if pid < q_blocks:
        _rows_block(Q, WQ, BQ, YQ, MEANQ, RSTDQ, stride_q, stride_yq, Mq, N, eps, w_offset, pid,
                    BLOCK_M, BLOCK_N, CENTERED, HAS_WQ, HAS_BQ)  # fmt: skip
    else:
        _rows_block(K, WK, BK, YK, MEANK, RSTDK, stride_k, stride_yk, Mk, N, eps, w_offset, pid - q_blocks,
                    BLOCK_M, BLOCK_N, CENTERED, HAS_WK, HAS_BK)  # fmt: skip


def _qk_fwd_impl(
    q: Tensor,
    k: Tensor,
    wq: Optional[Tensor],
    wk: Optional[Tensor],
    bq: Optional[Tensor],
    bk: Optional[Tensor],
    eps: float,
    centered: bool,
    weight_offset: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(yq, yk, mean q, rstd q, mean k, rstd k) for 2-D q and k with rows of one length, in one launch.
    The backward is the rows kernel's (``normscope::rows_bwd``), once for q and once for k."""
    (Mq, N), Mk = q.shape, k.shape[0]
    yq, yk = torch.empty_like(q), torch.empty_like(k)
    stats = [torch.empty(m, dtype=torch.float32, device=q.device) for m in (Mq, Mq, Mk, Mk)]
    block_m, block_n, _, warps = _config(N)
    q_blocks = triton.cdiv(Mq, block_m)
    _qk_fwd_kernel[(q_blocks + triton.cdiv(Mk, block_m),)](
        q, k, q if wq is None else wq, k if wk is None else wk, q if bq is None else bq, k if bk is None else bk,
        yq, yk, *stats,
        q.stride(0), k.stride(0), yq.stride(0), yk.stride(0), Mq, Mk, N, eps, weight_offset, q_blocks,
        BLOCK_M=block_m, BLOCK_N=block_n, CENTERED=centered,
        HAS_WQ=wq is not None, HAS_WK=wk is not None, HAS_BQ=bq is not None, HAS_BK=bk is not None,
        num_warps=warps,
    )  # fmt: skip
    return yq, yk, *stats


qk_fwd = torch.library.custom_op("normscope::qk_fwd", mutates_args=())(_qk_fwd_impl)


@qk_fwd.register_fake
def _qk_fwd_fake(q, k, wq, wk, bq, bk, eps, centered, weight_offset):
    stats = [q.new_empty((m,), dtype=torch.float32) for m in (q.shape[0], q.shape[0], k.shape[0], k.shape[0])]
    return torch.empty_like(q), torch.empty_like(k), *stats


def _qk_setup_context(ctx, inputs, output):
    q, k, wq, wk, bq, bk, eps, centered, weight_offset = inputs
    ctx.save_for_backward(q, k, wq, wk, bq, bk, *output[2:])
    ctx.args = (eps, centered, weight_offset)


def _qk_backward(ctx, dyq, dyk, *dstats):
    q, k, wq, wk, bq, bk, mq, rq, mk, rk = ctx.saved_tensors
    eps, centered, offset = ctx.args
    if torch.is_grad_enabled():  # create_graph=True: differentiate the reference instead
        out = []
        for x, w, b, dy in ((q, wq, bq, dyq), (k, wk, bk, dyk)):
            ins = (x, w, b)
            live = [t for t in ins if t is not None and t.requires_grad]
            with torch.enable_grad():
                y = rows_ref(x, w, b, eps, centered, weight_offset=offset)[0]
            if dy is None:
                dy = torch.zeros_like(y)
            g = iter(torch.autograd.grad(y, live, dy, create_graph=True, allow_unused=True) if live else ())
            out.append([next(g) if t is not None and t.requires_grad else None for t in ins])
        (dq, dwq, dbq), (dk, dwk, dbk) = out
        return dq, dk, dwq, dwk, dbq, dbk, None, None, None
    grads = []
    for x, w, b, m, r, dy in ((q, wq, bq, mq, rq, dyq), (k, wk, bk, mk, rk, dyk)):
        if dy is None:
            dy = torch.zeros_like(x)
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()  # stride 0 from .sum() (QuACK #88)
        grads.append(
            _eager.pick(rows_bwd, _rows_bwd_impl, dy.contiguous(), None, x, w, m, r, centered, b is not None, offset)
        )
    (dq, dwq, dbq), (dk, dwk, dbk) = grads
    cast = lambda t, like: t.to(like.dtype) if like is not None else None  # noqa: E731
    return dq, dk, cast(dwq, wq), cast(dwk, wk), cast(dbq, bq), cast(dbk, bk), None, None, None


qk_fwd.register_autograd(_qk_backward, setup_context=_qk_setup_context)
_QKEager = _eager.function(_qk_fwd_impl, _qk_setup_context, _qk_backward)


def qk_rows(
    q: Tensor,
    k: Tensor,
    n: int,
    wq: Tensor | None,
    wk: Tensor | None,
    bq: Tensor | None,
    bk: Tensor | None,
    eps: float,
    centered: bool,
    weight_offset: float,
) -> tuple[Tensor, Tensor]:
    """q and k normalized over rows of their last ``n`` elements, in one forward launch. Inputs are
    assumed checked by the door."""
    shapes = q.shape, k.shape
    q2, k2 = (_rows2d(t.contiguous(), n) for t in (q, k))  # a transposed (B, H, S, D) view is copied once
    ws = [dense(t) for t in (wq, wk, bq, bk)]
    if not use_kernel(q2) or q2.numel() == 0 or k2.numel() == 0:  # empty: the reference, as below
        yq = rows_ref(q2, ws[0], ws[2], eps, centered, weight_offset=weight_offset)[0]
        yk = rows_ref(k2, ws[1], ws[3], eps, centered, weight_offset=weight_offset)[0]
    else:
        args = (q2, k2, *ws, float(eps), bool(centered), float(weight_offset))
        yq, yk, *_ = _eager.call(qk_fwd, _QKEager, _qk_fwd_impl, *args)
    return yq.view(shapes[0]), yk.view(shapes[1])


# -- PolyNorm --------------------------------------------------------------------------------------


@triton.jit
def _poly_fwd_kernel(
    X, W, B, Y, RSTD, stride_x, stride_y, M, N, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows, cols, rmask, cmask, mask, r64 = row_block(pid * BLOCK_M, M, N, BLOCK_M, BLOCK_N)
    x1 = load_rows(X, r64, stride_x, cols, mask)
    x2 = x1 * x1
    x3 = x2 * x1
    r3 = tl.rsqrt(tl.sum(x3 * x3, axis=1) / N + eps)
    r2 = tl.rsqrt(tl.sum(x2 * x2, axis=1) / N + eps)
    r1 = tl.rsqrt(tl.sum(x1 * x1, axis=1) / N + eps)
    tl.store(RSTD + rows * 3, r3, mask=rmask)
    tl.store(RSTD + rows * 3 + 1, r2, mask=rmask)
    tl.store(RSTD + rows * 3 + 2, r1, mask=rmask)
    w0 = tl.load(W).to(tl.float32)
    w1 = tl.load(W + 1).to(tl.float32)
    w2 = tl.load(W + 2).to(tl.float32)
    b = tl.load(B).to(tl.float32)
    y = w0 * (x3 * r3[:, None]) + w1 * (x2 * r2[:, None]) + w2 * (x1 * r1[:, None]) + b
    tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _poly_bwd_kernel(
    DY, X, W, RSTD, DX, DWB, stride_dy, stride_x, stride_dx, M, N, rows_per_prog,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w0 = tl.load(W).to(tl.float32)
    w1 = tl.load(W + 1).to(tl.float32)
    w2 = tl.load(W + 2).to(tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)  # column partials of dw0, dw1, dw2, db, reduced last
    a3 = tl.zeros([BLOCK_N], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_prog
    for start in range(0, rows_per_prog, BLOCK_M):  # rows_per_prog is a multiple of BLOCK_M (bwd_grid)
        rows, cols, rmask, cmask, mask, r64 = row_block(first + start, M, N, BLOCK_M, BLOCK_N)
        x1 = load_rows(X, r64, stride_x, cols, mask)
        dy = load_rows(DY, r64, stride_dy, cols, mask)
        r3 = tl.load(RSTD + rows * 3, mask=rmask, other=0.0)
        r2 = tl.load(RSTD + rows * 3 + 1, mask=rmask, other=0.0)
        r1 = tl.load(RSTD + rows * 3 + 2, mask=rmask, other=0.0)
        x2 = x1 * x1
        # each power is an RMSNorm of its own (u * r): its input gradient is the rows kernel's
        h3 = x2 * x1 * r3[:, None]
        h2 = x2 * r2[:, None]
        h1 = x1 * r1[:, None]
        d3 = row_dx(w0 * dy, h3, r3, N, False)
        d2 = row_dx(w1 * dy, h2, r2, N, False)
        d1 = row_dx(w2 * dy, h1, r1, N, False)
        dx = 3.0 * x2 * d3 + 2.0 * x1 * d2 + d1
        tl.store(DX + r64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        a3 += tl.sum(dy * h3, axis=0)
        a2 += tl.sum(dy * h2, axis=0)
        a1 += tl.sum(dy * h1, axis=0)
        acc += tl.sum(dy, axis=0)
    base = DWB + pid.to(tl.int64) * 4
    tl.store(base, tl.sum(a3, axis=0))
    tl.store(base + 1, tl.sum(a2, axis=0))
    tl.store(base + 2, tl.sum(a1, axis=0))
    tl.store(base + 3, tl.sum(acc, axis=0))


def _poly_fwd_impl(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y, rstd (M, 3) fp32: of x^3, x^2, x per row) for a 2-D ``x`` with unit-stride rows."""
    M, N = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty((M, 3), dtype=torch.float32, device=x.device)
    block_m, block_n, _, warps = _config(N)
    _poly_fwd_kernel[(triton.cdiv(M, block_m),)](
        x, weight, bias, y, rstd, x.stride(0), y.stride(0), M, N, eps,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip
    return y, rstd


poly_fwd = torch.library.custom_op("normscope::poly_fwd", mutates_args=())(_poly_fwd_impl)


@poly_fwd.register_fake
def _poly_fwd_fake(x, weight, bias, eps):
    return torch.empty_like(x), x.new_empty((x.shape[0], 3), dtype=torch.float32)


def _poly_bwd_impl(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(dx in x's dtype, (dw0, dw1, dw2, db) fp32)."""
    M, N = x.shape
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    dx = torch.empty_like(x)
    block_m, block_n, _, warps = _config(N)
    progs, rows_per_prog = bwd_grid(x, M, block_m, config.ROWS_BWD_PROGRAMS_PER_SM)
    part = torch.empty((progs, 4), dtype=torch.float32, device=x.device)
    _poly_bwd_kernel[(progs,)](
        dy, x, weight, rstd, dx, part, dy.stride(0), x.stride(0), dx.stride(0), M, N, rows_per_prog,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip
    return dx, part.sum(0)  # the fixed-order second stage of the dW/dB reduction


poly_bwd = torch.library.custom_op("normscope::poly_bwd", mutates_args=())(_poly_bwd_impl)


@poly_bwd.register_fake
def _poly_bwd_fake(dy, x, weight, rstd):
    return torch.empty_like(x), x.new_empty((4,), dtype=torch.float32)


def _poly_setup_context(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias, output[1])
    ctx.eps = eps


def _poly_backward(ctx, dy, drstd):
    x, weight, bias, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x)
    if torch.is_grad_enabled():  # create_graph=True: differentiate the reference instead
        ins = (x, weight, bias)
        live = [t for t in ins if t.requires_grad]
        with torch.enable_grad():
            y = poly_ref(x, weight, bias, ctx.eps)
        g = iter(torch.autograd.grad(y, live, dy, create_graph=True, allow_unused=True))
        return (*[next(g) if t.requires_grad else None for t in ins], None)
    dx, total = _eager.pick(poly_bwd, _poly_bwd_impl, dy, x, weight, rstd)
    return dx, total[:3].to(weight.dtype), total[3:].to(bias.dtype), None


poly_fwd.register_autograd(_poly_backward, setup_context=_poly_setup_context)
_PolyEager = _eager.function(_poly_fwd_impl, _poly_setup_context, _poly_backward)


def poly_rows(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """PolyNorm over x's last axis (inputs assumed checked by the door)."""
    shape, N = x.shape, x.shape[-1]
    x2 = _rows2d(x if x.stride(-1) == 1 else x.contiguous(), N)
    w, b = dense(weight), dense(bias)
    if not use_kernel(x2) or x2.numel() == 0:  # empty: the reference, whose output autograd reaches
        return poly_ref(x2, w, b, eps).view(shape)
    return _eager.call(poly_fwd, _PolyEager, _poly_fwd_impl, x2, w, b, float(eps))[0].view(shape)


# -- Derf ------------------------------------------------------------------------------------------


@triton.jit
def _derf_fwd_kernel(
    X, A, S, W, B, Y, stride_x, stride_y, M, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows, cols, rmask, cmask, mask, r64 = row_block(pid * BLOCK_M, M, N, BLOCK_M, BLOCK_N)
    x = load_rows(X, r64, stride_x, cols, mask)
    y = tl.math.erf(x * tl.load(A).to(tl.float32) + tl.load(S).to(tl.float32))
    if HAS_WEIGHT:
        y = y * load_cols(W, cols, cmask)[None, :]
        y = y + load_cols(B, cols, cmask)[None, :]
    tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _derf_bwd_kernel(
    DY, X, A, S, W, DX, DWB, DAS, stride_dy, stride_x, stride_dx, M, N, rows_per_prog,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    a = tl.load(A).to(tl.float32)
    s = tl.load(S).to(tl.float32)
    if HAS_WEIGHT:
        w = load_cols(W, cols, cmask)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    da = tl.zeros([BLOCK_N], dtype=tl.float32)
    ds = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_prog
    for start in range(0, rows_per_prog, BLOCK_M):  # rows_per_prog is a multiple of BLOCK_M (bwd_grid)
        rows, cols, rmask, cmask, mask, r64 = row_block(first + start, M, N, BLOCK_M, BLOCK_N)
        x = load_rows(X, r64, stride_x, cols, mask)
        dy = load_rows(DY, r64, stride_dy, cols, mask)
        z = x * a + s
        g = dy
        if HAS_WEIGHT:
            dw += tl.sum(dy * tl.math.erf(z), axis=0)
            db += tl.sum(dy, axis=0)
            g = dy * w[None, :]
        dz = tl.where(mask, g * 1.1283791670955126 * tl.exp(-z * z), 0.0)  # erf'(z) = 2/sqrt(pi) e^(-z^2)
        da += tl.sum(dz * x, axis=0)
        ds += tl.sum(dz, axis=0)
        tl.store(DX + r64 * stride_dx + cols[None, :], (dz * a).to(DX.dtype.element_ty), mask=mask)
    p64 = pid.to(tl.int64)
    if HAS_WEIGHT:
        tl.store(DWB + p64 * 2 * N + cols, dw, mask=cmask)
        tl.store(DWB + p64 * 2 * N + N + cols, db, mask=cmask)
    tl.store(DAS + p64 * 2, tl.sum(da, axis=0))
    tl.store(DAS + p64 * 2 + 1, tl.sum(ds, axis=0))


def _derf_fwd_impl(x: Tensor, alpha: Tensor, shift: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    """``erf(alpha * x + shift)`` (then ``* weight + bias``) for a 2-D ``x`` with unit-stride rows."""
    M, N = x.shape
    y = torch.empty_like(x)
    block_m, block_n, _, warps = _config(N)
    has_w = weight is not None
    _derf_fwd_kernel[(triton.cdiv(M, block_m),)](
        x, alpha, shift, weight if has_w else x, bias if has_w else x, y, x.stride(0), y.stride(0), M, N,
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_WEIGHT=has_w, num_warps=warps,
    )  # fmt: skip
    return y


derf_fwd = torch.library.custom_op("normscope::derf_fwd", mutates_args=())(_derf_fwd_impl)


@derf_fwd.register_fake
def _derf_fwd_fake(x, alpha, shift, weight, bias):
    return torch.empty_like(x)


def _derf_bwd_impl(
    dy: Tensor, x: Tensor, alpha: Tensor, shift: Tensor, weight: Optional[Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx in x's dtype, (d alpha, d shift) fp32, (dW, dB) fp32 (2, N) or empty)."""
    M, N = x.shape
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    dx = torch.empty_like(x)
    block_m, block_n, _, warps = _config(N)
    progs, rows_per_prog = bwd_grid(x, M, block_m, config.ROWS_BWD_PROGRAMS_PER_SM)
    has_w = weight is not None
    dwb = torch.empty((progs, 2, N), dtype=torch.float32, device=x.device) if has_w else None
    das = torch.empty((progs, 2), dtype=torch.float32, device=x.device)
    _derf_bwd_kernel[(progs,)](
        dy, x, alpha, shift, weight if has_w else x, dx, dwb if has_w else das, das,
        dy.stride(0), x.stride(0), dx.stride(0), M, N, rows_per_prog,
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_WEIGHT=has_w, num_warps=warps,
    )  # fmt: skip
    # fixed-order second stages: deterministic
    return dx, das.sum(0), dwb.sum(0) if has_w else x.new_empty(0)


derf_bwd = torch.library.custom_op("normscope::derf_bwd", mutates_args=())(_derf_bwd_impl)


@derf_bwd.register_fake
def _derf_bwd_fake(dy, x, alpha, shift, weight):
    dwb = x.new_empty((2, x.shape[1]) if weight is not None else (0,), dtype=torch.float32)
    return torch.empty_like(x), x.new_empty((2,), dtype=torch.float32), dwb


def _derf_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _derf_backward(ctx, dy):
    x, alpha, shift, weight, bias = ctx.saved_tensors
    ins = (x, alpha, shift, weight, bias)
    if torch.is_grad_enabled():  # create_graph=True: differentiate the reference instead
        live = [t for t in ins if t is not None and t.requires_grad]
        with torch.enable_grad():
            y = derf_ref(*ins)
        g = iter(torch.autograd.grad(y, live, dy, create_graph=True, allow_unused=True))
        return tuple(next(g) if t is not None and t.requires_grad else None for t in ins)
    dx, d_as, dwb = _eager.pick(derf_bwd, _derf_bwd_impl, dy, x, alpha, shift, weight)
    d_alpha, d_shift = d_as[:1].to(alpha.dtype), d_as[1:].to(shift.dtype)
    if weight is None:
        return dx, d_alpha, d_shift, None, None
    return dx, d_alpha, d_shift, dwb[0].to(weight.dtype), dwb[1].to(bias.dtype)


derf_fwd.register_autograd(_derf_backward, setup_context=_derf_setup_context)
_DerfEager = _eager.function(_derf_fwd_impl, _derf_setup_context, _derf_backward)


def derf_rows(x: Tensor, alpha: Tensor, shift: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """Derf over x with the features on the last axis (inputs assumed checked by the door)."""
    shape, N = x.shape, x.shape[-1]
    x2 = _rows2d(x if x.stride(-1) == 1 else x.contiguous(), N)
    a, s, w, b = (dense(t) for t in (alpha, shift, weight, bias))
    if not use_kernel(x2) or x2.numel() == 0:  # empty: the reference, whose output autograd reaches
        return derf_ref(x2, a, s, w, b).view(shape)
    return _eager.call(derf_fwd, _DerfEager, _derf_fwd_impl, x2, a, s, w, b).view(shape)
