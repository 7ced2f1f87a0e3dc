# ruff: noqa: UP007, UP045  -- torch.library reads custom-op schemas from typing.Optional annotations
"""Fused Triton kernels for GroupNorm and InstanceNorm on (N, C, *) inputs, forward and backward.

What this covers
----------------
GroupNorm(G, C) normalizes each (sample, group): ``Cg = C / G`` channels of ``HW`` positions.
InstanceNorm is ``G = C`` (``Cg = 1``); GroupNorm(1, C) -- LayerNorm over (C, *) with a
per-channel affine -- is ``G = 1``. Two memory layouts are read and written in place:

**Contiguous (NCHW)**: each group is a contiguous ``(Cg, HW)`` block. One program normalizes one
group, walking it in ``(BLOCK_C, BLOCK_S)`` tiles: a statistics pass (Chan's combination of
per-tile mean and M2, on values shifted by the mean of the group's first tile), then a normalize pass with
the per-channel affine. Backward: a pass for the two row sums, then a pass writing dx and, per
channel of the group, the partial sums ``sum_s dy * xhat`` and ``sum_s dy`` into an ``(N * G, Cg)``
fp32 buffer; one ``.sum(0)`` over the batch finishes dW/dB (deterministic, no atomics).

**channels_last (4-D) / channels_last_3d (5-D)**: memory is ``(N, HW, C)`` with channels innermost,
so group g of sample n is a strided tile -- rows are positions, columns the channels
``[g*Cg, (g+1)*Cg)``, row stride C. The output (and dx) is written in the same layout, which is what
torch's CPU ``group_norm`` returns for such input. A program takes one sample, a block of
``BLOCK_G`` adjacent groups and one *split* of the positions, and walks it in
``(BLOCK_S, BLOCK_G, BLOCK_C)`` tiles, channels fastest: a tile row is one contiguous run of up to
``GROUPS_CL_WIDTH`` channels, so loads coalesce even when a group is narrow (InstanceNorm's ``Cg = 1``
would otherwise read one element per row). ``BLOCK_C = next_pow2(Cg)`` (capped at ``GROUPS_CL_WIDTH``;
wider groups are walked in channel blocks), so a non-power-of-two ``Cg`` leaves masked lanes.

Why split the positions (a two-stage scheme rather than one program per group): ``N * G`` programs
is 64 for a batch of 2 at G = 32 -- under half an H100's 132 SMs, each program walking a whole
group alone. The positions are cut into ``splits`` chunks of whole tiles so that about
``GROUPS_CL_PROGRAMS`` programs run for one sample (each holding at least ``GROUPS_CL_MIN_SPLIT`` elements;
small inputs get one split). The splits are a function of one sample's layout (G, Cg, HW), never of
the batch size: they fix a group's reduction order, and a sample's bits must not depend on how many
samples share its call (scope isolation, :mod:`normscope.engine`). The second stage is deterministic
and costs no extra pass over x:

* forward: stage 1 writes each split's per-group (mean, M2) -- on values shifted by the mean of the group's
  first tile, the same shift in every split -- to an ``(N * G, splits)`` fp32 buffer; in the
  normalize pass every program Chan-combines all splits of its groups in one fixed order (so every
  program of a group computes the same bits), split 0 stores the fp32 mean/rstd per (n, g);
* backward: stage 1 writes per split ``sum(gy * xhat)``, ``sum(gy)`` per group and the per-channel
  ``sum(dy * xhat)``, ``sum(dy)`` into ``(N * splits, C)`` fp32 buffers; the dx pass sums the
  former in a fixed order; one ``.sum(0)`` finishes dW/dB. No atomics: two runs give the same bits.

Limits
------
* Only contiguous, channels_last (4-D) and channels_last_3d (5-D) memory is read in place; any other
  strides (a 3-D (N, C, L) tensor stored as (N, L, C) included) are copied to contiguous NCHW once
  and give an NCHW output, as torch's ``group_norm`` does. In the backward an incoming gradient
  whose layout differs from x's is copied to x's layout.
* InstanceNorm (``G = C``) of channels_last input returns channels_last output, like torch's
  ``group_norm`` and normscope's reference backend; ``torch.nn.functional.instance_norm`` returns
  NCHW there (it normalizes a ``.contiguous()`` view).
* Two passes over every group (x twice in the forward, x and dy twice each in the backward); a
  group small enough for registers would need one read -- not specialised yet.
* Launch settings (``GROUPS_TILE``, ``GROUPS_CL_*``, warps, the split heuristic) live in
  :mod:`normscope.kernels.config`; they are heuristics, not measured on a GPU.

The reference (:func:`group_norm_ref`, what a CPU tensor without ``TRITON_INTERPRET=1`` and the
double backward run) is the rows reference on each (sample, group), in :mod:`._ref`.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._strides import strides_like_channels_last
from . import _eager, config
from ._common import chan_combine as _chan_combine
from ._common import dense, use_kernel
from ._common import next_pow2 as _next_pow2
from ._ref import group_norm_ref
from ._ref import groups_bwd_ref as _ref_bwd
from ._ref import groups_fwd_ref as _ref_fwd

__all__ = ["group_norm", "group_norm_ref"]


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
    # the shift: the mean of the group's first tile, not its first element -- an outlier there would
    # round every other deviation to its spacing (as in the rows kernels, _rowbody.row_stats); each
    # value scaled before the sum, so that it cannot overflow near fp32's max
    first = (oc < Cg)[:, None] & (os_ < HW)[None, :]
    k = tl.load(X + oc[:, None] * HW + os_[None, :], mask=first, other=0.0).to(tl.float32)
    k = tl.sum(tl.sum(k * (1.0 / (tl.minimum(Cg, BLOCK_C) * tl.minimum(HW, BLOCK_S))), axis=1), axis=0)
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
                n_a, mean_a, m2_a = _chan_combine(n_a, mean_a, m2_a, n_b, mean_b, m2_b)
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


# ---- channels_last: (N, HW, C) memory, channels innermost


@triton.jit
def _cl_offsets(g, c0, Cg, G, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr):
    """Channel index (within a sample) of each (group, channel) slot of a tile, and which are real."""
    c = c0 + tl.arange(0, BLOCK_C)
    ch = g[:, None] * Cg + c[None, :]
    return ch, (g < G)[:, None] & (c < Cg)[None, :]


@triton.jit
def _cl_tile(s, s_hi, C, ch, cmask):
    """Memory offsets (int64, from the sample's start) and mask of one (positions, groups, channels)
    tile: positions s (below s_hi real), channel slots ch of _cl_offsets."""
    offs = s.to(tl.int64)[:, None, None] * C + ch[None, :, :]
    return offs, (s < s_hi)[:, None, None] & cmask[None, :, :]


@triton.jit
def _cl_splits(rows, gmask, splits, BLOCK_P: tl.constexpr):
    """Offsets, mask and split index p of the (BLOCK_G, BLOCK_P) block of per-split partials of the
    groups ``rows`` (= n * G + g), stored as (N * G, splits)."""
    p = tl.arange(0, BLOCK_P)
    return rows.to(tl.int64)[:, None] * splits + p[None, :], gmask[:, None] & (p < splits)[None, :], p


@triton.jit
def _cl_program(G, C, HW, chunk, BLOCK_G: tl.constexpr):
    """Which work this program of a channels_last kernel has: its sample n, its split sp, its block of
    groups g (gmask: which are real), the sample's offset in memory, and the split's positions
    [s_lo, s_hi). The grid is (N * cdiv(G, BLOCK_G), splits)."""
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    gblocks = tl.cdiv(G, BLOCK_G)
    n = pid // gblocks
    g = (pid % gblocks) * BLOCK_G + tl.arange(0, BLOCK_G)
    s_lo = sp * chunk
    return n, sp, g, g < G, n.to(tl.int64) * HW * C, s_lo, tl.minimum(s_lo + chunk, HW)


@triton.jit
def _cl_shift(X, g, G, C, Cg, HW, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr):
    """The shift of each group of the block: the mean of its first tile (positions ``[0, BLOCK_S)``, the
    first ``BLOCK_C`` channels) -- a function of the group alone, so every split and the apply kernel
    compute the same bits. Not the group's first element: an outlier there would round every other
    deviation to its spacing. Each value is scaled before the sum, so that it cannot overflow."""
    ch, cmask = _cl_offsets(g, 0, Cg, G, BLOCK_G, BLOCK_C)
    offs, mask = _cl_tile(tl.arange(0, BLOCK_S), HW, C, ch, cmask)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    n0 = tl.minimum(HW, BLOCK_S) * tl.minimum(Cg, BLOCK_C)
    return tl.sum(tl.sum(x * (1.0 / n0), axis=2), axis=0)


@triton.jit
def _groups_cl_stats_kernel(
    X, PMEAN, PM2,
    G, C, Cg, HW, chunk, splits,
    BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, CENTERED: tl.constexpr,
):  # fmt: skip
    # program (n, group block, split): per group of the block, mean and M2 of its positions in the split
    n, sp, g, gmask, base, s_lo, s_hi = _cl_program(G, C, HW, chunk, BLOCK_G)
    X += base
    os_ = tl.arange(0, BLOCK_S)
    # every split of a group shifts by the same value (_cl_shift): the partial means are then small,
    # and combining them (in the apply kernel) keeps the digits of the deviations
    if CENTERED:
        k = _cl_shift(X, g, G, C, Cg, HW, BLOCK_S, BLOCK_G, BLOCK_C)
    n_a = 0.0
    mean_a = tl.zeros([BLOCK_G], dtype=tl.float32)
    m2_a = tl.zeros([BLOCK_G], dtype=tl.float32)
    for s0 in range(s_lo, s_hi, BLOCK_S):
        s = s0 + os_
        for c0 in range(0, Cg, BLOCK_C):
            ch, cmask = _cl_offsets(g, c0, Cg, G, BLOCK_G, BLOCK_C)
            offs, mask = _cl_tile(s, s_hi, C, ch, cmask)
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            if CENTERED:
                x = tl.where(mask, x - k[None, :, None], 0.0)
                n_b = (tl.minimum(s_hi - s0, BLOCK_S) * tl.minimum(Cg - c0, BLOCK_C)).to(tl.float32)
                mean_b = tl.sum(tl.sum(x, axis=2), axis=0) / n_b
                dd = tl.where(mask, x - mean_b[None, :, None], 0.0)
                m2_b = tl.sum(tl.sum(dd * dd, axis=2), axis=0)
                n_a, mean_a, m2_a = _chan_combine(n_a, mean_a, m2_a, n_b, mean_b, m2_b)
            else:
                m2_a = m2_a + tl.sum(tl.sum(x * x, axis=2), axis=0)
    rows = (n * G + g).to(tl.int64) * splits + sp
    if CENTERED:
        tl.store(PMEAN + rows, mean_a, mask=gmask)
    tl.store(PM2 + rows, m2_a, mask=gmask)


@triton.jit
def _cl_group_stats(
    X, PMEAN, PM2, n, g, gmask, G, C, Cg, HW, chunk, splits, eps,
    BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
    CENTERED: tl.constexpr,
):  # fmt: skip
    """(mean, rstd) per group of the block from the splits' partials, combined in a fixed order (every
    program of a group computes the same bits). X points at the sample."""
    offs, pmask, p = _cl_splits(n * G + g, gmask, splits, BLOCK_P)
    m2 = tl.sum(tl.load(PM2 + offs, mask=pmask, other=0.0), axis=1)
    L = (HW * Cg).to(tl.float32)
    if CENTERED:
        # Chan's combination of the splits: split p holds min(chunk, HW - p * chunk) positions
        cnt = tl.where(pmask, (tl.minimum(chunk, HW - p * chunk) * Cg).to(tl.float32)[None, :], 0.0)
        means = tl.load(PMEAN + offs, mask=pmask, other=0.0)
        mean_s = tl.sum(cnt * means, axis=1) / L
        d = means - mean_s[:, None]
        m2 = m2 + tl.sum(cnt * d * d, axis=1)
        mean = _cl_shift(X, g, G, C, Cg, HW, BLOCK_S, BLOCK_G, BLOCK_C) + mean_s
    else:
        mean = tl.zeros_like(m2)
    return mean, tl.rsqrt(m2 / L + eps)


@triton.jit
def _groups_cl_apply_kernel(
    X, W, B, Y, PMEAN, PM2, MEAN, RSTD,
    G, C, Cg, HW, chunk, splits, eps,
    BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
    CENTERED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    n, sp, g, gmask, base, s_lo, s_hi = _cl_program(G, C, HW, chunk, BLOCK_G)
    X += base
    Y += base
    mean, rstd = _cl_group_stats(X, PMEAN, PM2, n, g, gmask, G, C, Cg, HW, chunk, splits, eps,
                                 BLOCK_S, BLOCK_G, BLOCK_C, BLOCK_P, CENTERED)  # fmt: skip
    rows = n * G + g
    # split 0 stores the statistics. A branch, not `mask=gmask & (sp == 0)`: a block mask ANDed with a
    # scalar predicate holds int32 in Triton's interpreter, which 3.9's tl.store rejects
    if sp == 0:
        tl.store(MEAN + rows, mean, mask=gmask)
        tl.store(RSTD + rows, rstd, mask=gmask)
    os_ = tl.arange(0, BLOCK_S)
    for c0 in range(0, Cg, BLOCK_C):
        ch, cmask = _cl_offsets(g, c0, Cg, G, BLOCK_G, BLOCK_C)
        # y = (x - mean) * scale + bias per (group, channel) slot; never x * scale - mean * scale, which
        # cancels catastrophically when |mean| >> std
        scale = tl.broadcast_to(rstd[:, None], [BLOCK_G, BLOCK_C])
        if HAS_WEIGHT:
            scale = scale * tl.load(W + ch, mask=cmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(B + ch, mask=cmask, other=0.0).to(tl.float32)
        for s0 in range(s_lo, s_hi, BLOCK_S):
            s = s0 + os_
            offs, mask = _cl_tile(s, s_hi, C, ch, cmask)
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean[None, :, None]) * scale[None, :, :]
            if HAS_BIAS:
                y = y + b[None, :, :]
            tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _groups_cl_bwd_sums_kernel(
    DY, X, W, MEAN, RSTD, PC1, PC2, DWP, DBP,
    G, C, Cg, HW, chunk, splits,
    BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
    CENTERED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    # per group and split: sum(gy * xhat), sum(gy); per channel and split: sum(dy * xhat), sum(dy)
    n, sp, g, gmask, base, s_lo, s_hi = _cl_program(G, C, HW, chunk, BLOCK_G)
    X += base
    DY += base
    rows = n * G + g
    rstd = tl.load(RSTD + rows, mask=gmask, other=0.0)
    if CENTERED:
        mean = tl.load(MEAN + rows, mask=gmask, other=0.0)
    else:
        mean = tl.zeros([BLOCK_G], dtype=tl.float32)
    os_ = tl.arange(0, BLOCK_S)
    c1 = tl.zeros([BLOCK_G], dtype=tl.float32)
    c2 = tl.zeros([BLOCK_G], dtype=tl.float32)
    for c0 in range(0, Cg, BLOCK_C):
        ch, cmask = _cl_offsets(g, c0, Cg, G, BLOCK_G, BLOCK_C)
        if HAS_WEIGHT:
            w = tl.load(W + ch, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_G, BLOCK_C], dtype=tl.float32)
        db = tl.zeros([BLOCK_G, BLOCK_C], dtype=tl.float32)
        for s0 in range(s_lo, s_hi, BLOCK_S):
            s = s0 + os_
            offs, mask = _cl_tile(s, s_hi, C, ch, cmask)
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            xhat = tl.where(mask, (x - mean[None, :, None]) * rstd[None, :, None], 0.0)
            if HAS_WEIGHT:
                gy = dy * w[None, :, :]
            else:
                gy = dy
            c1 += tl.sum(tl.sum(gy * xhat, axis=2), axis=0)
            c2 += tl.sum(tl.sum(gy, axis=2), axis=0)
            dw += tl.sum(dy * xhat, axis=0)
            db += tl.sum(dy, axis=0)
        # row (n, split) of the (N * splits, C) partial buffers; each channel has one writer
        prow = (n * splits + sp).to(tl.int64) * C
        if HAS_WEIGHT:
            tl.store(DWP + prow + ch, dw, mask=cmask)
        if HAS_BIAS:
            tl.store(DBP + prow + ch, db, mask=cmask)
    prows = rows.to(tl.int64) * splits + sp
    tl.store(PC1 + prows, c1, mask=gmask)
    if CENTERED:
        tl.store(PC2 + prows, c2, mask=gmask)


@triton.jit
def _groups_cl_bwd_dx_kernel(
    DY, X, W, MEAN, RSTD, PC1, PC2, DX,
    G, C, Cg, HW, chunk, splits,
    BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
    CENTERED: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):  # fmt: skip
    n, sp, g, gmask, base, s_lo, s_hi = _cl_program(G, C, HW, chunk, BLOCK_G)
    X += base
    DY += base
    DX += base
    rows = n * G + g
    rstd = tl.load(RSTD + rows, mask=gmask, other=0.0)
    L = (HW * Cg).to(tl.float32)
    poffs, pmask, _ = _cl_splits(rows, gmask, splits, BLOCK_P)
    c1 = tl.sum(tl.load(PC1 + poffs, mask=pmask, other=0.0), axis=1) / L
    if CENTERED:
        mean = tl.load(MEAN + rows, mask=gmask, other=0.0)
        c2 = tl.sum(tl.load(PC2 + poffs, mask=pmask, other=0.0), axis=1) / L
    else:
        mean = tl.zeros([BLOCK_G], dtype=tl.float32)
        c2 = tl.zeros([BLOCK_G], dtype=tl.float32)
    os_ = tl.arange(0, BLOCK_S)
    for c0 in range(0, Cg, BLOCK_C):
        ch, cmask = _cl_offsets(g, c0, Cg, G, BLOCK_G, BLOCK_C)
        if HAS_WEIGHT:
            w = tl.load(W + ch, mask=cmask, other=0.0).to(tl.float32)
        for s0 in range(s_lo, s_hi, BLOCK_S):
            s = s0 + os_
            offs, mask = _cl_tile(s, s_hi, C, ch, cmask)
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            xhat = (x - mean[None, :, None]) * rstd[None, :, None]
            if HAS_WEIGHT:
                gy = dy * w[None, :, :]
            else:
                gy = dy
            dx = (gy - (xhat * c1[None, :, None] + c2[None, :, None])) * rstd[None, :, None]
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)


def _warps(tile: int) -> int:
    return min(config.GROUPS_MAX_WARPS, max(1, tile // config.GROUPS_WARP_ELEMS))


def _blocks(cg: int, hw: int) -> tuple[int, int, int]:
    """(BLOCK_C, BLOCK_S, num_warps) of the NCHW kernels (settings: kernels/config.py)."""
    bs = min(_next_pow2(hw), config.GROUPS_TILE)
    bc = max(1, min(_next_pow2(cg), config.GROUPS_TILE // bs))
    return bc, bs, _warps(bc * bs)


def _view(x: Tensor, groups: int) -> tuple[int, int, int]:
    n, c = x.shape[0], x.shape[1]
    return n * groups, c // groups, x[0, 0].numel() if x.dim() > 2 else 1


def _cl_config(groups: int, cg: int, hw: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_S, BLOCK_G, BLOCK_C, num_warps, chunk, splits) of the channels_last kernels (settings:
    ``GROUPS_CL_*`` in kernels/config.py).

    A function of one sample's layout only -- never of the batch size: the splits of a group's
    positions are its reduction order, so a group's bits would otherwise change with the samples
    around it (scope isolation, :mod:`normscope.engine`). The split count aims at
    ``GROUPS_CL_PROGRAMS`` programs for one sample; a larger batch has more programs anyway."""
    tile, width = config.GROUPS_CL_TILE, config.GROUPS_CL_WIDTH
    bc = min(_next_pow2(cg), width)  # a wider group is walked in several channel blocks
    bg = min(_next_pow2(groups), width // bc)
    bs = max(1, min(_next_pow2(hw), tile // (bg * bc)))
    programs = triton.cdiv(groups, bg)  # per sample
    most = max(1, hw * bg * cg // config.GROUPS_CL_MIN_SPLIT)  # splits that still hold that many elements
    # every program loads its groups' partials from all splits: keep that (BLOCK_G, splits) block <= a tile
    splits = max(1, min(triton.cdiv(config.GROUPS_CL_PROGRAMS, programs), most, triton.cdiv(hw, bs), tile // bg))
    chunk = triton.cdiv(triton.cdiv(hw, splits), bs) * bs  # positions per split, whole tiles
    return bs, bg, bc, _warps(bs * bg * bc), chunk, triton.cdiv(hw, chunk)


def _cl_format(x: Tensor) -> Optional[torch.memory_format]:
    """channels_last (4-D) or channels_last_3d (5-D) when that is x's layout and x is not also plain
    contiguous (C == 1 or one position: both layouts are the same memory; the NCHW kernel takes it)."""
    if x.is_contiguous():
        return None
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    if fmt is None or not x.is_contiguous(memory_format=fmt) or not strides_like_channels_last(x):
        return None  # torch's layout test: an (1, C, H, W) view torch calls contiguous-format is copied so
    return fmt


def _laid_out(x: Tensor) -> Tensor:
    """x itself when a kernel reads it in place (contiguous, channels_last, channels_last_3d); any
    other strides are copied to contiguous NCHW once -- torch's group_norm also returns NCHW for them
    (and for a 3-D (N, C, L) tensor stored as (N, L, C))."""
    return x if x.is_contiguous() or _cl_format(x) is not None else x.contiguous()


def _empty_out(x: Tensor) -> Tensor:
    """An output in the layout torch's CPU group_norm gives x: channels_last(_3d) in, the same out."""
    return torch.empty_like(x, memory_format=_cl_format(x) or torch.contiguous_format)


def _cl_fwd(x, weight, bias, y, mean, rstd, groups, eps, centered):
    n, c = x.shape[0], x.shape[1]
    cg, hw = c // groups, x[0, 0].numel()
    bs, bg, bc, warps, chunk, splits = _cl_config(groups, cg, hw)
    pm2 = torch.empty(n * groups * splits, dtype=torch.float32, device=x.device)
    pmean = torch.empty_like(pm2) if centered else pm2
    grid = (n * triton.cdiv(groups, bg), splits)
    _groups_cl_stats_kernel[grid](
        x, pmean, pm2, groups, c, cg, hw, chunk, splits,
        BLOCK_S=bs, BLOCK_G=bg, BLOCK_C=bc, CENTERED=centered, num_warps=warps,
    )  # fmt: skip
    _groups_cl_apply_kernel[grid](
        x, weight if weight is not None else x, bias if bias is not None else x, y, pmean, pm2, mean, rstd,
        groups, c, cg, hw, chunk, splits, eps, BLOCK_S=bs, BLOCK_G=bg, BLOCK_C=bc, BLOCK_P=_next_pow2(splits),
        CENTERED=centered, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, num_warps=warps,
    )  # fmt: skip


def _cl_bwd(dy, x, weight, mean, rstd, dx, groups, centered, has_bias):
    n, c = x.shape[0], x.shape[1]
    cg, hw = c // groups, x[0, 0].numel()
    has_w = weight is not None
    bs, bg, bc, warps, chunk, splits = _cl_config(groups, cg, hw)
    pc1 = torch.empty(n * groups * splits, dtype=torch.float32, device=x.device)
    pc2 = torch.empty_like(pc1) if centered else pc1
    # per-channel partials, one row per (sample, split): no atomics, summed once below
    dwp = torch.empty((n * splits, c), dtype=torch.float32, device=x.device) if has_w else pc1
    dbp = torch.empty((n * splits, c), dtype=torch.float32, device=x.device) if has_bias else pc1
    grid = (n * triton.cdiv(groups, bg), splits)
    _groups_cl_bwd_sums_kernel[grid](
        dy, x, weight if has_w else x, mean, rstd, pc1, pc2, dwp, dbp, groups, c, cg, hw, chunk, splits,
        BLOCK_S=bs, BLOCK_G=bg, BLOCK_C=bc, CENTERED=centered, HAS_WEIGHT=has_w, HAS_BIAS=has_bias,
        num_warps=warps,
    )  # fmt: skip
    _groups_cl_bwd_dx_kernel[grid](
        dy, x, weight if has_w else x, mean, rstd, pc1, pc2, dx, groups, c, cg, hw, chunk, splits,
        BLOCK_S=bs, BLOCK_G=bg, BLOCK_C=bc, BLOCK_P=_next_pow2(splits), CENTERED=centered, HAS_WEIGHT=has_w,
        num_warps=warps,
    )  # fmt: skip
    return dwp.sum(0) if has_w else None, dbp.sum(0) if has_bias else None


# ---- torch.library ops


def _groups_fwd_impl(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], groups: int, eps: float, centered: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd) for an (N, C, *) ``x``; statistics per (sample, group), fp32. ``y`` is
    channels_last(_3d) when ``x`` is, else contiguous."""
    x = _laid_out(x)
    rows, cg, hw = _view(x, groups)
    y = _empty_out(x)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0 or cg * hw == 0:
        return y, mean, rstd
    if not use_kernel(x):
        yr, mr, rr = _ref_fwd(x, weight, bias, groups, eps, centered)
        y.copy_(yr), mean.copy_(mr), rstd.copy_(rr)
        return y, mean, rstd
    if _cl_format(x) is not None:
        _cl_fwd(x, weight, bias, y, mean, rstd, groups, eps, centered)
        return y, mean, rstd
    bc, bs, warps = _blocks(cg, hw)
    _groups_fwd_kernel[(rows,)](
        x, weight if weight is not None else x, bias if bias is not None else x, y, mean, rstd,
        groups, cg, hw, eps, BLOCK_C=bc, BLOCK_S=bs,
        CENTERED=centered, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, num_warps=warps,
    )  # fmt: skip
    return y, mean, rstd


groups_fwd = torch.library.custom_op("normscope::groups_fwd", mutates_args=())(_groups_fwd_impl)


@groups_fwd.register_fake
def _groups_fwd_fake(x, weight, bias, groups, eps, centered):
    rows = x.shape[0] * groups
    y = _empty_out(x)  # the real op's strides: channels_last(_3d) kept, anything else contiguous
    return y, x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32)


def _groups_bwd_impl(
    dy: Tensor,
    x: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    groups: int,
    centered: bool,
    has_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dW fp32 or empty, dB fp32 or empty); ``dx`` in ``x``'s layout, as the forward's ``y``."""
    x = _laid_out(x)
    fmt = _cl_format(x)
    dy = dy.contiguous(memory_format=fmt or torch.contiguous_format)  # a copy only if dy's layout differs
    rows, cg, hw = _view(x, groups)
    c = x.shape[1]
    dx = _empty_out(x)
    has_w = weight is not None
    empty = lambda: x.new_empty(0)  # noqa: E731 - a fresh one each time: outputs must not alias
    if rows == 0 or cg * hw == 0 or not use_kernel(x):
        if rows == 0 or cg * hw == 0:
            z = torch.zeros(c, dtype=torch.float32, device=x.device)
            return dx.zero_(), z if has_w else empty(), z.clone() if has_bias else empty()
        dxr, dw, db = _ref_bwd(dy, x, weight, mean, rstd, groups, centered, has_bias)
        dx.copy_(dxr)
        return dx, dw if has_w else empty(), db if has_bias else empty()
    if fmt is not None:
        dw, db = _cl_bwd(dy, x, weight, mean, rstd, dx, groups, centered, has_bias)
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


groups_bwd = torch.library.custom_op("normscope::groups_bwd", mutates_args=())(_groups_bwd_impl)


@groups_bwd.register_fake
def _groups_bwd_fake(dy, x, weight, mean, rstd, groups, centered, has_bias):
    c = x.shape[1]
    dw = x.new_empty((c,), dtype=torch.float32) if weight is not None else x.new_empty(0)
    db = x.new_empty((c,), dtype=torch.float32) if has_bias else x.new_empty(0)
    return _empty_out(x), dw, db


def _setup_context(ctx, inputs, output):
    x, weight, bias, groups, eps, centered = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.groups, ctx.centered, ctx.eps = groups, centered, eps
    ctx.b_dtype = bias.dtype if bias is not None else None


def _backward(ctx, dy, dmean, drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: a backward that is itself differentiable
        return _backward_differentiable(ctx, dy, x, weight)
    dx, dw, db = _eager.pick(
        groups_bwd, _groups_bwd_impl, dy, x, weight, mean, rstd, ctx.groups, ctx.centered, ctx.b_dtype is not None
    )
    dw = dw.to(weight.dtype) if weight is not None else None
    db = db.to(ctx.b_dtype) if ctx.b_dtype is not None else None
    return dx, dw, db, None, None, None


def _backward_differentiable(ctx, dy, x, weight):
    """The gradients as differentiable ops, for ``create_graph=True`` (double backward): the
    kernel's backward has no derivative of its own, so differentiate the reference instead."""
    need = ctx.needs_input_grad
    need_w = weight is not None and need[1]
    wanted = [t for t, n in ((x, need[0]), (weight, need_w)) if n]
    dx = dw = db = None
    if wanted:
        with torch.enable_grad():
            y = group_norm_ref(x, ctx.groups, weight, None, ctx.eps, ctx.centered)
            grads = list(torch.autograd.grad(y, wanted, dy.to(y.dtype), create_graph=True))
        dx = grads.pop(0) if need[0] else None
        dw = grads.pop(0).to(weight.dtype) if need_w else None
    if ctx.b_dtype is not None and need[2]:
        db = dy.sum([0, *range(2, dy.dim())]).to(ctx.b_dtype)
    return dx, dw, db, None, None, None


groups_fwd.register_autograd(_backward, setup_context=_setup_context)
#: groups_fwd with the same functions, for eager mode (see kernels/_eager.py)
_GroupsEager = _eager.function(_groups_fwd_impl, _setup_context, _backward)


def group_norm(
    x: Tensor,
    groups: int,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    centered: bool = True,
) -> Tensor:
    """GroupNorm over (N, C, *) with the fused kernel (``groups == C`` is InstanceNorm). Inputs are
    assumed valid. Contiguous input runs the NCHW kernel, channels_last (4-D) / channels_last_3d (5-D)
    input the channels_last kernels in place, with an output of the same layout (as torch's CPU
    group_norm); any other strides are copied to contiguous NCHW once and give an NCHW output."""
    y, _, _ = _eager.call(
        groups_fwd, _GroupsEager, _groups_fwd_impl,
        _laid_out(x),  # the copy, if any, happens here so that the saved x is already laid out
        dense(weight),
        dense(bias),
        int(groups), float(eps), bool(centered),
    )  # fmt: skip
    return y
