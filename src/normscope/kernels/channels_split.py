# ruff: noqa: UP007, UP045  -- torch.library reads custom-op schemas from typing.Optional annotations
"""BatchNorm as a per-channel split reduction: the ``"split"`` variant of the channels family.

A candidate beside the default kernels (:mod:`.channels`), with the same contract and outputs: **not
measured on a GPU yet, and off by default** -- it runs only where ``kernels.config.CHANNELS_VARIANT =
"split"`` pins it (the bench, the tests) or a committed measured-choice row names it
(:mod:`normscope.kernels.variants`).

What this covers
----------------
BatchNorm training (batch statistics, with or without a per-position mask) and evaluation (running
statistics), forward and backward (dx, dW, dB), on any channel axis, fp32/fp16/bf16. A channel's scope
is its N x HW positions; every channel is reduced alone, in two phases, deterministically:

1. **partials**: the channel's positions are cut into ``splits`` chunks of whole tiles -- how many is a
   function of that scope's own extent (N x HW, and its (N, HW) shape on NCHW memory), never of the
   channel count -- and one program per (channel block, split) keeps an elementwise Welford state per
   register lane over its tiles, shifted by the mean of the split's first tile with a valid value, then
   reduces the lanes with Chan's combination (``tl.reduce``): a (shift, mean, M2) per split and channel,
   and the split's count;
2. **fused apply**: every apply program combines all splits of its channels in one fixed order (the
   first non-empty split's shift, then counts-weighted means and M2 -- only non-negative terms), so
   every program of a channel computes the same bits; the split-0 programs store mean, biased variance
   and rstd; then the program normalizes its chunk. No extra launch, no torch op between the two.

Backward: the same splits write per-channel partial sums of ``dy`` and ``dy * xhat``; the dx program
sums them in a fixed order (its split-0 programs store them: dB and dW) and writes dx. No atomics: two
runs give the same bits. Two memory views, chosen by layout (and so by the scope's layout, not by C):

* **channels innermost** (``(B, S, D)`` over the last axis, ``(N, C)``, and channels_last /
  channels_last_3d input, read and written in place -- the default kernels copy these to NCHW and back):
  tiles of ``CHANNELS_SPLIT_TILE / CHANNELS_SPLIT_BLOCK_C`` positions x ``CHANNELS_SPLIT_BLOCK_C``
  adjacent channels, one contiguous run per tile row; the block width is a constant, so a channel's
  reduction order does not depend on how many channels there are. A mask (one flag per position) is
  loaded once per tile row for all the row's channels;
* **NCHW** (a contiguous ``(outer, C, inner)`` with ``inner > 1``): one channel per program, tiles of
  ``rows x min(next_pow2(inner), CHANNELS_SPLIT_BLOCK_I)`` contiguous values (explicit row and column
  indices: no ``//`` per element, so the compiler sees unit stride along a row).

Masks: a bool mask is read from its own memory (a ``uint8`` view, no conversion pass), with no
``argmax`` pre-pass (each split takes its own shift) and no separate count (the statistics kernel
counts). Padding is never read by the statistics; the padded outputs are the formula's, and a padded
value that is not finite, or has no gradient, enters no backward sum (the default kernels' semantics,
which the tests hold both to).

Limits
------
* Masks must be constant along the channel axis (as the default); on NCHW memory the mask tile is re-read
  per channel (from L2: uint8 beside fp32/bf16 values).
* Another layout than contiguous, channels_last or channels_last_3d is copied to contiguous first.
* At most ``CHANNELS_SPLIT_MAX`` splits per channel (a longer scope takes longer chunks). The count of
  valid positions is an fp32 sum (exact to 2^24 per split).
* Every launch setting (``CHANNELS_SPLIT_*`` in :mod:`normscope.kernels.config`) is a guess: no GPU has
  run this file. ``benchmarks/gpu_check.sh bench`` times it beside the default kernels (bench cases
  ``batch_norm@split``, ``batch_norm_cl@split``, ``masked_batch_norm@split``).

The reference (CPU tensors without ``TRITON_INTERPRET=1``, empty input, the double backward) is
:func:`._ref.channels_fwd_ref`, as for the default kernels.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _eager, config
from ._common import chan_combine as _chan_combine
from ._common import dense, use_kernel
from ._common import next_pow2 as _next_pow2
from ._ref import channels_fwd_ref as _ref_fwd
from .channels import _backward_differentiable, _channels_bwd_impl, _finite, _setup_context

__all__ = ["batch_norm_split", "launch_plan"]


# ---- shared pieces


@triton.jit
def _welford(x, v, n, mean, m2):
    """One Welford step in every lane that holds a valid value (``v``); the others keep their state."""
    n = n + v.to(tl.float32)
    d = x - mean
    mean = mean + tl.where(v, d / tl.maximum(n, 1.0), 0.0)
    m2 = m2 + tl.where(v, d * (x - mean), 0.0)
    return n, mean, m2


@triton.jit
def _combine(PK, PMEAN, PM2, PCNT, c, cm, C, splits, BLOCK_S: tl.constexpr):
    """(mean, biased var, count) of channels ``c`` from their splits' partials, in one fixed order:
    every program of a channel gets the same bits. Partials: shift k, mean and M2 about the split's own
    mean of values shifted by k, per (split, channel) at ``split * C + channel``; counts per split.
    The means are combined relative to the first non-empty split's shift (k - K is exact for shifts of
    close values), and M2 adds only non-negative terms."""
    sr = tl.arange(0, BLOCK_S)
    sm = sr < splits
    cnt = tl.load(PCNT + sr, mask=sm, other=0.0)
    offs = sr.to(tl.int64)[:, None] * C + c[None, :]
    m = sm[:, None] & cm[None, :]
    k = tl.load(PK + offs, mask=m, other=0.0)
    mu = tl.load(PMEAN + offs, mask=m, other=0.0)
    m2 = tl.load(PM2 + offs, mask=m, other=0.0)
    n = tl.sum(cnt, axis=0)
    has = cnt > 0
    first = tl.min(tl.where(has, sr, BLOCK_S), axis=0)
    base = tl.sum(tl.where((sr == first)[:, None], k, 0.0), axis=0)
    d = tl.where(has[:, None], (k - base[None, :]) + mu, 0.0)
    w = cnt[:, None]
    mean_d = tl.sum(w * d, axis=0) / tl.maximum(n, 1.0)
    e = tl.where(has[:, None], d - mean_d[None, :], 0.0)
    m2t = tl.sum(m2, axis=0) + tl.sum(w * e * e, axis=0)
    return base + mean_d, m2t / tl.maximum(n, 1.0), n


# ---- channels innermost: a (P, C) matrix, tiles of (BLOCK_P positions, BLOCK_C channels)


@triton.jit
def _cols_load(X, MASK, p, c, hi, C, HAS_MASK: tl.constexpr):
    """x (fp32) and the lanes holding a valid value, of a (positions p < hi, channels c) tile: padding
    and out-of-range lanes are never read."""
    pin = p < hi
    if HAS_MASK:  # one flag per position, loaded once for the tile row's channels
        pin = pin & (tl.load(MASK + p, mask=p < hi, other=0) != 0)
    v = pin[:, None] & (c < C)[None, :]
    x = tl.load(X + p.to(tl.int64)[:, None] * C + c[None, :], mask=v, other=0.0).to(tl.float32)
    return x, v


@triton.jit
def _cols_stats_kernel(
    X, MASK, PK, PMEAN, PM2, PCNT, C, P, chunk,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.program_id(1)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, P)
    # the split's shift: the mean of the valid values of its first tile that holds any (each value
    # scaled before the sum: no overflow near fp32's max). Not a single value: an outlier there would
    # round every other deviation to its spacing
    k = tl.zeros([BLOCK_C], dtype=tl.float32)
    p0 = lo
    found = 0
    while (p0 < hi) & (found == 0):
        x, v = _cols_load(X, MASK, p0 + tl.arange(0, BLOCK_P), c, hi, C, HAS_MASK)
        cnt = tl.sum(v.to(tl.float32), axis=0)
        if tl.max(cnt, axis=0) > 0:
            k = tl.sum(x * (1.0 / tl.maximum(cnt, 1.0))[None, :], axis=0)
            found = 1
        p0 += BLOCK_P
    n = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    mean = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for p0 in range(lo, hi, BLOCK_P):
        x, v = _cols_load(X, MASK, p0 + tl.arange(0, BLOCK_P), c, hi, C, HAS_MASK)
        n, mean, m2 = _welford(x - k[None, :], v, n, mean, m2)
    n, mean, m2 = tl.reduce((n, mean, m2), 0, _chan_combine)
    out = s.to(tl.int64) * C + c
    cm = c < C
    tl.store(PK + out, k, mask=cm)
    tl.store(PMEAN + out, mean, mask=cm)
    tl.store(PM2 + out, m2, mask=cm)
    if tl.program_id(0) == 0:  # the same count for every channel: one flag per position
        tl.store(PCNT + s, tl.max(n, axis=0))


@triton.jit
def _cols_apply_kernel(
    X, Y, PK, PMEAN, PM2, PCNT, W, B, MEAN, VAR, RSTD, COUNT, C, P, chunk, splits, eps,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, STATS: tl.constexpr,
):  # fmt: skip
    # STATS: combine the partials (training; split 0 stores the statistics); else MEAN/RSTD are given
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    s = tl.program_id(1)
    if STATS:
        mean, var, n = _combine(PK, PMEAN, PM2, PCNT, c, cm, C, splits, BLOCK_S)
        rstd = tl.where(n > 0, tl.rsqrt(var + eps), 0.0)  # no valid position: rstd 0, the output is the bias
        if s == 0:
            tl.store(MEAN + c, mean, mask=cm)
            tl.store(VAR + c, var, mask=cm)
            tl.store(RSTD + c, rstd, mask=cm)
            if tl.program_id(0) == 0:
                tl.store(COUNT, n)
    else:
        mean = tl.load(MEAN + c, mask=cm, other=0.0)
        rstd = tl.load(RSTD + c, mask=cm, other=0.0)
    scale = rstd
    if HAS_WEIGHT:
        scale = scale * tl.load(W + c, mask=cm, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(B + c, mask=cm, other=0.0).to(tl.float32)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, P)
    for p0 in range(lo, hi, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        v = (p < hi)[:, None] & cm[None, :]
        offs = p.to(tl.int64)[:, None] * C + c[None, :]
        x = tl.load(X + offs, mask=v, other=0.0).to(tl.float32)
        y = (x - mean[None, :]) * scale[None, :]
        if HAS_BIAS:
            y = y + b[None, :]
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=v)


@triton.jit
def _cols_bwd_sums_kernel(
    DY, X, MASK, MEAN, RSTD, PSDY, PSDYX, C, P, chunk,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    s = tl.program_id(1)
    mean = tl.load(MEAN + c, mask=cm, other=0.0)
    rstd = tl.load(RSTD + c, mask=cm, other=0.0)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, P)
    sdy = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    sdyx = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for p0 in range(lo, hi, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        pin = p < hi
        v = pin[:, None] & cm[None, :]
        offs = p.to(tl.int64)[:, None] * C + c[None, :]
        x = tl.load(X + offs, mask=v, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=v, other=0.0).to(tl.float32)
        if HAS_MASK:  # a padded value enters the sums only if finite and with a gradient (0 * inf = NaN)
            valid = tl.load(MASK + p, mask=pin, other=0) != 0
            v = v & (valid[:, None] | (_finite(x) & (dy != 0.0)))
            dy = tl.where(v, dy, 0.0)
        xhat = tl.where(v, (x - mean[None, :]) * rstd[None, :], 0.0)
        sdy += dy
        sdyx += dy * xhat
    out = s.to(tl.int64) * C + c
    tl.store(PSDY + out, tl.sum(sdy, axis=0), mask=cm)
    tl.store(PSDYX + out, tl.sum(sdyx, axis=0), mask=cm)


@triton.jit
def _cols_bwd_dx_kernel(
    DY, X, MASK, MEAN, RSTD, W, PSDY, PSDYX, DX, DW, DB, COUNT, C, P, chunk, splits,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, TRAINING: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    # training: dx = w rstd (dy - [valid] (sum(dy) + xhat sum(dy xhat)) / count); evaluation: w rstd dy
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    s = tl.program_id(1)
    sr = tl.arange(0, BLOCK_S)
    poffs = sr.to(tl.int64)[:, None] * C + c[None, :]
    pm = (sr < splits)[:, None] & cm[None, :]
    sdy = tl.sum(tl.load(PSDY + poffs, mask=pm, other=0.0), axis=0)  # a fixed order: the same in every program
    sdyx = tl.sum(tl.load(PSDYX + poffs, mask=pm, other=0.0), axis=0)
    if s == 0:
        tl.store(DW + c, sdyx, mask=cm)
        tl.store(DB + c, sdy, mask=cm)
    rstd = tl.load(RSTD + c, mask=cm, other=0.0)
    scale = rstd
    if HAS_WEIGHT:
        scale = scale * tl.load(W + c, mask=cm, other=0.0).to(tl.float32)
    if TRAINING:
        mean = tl.load(MEAN + c, mask=cm, other=0.0)
        count = tl.maximum(tl.load(COUNT), 1.0)
        m_dy = sdy / count
        m_dyx = sdyx / count
    lo = s * chunk
    hi = tl.minimum(lo + chunk, P)
    for p0 in range(lo, hi, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        pin = p < hi
        v = pin[:, None] & cm[None, :]
        offs = p.to(tl.int64)[:, None] * C + c[None, :]
        dy = tl.load(DY + offs, mask=v, other=0.0).to(tl.float32)
        if TRAINING:
            x = tl.load(X + offs, mask=v, other=0.0).to(tl.float32)
            xhat = (x - mean[None, :]) * rstd[None, :]
            dx = dy - (m_dy[None, :] + xhat * m_dyx[None, :])
            if HAS_MASK:  # a padded input: no gradient through the statistics, none at all if not finite
                valid = tl.load(MASK + p, mask=pin, other=0) != 0
                dx = tl.where(valid[:, None], dx, tl.where(_finite(x), dy, 0.0))
            dx = dx * scale[None, :]
        else:
            dx = dy * scale[None, :]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=v)


# ---- NCHW: a contiguous (outer, C, inner), one channel a program, tiles of (BLOCK_O rows, BLOCK_I columns)


@triton.jit
def _rows_offsets(t, c, C, outer, inner, tiles_i, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr):
    """Memory offsets (int64), position indices (for the mask) and in-range lanes of tile ``t`` of
    channel ``c``: tiles are numbered row-block major, ``tiles_i`` per row block."""
    to = t // tiles_i
    ti = t - to * tiles_i
    o = (to * BLOCK_O + tl.arange(0, BLOCK_O)).to(tl.int64)
    i = ti * BLOCK_I + tl.arange(0, BLOCK_I)
    v = (o < outer)[:, None] & (i < inner)[None, :]
    pos = o[:, None] * inner + i[None, :]
    offs = o[:, None] * C * inner + c * inner + i[None, :]
    return offs, pos, v


@triton.jit
def _rows_load(X, MASK, t, c, C, outer, inner, tiles_i, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
               HAS_MASK: tl.constexpr):  # fmt: skip
    offs, pos, v = _rows_offsets(t, c, C, outer, inner, tiles_i, BLOCK_O, BLOCK_I)
    if HAS_MASK:
        v = v & (tl.load(MASK + pos, mask=v, other=0) != 0)
    return tl.load(X + offs, mask=v, other=0.0).to(tl.float32), v


@triton.jit
def _rows_stats_kernel(
    X, MASK, PK, PMEAN, PM2, PCNT, C, outer, inner, tiles_i, tiles, per,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    t_lo = s * per
    t_hi = tl.minimum(t_lo + per, tiles)
    k = 0.0  # the split's shift (see _cols_stats_kernel)
    t = t_lo
    found = 0
    while (t < t_hi) & (found == 0):
        x, v = _rows_load(X, MASK, t, c, C, outer, inner, tiles_i, BLOCK_O, BLOCK_I, HAS_MASK)
        cnt = tl.sum(tl.sum(v.to(tl.float32), axis=1), axis=0)
        if cnt > 0:
            k = tl.sum(tl.sum(x * (1.0 / cnt), axis=1), axis=0)
            found = 1
        t += 1
    n = tl.zeros([BLOCK_O, BLOCK_I], dtype=tl.float32)
    mean = tl.zeros([BLOCK_O, BLOCK_I], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_O, BLOCK_I], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        x, v = _rows_load(X, MASK, t, c, C, outer, inner, tiles_i, BLOCK_O, BLOCK_I, HAS_MASK)
        n, mean, m2 = _welford(x - k, v, n, mean, m2)
    n, mean, m2 = tl.reduce((n, mean, m2), 1, _chan_combine)
    n, mean, m2 = tl.reduce((n, mean, m2), 0, _chan_combine)
    out = s.to(tl.int64) * C + c
    tl.store(PK + out, k)
    tl.store(PMEAN + out, mean)
    tl.store(PM2 + out, m2)
    if c == 0:  # the same count for every channel
        tl.store(PCNT + s, n)


@triton.jit
def _rows_apply_kernel(
    X, Y, PK, PMEAN, PM2, PCNT, W, B, MEAN, VAR, RSTD, COUNT, C, outer, inner, tiles_i, tiles, per, splits, eps,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, STATS: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    if STATS:
        cv = c + tl.arange(0, 1)
        mean, var, n = _combine(PK, PMEAN, PM2, PCNT, cv, cv < C, C, splits, BLOCK_S)
        mean = tl.sum(mean, axis=0)
        var = tl.sum(var, axis=0)
        rstd = tl.where(n > 0, tl.rsqrt(var + eps), 0.0)
        if s == 0:
            tl.store(MEAN + c, mean)
            tl.store(VAR + c, var)
            tl.store(RSTD + c, rstd)
            if c == 0:
                tl.store(COUNT, n)
    else:
        mean = tl.load(MEAN + c)
        rstd = tl.load(RSTD + c)
    scale = rstd
    if HAS_WEIGHT:
        scale = scale * tl.load(W + c).to(tl.float32)
    t_lo = s * per
    t_hi = tl.minimum(t_lo + per, tiles)
    for t in range(t_lo, t_hi):
        offs, _, v = _rows_offsets(t, c, C, outer, inner, tiles_i, BLOCK_O, BLOCK_I)
        x = tl.load(X + offs, mask=v, other=0.0).to(tl.float32)
        y = (x - mean) * scale
        if HAS_BIAS:
            y = y + tl.load(B + c).to(tl.float32)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=v)


@triton.jit
def _rows_bwd_sums_kernel(
    DY, X, MASK, MEAN, RSTD, PSDY, PSDYX, C, outer, inner, tiles_i, tiles, per,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    mean = tl.load(MEAN + c)
    rstd = tl.load(RSTD + c)
    t_lo = s * per
    t_hi = tl.minimum(t_lo + per, tiles)
    sdy = tl.zeros([BLOCK_O, BLOCK_I], dtype=tl.float32)
    sdyx = tl.zeros([BLOCK_O, BLOCK_I], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        offs, pos, v = _rows_offsets(t, c, C, outer, inner, tiles_i, BLOCK_O, BLOCK_I)
        x = tl.load(X + offs, mask=v, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=v, other=0.0).to(tl.float32)
        if HAS_MASK:
            valid = tl.load(MASK + pos, mask=v, other=0) != 0
            v = v & (valid | (_finite(x) & (dy != 0.0)))
            dy = tl.where(v, dy, 0.0)
        xhat = tl.where(v, (x - mean) * rstd, 0.0)
        sdy += dy
        sdyx += dy * xhat
    out = s.to(tl.int64) * C + c
    tl.store(PSDY + out, tl.sum(tl.sum(sdy, axis=1), axis=0))
    tl.store(PSDYX + out, tl.sum(tl.sum(sdyx, axis=1), axis=0))


@triton.jit
def _rows_bwd_dx_kernel(
    DY, X, MASK, MEAN, RSTD, W, PSDY, PSDYX, DX, DW, DB, COUNT, C, outer, inner, tiles_i, tiles, per, splits,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, TRAINING: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    sr = tl.arange(0, BLOCK_S)
    pm = sr < splits
    sdy = tl.sum(tl.load(PSDY + sr.to(tl.int64) * C + c, mask=pm, other=0.0), axis=0)
    sdyx = tl.sum(tl.load(PSDYX + sr.to(tl.int64) * C + c, mask=pm, other=0.0), axis=0)
    if s == 0:
        tl.store(DW + c, sdyx)
        tl.store(DB + c, sdy)
    rstd = tl.load(RSTD + c)
    scale = rstd
    if HAS_WEIGHT:
        scale = scale * tl.load(W + c).to(tl.float32)
    if TRAINING:
        mean = tl.load(MEAN + c)
        count = tl.maximum(tl.load(COUNT), 1.0)
        m_dy = sdy / count
        m_dyx = sdyx / count
    t_lo = s * per
    t_hi = tl.minimum(t_lo + per, tiles)
    for t in range(t_lo, t_hi):
        offs, pos, v = _rows_offsets(t, c, C, outer, inner, tiles_i, BLOCK_O, BLOCK_I)
        dy = tl.load(DY + offs, mask=v, other=0.0).to(tl.float32)
        if TRAINING:
            x = tl.load(X + offs, mask=v, other=0.0).to(tl.float32)
            xhat = (x - mean) * rstd
            dx = dy - (m_dy + xhat * m_dyx)
            if HAS_MASK:
                valid = tl.load(MASK + pos, mask=v, other=0) != 0
                dx = tl.where(valid, dx, tl.where(_finite(x), dy, 0.0))
            dx = dx * scale
        else:
            dx = dy * scale
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=v)


# ---- launches


def launch_plan(outer: int, c: int, inner: int) -> dict:
    """The tiles and splits of a contiguous ``(outer, C, inner)`` (settings: ``CHANNELS_SPLIT_*`` in
    kernels/config.py). ``cols``: channels innermost (``inner == 1``). A function of the channel scope's
    own shape (outer, inner) and of the constants -- ``C`` sets only how many channel blocks run: a
    channel's splits and tiles, hence its bits, do not depend on how many channels the call holds."""
    tile = config.CHANNELS_SPLIT_TILE
    if inner == 1:
        bq = config.CHANNELS_SPLIT_BLOCK_C
        br = max(1, tile // bq)  # positions per tile
        tiles_i = 1
        tiles = triton.cdiv(outer, br)
    else:
        bq = min(_next_pow2(inner), config.CHANNELS_SPLIT_BLOCK_I)
        br = max(1, min(tile // bq, _next_pow2(outer)))
        tiles_i = triton.cdiv(inner, bq)
        tiles = triton.cdiv(outer, br) * tiles_i
    want = max(1, min(triton.cdiv(tiles, config.CHANNELS_SPLIT_MIN_TILES), config.CHANNELS_SPLIT_MAX))
    per = triton.cdiv(tiles, want)  # tiles per split
    splits = max(1, triton.cdiv(tiles, per))
    return {
        "cols": inner == 1,
        "block_r": br,
        "block_q": bq,
        "tiles_i": tiles_i,
        "tiles": tiles,
        "per": per,
        "chunk": per * br,  # positions per split (cols)
        "splits": splits,
        "block_s": _next_pow2(splits),
    }


def _grid(lp: dict, c: int) -> tuple[int, int]:
    return (triton.cdiv(c, lp["block_q"]) if lp["cols"] else c, lp["splits"])


def _split_fwd_impl(
    x3: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    mean_in: Optional[Tensor],
    var_in: Optional[Tensor],
    mask: Optional[Tensor],
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, mean, rstd, biased var, count) for a contiguous (outer, C, inner) ``x3``, as
    :func:`.channels._channels_fwd_impl`; ``mask``: uint8 (outer, inner) or None."""
    outer, c, inner = x3.shape
    y = torch.empty_like(x3)
    if not use_kernel(x3) or outer * inner == 0:
        yr, m, r, v, n = _ref_fwd(x3, weight, bias, mean_in, var_in, mask, eps)
        return y.copy_(yr), m, r, v, n
    lp = launch_plan(outer, c, inner)
    dev = x3.device
    stats = mean_in is None
    if stats:
        splits = lp["splits"]
        pk = torch.empty((splits, c), dtype=torch.float32, device=dev)
        pmean, pm2 = torch.empty_like(pk), torch.empty_like(pk)
        pcnt = torch.empty(splits, dtype=torch.float32, device=dev)
        mean = torch.empty(c, dtype=torch.float32, device=dev)
        var, rstd = torch.empty_like(mean), torch.empty_like(mean)
        count = torch.empty((), dtype=torch.float32, device=dev)
    else:
        mean, var = mean_in.float().clone(), var_in.float().clone()
        rstd = torch.rsqrt(var + eps)
        count = torch.full((), float(outer * inner), dtype=torch.float32, device=dev)
        pk = pmean = pm2 = pcnt = mean  # not read
    m = mask if mask is not None else x3
    w = weight if weight is not None else x3
    b = bias if bias is not None else x3
    grid = _grid(lp, c)
    flags = {"HAS_WEIGHT": weight is not None, "HAS_BIAS": bias is not None, "STATS": stats}
    warps = config.CHANNELS_SPLIT_WARPS
    if lp["cols"]:
        if stats:
            _cols_stats_kernel[grid](
                x3, m, pk, pmean, pm2, pcnt, c, outer, lp["chunk"],
                BLOCK_P=lp["block_r"], BLOCK_C=lp["block_q"], HAS_MASK=mask is not None, num_warps=warps,
            )  # fmt: skip
        _cols_apply_kernel[grid](
            x3, y, pk, pmean, pm2, pcnt, w, b, mean, var, rstd, count, c, outer, lp["chunk"], lp["splits"], eps,
            BLOCK_P=lp["block_r"], BLOCK_C=lp["block_q"], BLOCK_S=lp["block_s"], **flags, num_warps=warps,
        )  # fmt: skip
    else:
        dims = (c, outer, inner, lp["tiles_i"], lp["tiles"], lp["per"])
        if stats:
            _rows_stats_kernel[grid](
                x3, m, pk, pmean, pm2, pcnt, *dims,
                BLOCK_O=lp["block_r"], BLOCK_I=lp["block_q"], HAS_MASK=mask is not None, num_warps=warps,
            )  # fmt: skip
        _rows_apply_kernel[grid](
            x3, y, pk, pmean, pm2, pcnt, w, b, mean, var, rstd, count, *dims, lp["splits"], eps,
            BLOCK_O=lp["block_r"], BLOCK_I=lp["block_q"], BLOCK_S=lp["block_s"], **flags, num_warps=warps,
        )  # fmt: skip
    return y, mean, rstd, var, count


split_fwd = torch.library.custom_op("normscope::channels_split_fwd", mutates_args=())(_split_fwd_impl)


@split_fwd.register_fake
def _split_fwd_fake(x3, weight, bias, mean_in, var_in, mask, eps):
    c = x3.shape[1]
    stat = lambda: x3.new_empty((c,), dtype=torch.float32)  # noqa: E731
    return torch.empty_like(x3), stat(), stat(), stat(), x3.new_empty((), dtype=torch.float32)


def _split_bwd_impl(
    dy: Tensor,
    x3: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    mask: Optional[Tensor],
    count: Tensor,
    training: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, sum(dy * xhat), sum(dy)) per channel, fp32 sums (dW and dB)."""
    outer, c, inner = x3.shape
    if not use_kernel(x3) or outer * inner == 0:
        return _channels_bwd_impl(dy, x3, weight, mean, rstd, mask, count, training)  # its reference path
    lp = launch_plan(outer, c, inner)
    dev = x3.device
    psdy = torch.empty((lp["splits"], c), dtype=torch.float32, device=dev)
    psdyx = torch.empty_like(psdy)
    dw = torch.empty(c, dtype=torch.float32, device=dev)
    db = torch.empty_like(dw)
    dx = torch.empty_like(x3)
    m = mask if mask is not None else x3
    w = weight if weight is not None else x3
    grid = _grid(lp, c)
    has_m = mask is not None
    warps = config.CHANNELS_SPLIT_WARPS
    flags = {"HAS_WEIGHT": weight is not None, "TRAINING": training, "HAS_MASK": has_m}
    if lp["cols"]:
        _cols_bwd_sums_kernel[grid](
            dy, x3, m, mean, rstd, psdy, psdyx, c, outer, lp["chunk"],
            BLOCK_P=lp["block_r"], BLOCK_C=lp["block_q"], HAS_MASK=has_m, num_warps=warps,
        )  # fmt: skip
        _cols_bwd_dx_kernel[grid](
            dy, x3, m, mean, rstd, w, psdy, psdyx, dx, dw, db, count, c, outer, lp["chunk"], lp["splits"],
            BLOCK_P=lp["block_r"], BLOCK_C=lp["block_q"], BLOCK_S=lp["block_s"], **flags, num_warps=warps,
        )  # fmt: skip
    else:
        dims = (c, outer, inner, lp["tiles_i"], lp["tiles"], lp["per"])
        _rows_bwd_sums_kernel[grid](
            dy, x3, m, mean, rstd, psdy, psdyx, *dims,
            BLOCK_O=lp["block_r"], BLOCK_I=lp["block_q"], HAS_MASK=has_m, num_warps=warps,
        )  # fmt: skip
        _rows_bwd_dx_kernel[grid](
            dy, x3, m, mean, rstd, w, psdy, psdyx, dx, dw, db, count, *dims, lp["splits"],
            BLOCK_O=lp["block_r"], BLOCK_I=lp["block_q"], BLOCK_S=lp["block_s"], **flags, num_warps=warps,
        )  # fmt: skip
    return dx, dw, db


split_bwd = torch.library.custom_op("normscope::channels_split_bwd", mutates_args=())(_split_bwd_impl)


@split_bwd.register_fake
def _split_bwd_fake(dy, x3, weight, mean, rstd, mask, count, training):
    c = x3.shape[1]
    return torch.empty_like(x3), x3.new_empty((c,), dtype=torch.float32), x3.new_empty((c,), dtype=torch.float32)


def _backward(ctx, dy, dmean, drstd, dvar, dcount):
    x3, weight, mean, rstd, mask, count = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: differentiate the reference (channels.py's rule)
        return _backward_differentiable(ctx, dy, x3, weight, mean, rstd, mask)
    dx, dw, db = _eager.pick(
        split_bwd, _split_bwd_impl, dy.contiguous(), x3, weight, mean, rstd, mask, count, ctx.training
    )
    return (
        dx,
        dw.to(weight.dtype) if weight is not None else None,
        db.to(ctx.b_dtype) if ctx.b_dtype is not None else None,
        None, None, None, None,
    )  # fmt: skip


split_fwd.register_autograd(_backward, setup_context=_setup_context)
#: split_fwd with the same functions, for eager mode (see kernels/_eager.py)
_SplitEager = _eager.function(_split_fwd_impl, _setup_context, _backward)

_CL = {4: torch.channels_last, 5: torch.channels_last_3d}


def channels_innermost(x: Tensor, channel_dim: int) -> bool:
    """Whether x is channels_last(_3d) memory with the channel on axis 1 (read in place as (N*HW, C, 1))."""
    fmt = _CL.get(x.dim())
    return (
        channel_dim % x.dim() == 1 and fmt is not None and not x.is_contiguous() and x.is_contiguous(memory_format=fmt)
    )


def _as_uint8(m: Tensor) -> Tensor:
    """One flag per position as the kernels read it: a bool mask's own memory (a view, no pass)."""
    m = m.contiguous()
    return m.view(torch.uint8) if m.dtype == torch.bool else (m != 0).view(torch.uint8)


def batch_norm_split(
    x: Tensor,
    channel_dim: int,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    running_mean: Optional[Tensor] = None,
    running_var: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`.channels.batch_norm_channels` on the split kernels: the same arguments and returns
    ``(y, batch mean, batch biased var, count)`` (the running ones in evaluation). channels_last(_3d)
    input is read and written in place (its output is channels_last); other non-contiguous input is
    copied to contiguous first."""
    shape = x.shape
    d = channel_dim % x.dim()
    c = shape[d]
    if channels_innermost(x, d):
        perm = (0, *range(2, x.dim()), 1)  # (N, *spatial, C): x's memory order
        x3 = x.permute(perm).reshape(-1, c, 1)  # a view
        m2 = _as_uint8(mask).reshape(-1, 1) if mask is not None else None

        def restore(y3: Tensor) -> Tensor:
            inverse = [perm.index(i) for i in range(len(perm))]
            return y3.view([shape[i] for i in perm]).permute(inverse)

    else:
        x = x.contiguous()
        outer = 1
        for s in shape[:d]:
            outer *= s
        x3 = x.reshape(outer, c, -1)
        m2 = _as_uint8(mask).reshape(outer, x3.shape[2]) if mask is not None else None

        def restore(y3: Tensor) -> Tensor:
            return y3.view(shape)

    y, mean, _, var, count = _eager.call(
        split_fwd, _SplitEager, _split_fwd_impl,
        x3, dense(weight), dense(bias), dense(running_mean), dense(running_var), m2, float(eps),
    )  # fmt: skip
    return restore(y), mean, var, count
