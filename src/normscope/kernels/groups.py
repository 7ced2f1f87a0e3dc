# ruff: noqa: UP007, UP045  -- torch.library reads custom-op schemas from typing.Optional annotations
"""Fused Triton kernels for GroupNorm and InstanceNorm on (N, C, *) inputs, forward and backward.

What this covers
----------------
The canonical view is ``(N * G)`` groups, each a contiguous ``(Cg, HW)`` block of a contiguous
(N, C, *) tensor: ``Cg = C / G`` channels of ``HW`` positions. GroupNorm(G, C) is that view;
InstanceNorm is ``G = C`` (``Cg = 1``); GroupNorm(1, C) -- LayerNorm over (C, *) with a
per-channel affine -- is ``G = 1``. One program normalizes one group, walking it in
``(BLOCK_C, BLOCK_S)`` tiles: a statistics pass (Chan's combination of per-tile mean and M2, on
values shifted by the group's first element), then a normalize pass with the per-channel affine.
Statistics and the saved mean/rstd are fp32.

Backward: a pass for the two row sums, then a pass writing dx and, per channel of the group, the
partial sums ``sum_s dy * xhat`` and ``sum_s dy`` into an ``(N * G, Cg)`` fp32 buffer; one
``.sum(0)`` over the batch finishes dW/dB (deterministic, no atomics).

Limits
------
* channels_last (and any non-contiguous) input is copied to contiguous NCHW first: there is no
  channels_last kernel yet, so it pays one extra read and write.
* Each group is read twice in the forward and three times in the backward (the passes); a group
  small enough for registers would need one read -- not specialised yet.
* Parameters are heuristics, not measured on a GPU yet.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .rows import _next_pow2, use_kernel

__all__ = ["group_norm", "group_norm_ref"]

#: Elements per tile.
TILE = 2048


@triton.jit
def _groups_fwd_kernel(
    X, W, B, Y, MEAN, RSTD,
    G, Cg, HW, eps,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    CENTERED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    row = pid.to(tl.int64)
    g = pid % G
    L = Cg * HW
    X += row * L
    Y += row * L
    oc = tl.arange(0, BLOCK_C)
    os_ = tl.arange(0, BLOCK_S)
    k = tl.load(X).to(tl.float32)
    n_a = 0.0
    mean_a = 0.0
    m2_a = 0.0
    for c0 in range(0, Cg, BLOCK_C):
        c = c0 + oc
        for s0 in range(0, HW, BLOCK_S):
            s = s0 + os_
            mask = (c < Cg)[:, None] & (s < HW)[None, :]
            x = tl.load(X + c[:, None] * HW + s[None, :], mask=mask, other=0.0).to(tl.float32)
            if CENTERED:
                x = tl.where(mask, x - k, 0.0)
                n_b = (tl.minimum(Cg - c0, BLOCK_C) * tl.minimum(HW - s0, BLOCK_S)).to(tl.float32)
                mean_b = tl.sum(tl.sum(x, axis=1), axis=0) / n_b
                dd = tl.where(mask, x - mean_b, 0.0)
                m2_b = tl.sum(tl.sum(dd * dd, axis=1), axis=0)
                n = n_a + n_b
                delta = mean_b - mean_a
                mean_a = mean_a + delta * (n_b / n)
                m2_a = m2_a + m2_b + delta * delta * (n_a * n_b / n)
                n_a = n
            else:
                m2_a = m2_a + tl.sum(tl.sum(x * x, axis=1), axis=0)
    if CENTERED:
        mean = k + mean_a
    else:
        mean = 0.0
    rstd = tl.rsqrt(m2_a / L + eps)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    for c0 in range(0, Cg, BLOCK_C):
        c = c0 + oc
        cmask = c < Cg
        if HAS_WEIGHT:
            w = tl.load(W + g * Cg + c, mask=cmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(B + g * Cg + c, mask=cmask, other=0.0).to(tl.float32)
        for s0 in range(0, HW, BLOCK_S):
            s = s0 + os_
            mask = cmask[:, None] & (s < HW)[None, :]
            offs = c[:, None] * HW + s[None, :]
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean) * rstd
            if HAS_WEIGHT:
                y = y * w[:, None]
            if HAS_BIAS:
                y = y + b[:, None]
            tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _groups_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DWP, DBP,
    G, Cg, HW,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    CENTERED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    row = pid.to(tl.int64)
    g = pid % G
    L = Cg * HW
    X += row * L
    DY += row * L
    DX += row * L
    oc = tl.arange(0, BLOCK_C)
    os_ = tl.arange(0, BLOCK_S)
    rstd = tl.load(RSTD + row)
    if CENTERED:
        mean = tl.load(MEAN + row)
    else:
        mean = 0.0
    c1 = 0.0
    c2 = 0.0
    for c0 in range(0, Cg, BLOCK_C):
        c = c0 + oc
        cmask = c < Cg
        if HAS_WEIGHT:
            w = tl.load(W + g * Cg + c, mask=cmask, other=0.0).to(tl.float32)
        for s0 in range(0, HW, BLOCK_S):
            s = s0 + os_
            mask = cmask[:, None] & (s < HW)[None, :]
            offs = c[:, None] * HW + s[None, :]
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            if HAS_WEIGHT:
                gy = dy * w[:, None]
            else:
                gy = dy
            c1 += tl.sum(tl.sum(gy * xhat, axis=1), axis=0)
            c2 += tl.sum(tl.sum(gy, axis=1), axis=0)
    c1 = c1 / L
    c2 = c2 / L
    for c0 in range(0, Cg, BLOCK_C):
        c = c0 + oc
        cmask = c < Cg
        if HAS_WEIGHT:
            w = tl.load(W + g * Cg + c, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_C], dtype=tl.float32)
        db = tl.zeros([BLOCK_C], dtype=tl.float32)
        for s0 in range(0, HW, BLOCK_S):
            s = s0 + os_
            mask = cmask[:, None] & (s < HW)[None, :]
            offs = c[:, None] * HW + s[None, :]
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            if HAS_WEIGHT:
                gy = dy * w[:, None]
            else:
                gy = dy
            if CENTERED:
                dx = (gy - (xhat * c1 + c2)) * rstd
            else:
                dx = (gy - xhat * c1) * rstd
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * xhat, axis=1)
            db += tl.sum(dy, axis=1)
        if HAS_WEIGHT:
            tl.store(DWP + row * Cg + c, dw, mask=cmask)
        if HAS_BIAS:
            tl.store(DBP + row * Cg + c, db, mask=cmask)


def _blocks(cg: int, hw: int) -> tuple[int, int, int]:
    bs = min(_next_pow2(hw), TILE)
    bc = max(1, min(_next_pow2(cg), TILE // bs))
    return bc, bs, min(8, max(1, bc * bs // 256))


def _view(x: Tensor, groups: int) -> tuple[int, int, int]:
    n, c = x.shape[0], x.shape[1]
    return n * groups, c // groups, x[0, 0].numel() if x.dim() > 2 else 1


# ---- the reference, next to the kernel


def group_norm_ref(
    x: Tensor,
    groups: int,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    centered: bool = True,
) -> Tensor:
    """Plain-PyTorch GroupNorm over (N, C, *) (``centered=False``: the RMS variant), fp32 statistics."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xg = x.to(acc).reshape(x.shape[0], groups, -1)
    if centered:
        xg = xg - xg.mean(-1, keepdim=True)
    y = (xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + eps)).reshape(x.shape)
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    if weight is not None:
        y = y * weight.to(acc).reshape(shape)
    if bias is not None:
        y = y + bias.to(acc).reshape(shape)
    return y.to(x.dtype)


def _ref_fwd(x, weight, bias, groups, eps, centered):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xg = x.to(acc).reshape(x.shape[0] * groups, -1)
    if centered:
        var, mean = torch.var_mean(xg, -1, correction=0)
    else:
        var, mean = xg.square().mean(-1), torch.zeros(xg.shape[0], dtype=acc, device=x.device)
    return group_norm_ref(x, groups, weight, bias, eps, centered), mean.float(), torch.rsqrt(var + eps).float()


def _ref_bwd(dy, x, weight, mean, rstd, groups, centered, has_bias):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    n, c = x.shape[0], x.shape[1]
    shape = [1, c] + [1] * (x.dim() - 2)
    xg = x.to(acc).reshape(n * groups, -1)
    xhat = ((xg - mean.to(acc)[:, None]) * rstd.to(acc)[:, None]).reshape(x.shape)
    dyf = dy.to(acc)
    gy = dyf * weight.to(acc).reshape(shape) if weight is not None else dyf
    gg, hg = gy.reshape(n * groups, -1), xhat.reshape(n * groups, -1)
    length = gg.shape[1]
    dx = gg - hg * (gg * hg).sum(-1, keepdim=True) / length
    if centered:
        dx = dx - gg.sum(-1, keepdim=True) / length
    dx = (dx * rstd.to(acc)[:, None]).reshape(x.shape)
    red = [0] + list(range(2, x.dim()))
    return dx, (dyf * xhat).sum(red).float(), dyf.sum(red).float()


# ---- torch.library ops


@torch.library.custom_op("normscope::groups_fwd", mutates_args=())
def groups_fwd(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], groups: int, eps: float, centered: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd) for a contiguous (N, C, *) ``x``; statistics per (sample, group), fp32."""
    rows, cg, hw = _view(x, groups)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0 or cg * hw == 0:
        return y, mean, rstd
    if not use_kernel(x):
        yr, mr, rr = _ref_fwd(x, weight, bias, groups, eps, centered)
        y.copy_(yr), mean.copy_(mr), rstd.copy_(rr)
        return y, mean, rstd
    bc, bs, warps = _blocks(cg, hw)
    _groups_fwd_kernel[(rows,)](
        x, weight if weight is not None else x, bias if bias is not None else x, y, mean, rstd,
        groups, cg, hw, eps, BLOCK_C=bc, BLOCK_S=bs,
        CENTERED=centered, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, num_warps=warps,
    )  # fmt: skip
    return y, mean, rstd


@groups_fwd.register_fake
def _groups_fwd_fake(x, weight, bias, groups, eps, centered):
    rows = x.shape[0] * groups
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op("normscope::groups_bwd", mutates_args=())
def groups_bwd(
    dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor, groups: int, centered: bool,
    has_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dW fp32 or empty, dB fp32 or empty)."""
    rows, cg, hw = _view(x, groups)
    c = x.shape[1]
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    has_w = weight is not None
    empty = lambda: x.new_empty(0)  # noqa: E731 - a fresh one each time: outputs must not alias
    if rows == 0 or cg * hw == 0 or not use_kernel(x):
        if rows == 0 or cg * hw == 0:
            z = torch.zeros(c, dtype=torch.float32, device=x.device)
            return dx.zero_(), z if has_w else empty(), z.clone() if has_bias else empty()
        dxr, dw, db = _ref_bwd(dy, x, weight, mean, rstd, groups, centered, has_bias)
        dx.copy_(dxr)
        return dx, dw if has_w else empty(), db if has_bias else empty()
    bc, bs, warps = _blocks(cg, hw)
    dwp = torch.empty((rows, cg), dtype=torch.float32, device=x.device) if has_w else None
    dbp = torch.empty((rows, cg), dtype=torch.float32, device=x.device) if has_bias else None
    _groups_bwd_kernel[(rows,)](
        dy, x, weight if has_w else x, mean, rstd, dx, dwp if has_w else dx, dbp if has_bias else dx,
        groups, cg, hw, BLOCK_C=bc, BLOCK_S=bs,
        CENTERED=centered, HAS_WEIGHT=has_w, HAS_BIAS=has_bias, num_warps=warps,
    )  # fmt: skip
    # rows are (sample, group) and each holds its group's Cg channels: summing over samples leaves C
    n = x.shape[0]
    return (
        dx,
        dwp.view(n, c).sum(0) if has_w else empty(),
        dbp.view(n, c).sum(0) if has_bias else empty(),
    )


@groups_bwd.register_fake
def _groups_bwd_fake(dy, x, weight, mean, rstd, groups, centered, has_bias):
    c = x.shape[1]
    dw = x.new_empty((c,), dtype=torch.float32) if weight is not None else x.new_empty(0)
    db = x.new_empty((c,), dtype=torch.float32) if has_bias else x.new_empty(0)
    return torch.empty_like(x, memory_format=torch.contiguous_format), dw, db


def _setup_context(ctx, inputs, output):
    x, weight, bias, groups, eps, centered = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.groups, ctx.centered = groups, centered
    ctx.b_dtype = bias.dtype if bias is not None else None


def _backward(ctx, dy, dmean, drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = groups_bwd(
        dy.contiguous(), x, weight, mean, rstd, ctx.groups, ctx.centered, ctx.b_dtype is not None
    )
    dw = dw.to(weight.dtype) if weight is not None else None
    db = db.to(ctx.b_dtype) if ctx.b_dtype is not None else None
    return dx, dw, db, None, None, None


groups_fwd.register_autograd(_backward, setup_context=_setup_context)


def group_norm(
    x: Tensor,
    groups: int,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    centered: bool = True,
) -> Tensor:
    """GroupNorm over (N, C, *) with the fused kernel (``groups == C`` is InstanceNorm). Inputs are
    assumed valid. Non-contiguous input (channels_last included) is copied to NCHW first; the output
    has the input's memory format."""
    cl = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    y, _, _ = groups_fwd(
        x.contiguous(),
        weight.reshape(-1) if weight is not None else None,
        bias.reshape(-1) if bias is not None else None,
        int(groups), float(eps), bool(centered),
    )  # fmt: skip
    return y.contiguous(memory_format=torch.channels_last) if cl else y
