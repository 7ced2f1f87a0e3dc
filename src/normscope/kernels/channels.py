# ruff: noqa: UP007, UP045  -- torch.library reads custom-op schemas from typing.Optional annotations
"""Fused Triton kernels for BatchNorm: statistics per channel over every other axis, fwd and bwd.

What this covers
----------------
The canonical view is ``(outer, C, inner)`` of a contiguous tensor: BatchNorm1d/2d/3d on
(N, C, *) is ``(N, C, H*W...)``; BatchNorm over the last axis of (B, S, D) ("channels last",
the masked-BatchNorm1d layout without the mask) is ``(B*S, D, 1)``. A channel's ``P = outer *
inner`` positions are reduced in two stages, deterministically (no atomics):

1. a grid of (position chunk, channel block) programs writes each chunk's per-channel mean and
   M2 (deviations about the chunk's own mean, on values shifted by the mean of the channel's first valid tile,
   combined tile by tile with Chan's formula) to a ``(chunks, C)`` fp32 buffer;
2. a few torch ops combine the chunks (Chan again), in a fixed order.

Then one elementwise pass normalizes. Training backward: the same two-stage reduction of
``sum(dy)`` and ``sum(dy * xhat)`` per channel, then one elementwise pass for dx (dW and dB are
those two sums). Evaluation (running statistics given): the elementwise pass only; backward is
``dx = dy * w * rstd``. Masked padding may hold anything, as on the reference: padded positions
never enter the statistics, and a non-finite padded value (inf, NaN) passes no gradient to anything
(it is left out of both backward sums and its own dx is 0) -- its output is the formula's.
Running statistics are updated by the engine from the returned batch mean and biased variance
(unbiased with ``P / (P - 1)``), as for every other backend.

Limits
------
* A mask must be constant along the channel axis (one flag per position: the padding mask of
  (B, S, D) sequences); other masks run on the reference.
* Non-contiguous input (channels_last 4-D included) is copied to contiguous first.
* The ``(outer, inner)`` index arithmetic (``//``, ``%``) hides contiguity from the compiler, so
  NCHW loads are not vectorised: correct, not yet fast. Block sizes and warps (``CHANNELS_*`` in
  :mod:`normscope.kernels.config`) are heuristics, not measured on a GPU.

The reference (what a CPU tensor without ``TRITON_INTERPRET=1``, empty input and the double backward
run) is :func:`._ref.channels_fwd_ref`.
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
from ._common import sm_count as _sm_count
from ._ref import channels_fwd_ref as _ref_fwd

__all__ = ["batch_norm_channels"]


@triton.jit
def _offsets(p, c, C, inner):
    p64 = p.to(tl.int64)
    return (p64 // inner)[:, None] * (C * inner) + (p64 % inner)[:, None] + (c.to(tl.int64) * inner)[None, :]


@triton.jit
def _finite(x):
    return tl.abs(x) < float("inf")  # false for +-inf and NaN


@triton.jit
def _stats_kernel(
    X, MASK, FIRST, PMEAN, PM2, PCNT, C, inner, P, chunk,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    pid_p = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    # the shift, the same in every program: per channel, the mean of the valid values among the
    # BLOCK_P positions from the first *valid* one (FIRST; position 0 unmasked). Not a padded value:
    # it would leave its rounding in the mean (with one valid value v the mean came out as
    # k + (v - k) != v, and xhat, which must be 0, as that error times rstd); one valid value is its
    # own shift here. Not the first value alone: an outlier there rounded every other deviation to
    # its spacing (40x torch's error). Each value scaled before the sum: no overflow near fp32's max
    if HAS_MASK:
        first = tl.load(FIRST).to(tl.int64)
    else:
        first = tl.zeros([], dtype=tl.int64)
    pk = first + tl.arange(0, BLOCK_P)
    kmask = pk < P
    if HAS_MASK:
        kmask = kmask & (tl.load(MASK + pk, mask=kmask, other=0) != 0)
    xk = tl.load(X + _offsets(pk, c, C, inner), mask=kmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    k = tl.sum(xk * (1.0 / tl.maximum(tl.sum(kmask.to(tl.float32), axis=0), 1.0)), axis=0)
    start = pid_p * chunk
    end = tl.minimum(start + chunk, P)
    n_a = 0.0
    mean_a = tl.zeros([BLOCK_C], dtype=tl.float32)
    m2_a = tl.zeros([BLOCK_C], dtype=tl.float32)
    for p0 in range(start, end, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        pmask = p < end
        mask = pmask[:, None] & cmask[None, :]
        if HAS_MASK:  # one flag per position, shared by every channel
            valid = tl.load(MASK + p, mask=pmask, other=0) != 0
            pmask = pmask & valid
            mask = pmask[:, None] & cmask[None, :]
        x = tl.load(X + _offsets(p, c, C, inner), mask=mask, other=0.0).to(tl.float32)
        x = tl.where(mask, x - k[None, :], 0.0)
        n_b = tl.sum(pmask.to(tl.float32), axis=0)
        mean_b = tl.sum(x, axis=0) / tl.maximum(n_b, 1.0)
        dd = tl.where(mask, x - mean_b[None, :], 0.0)
        m2_b = tl.sum(dd * dd, axis=0)
        # a tile with no valid position changes nothing (n_b = 0)
        n_a, mean_a, m2_a = _chan_combine(n_a, mean_a, m2_a, n_b, mean_b, m2_b)
    out = pid_p.to(tl.int64) * C + c
    tl.store(PMEAN + out, k + mean_a, mask=cmask)
    tl.store(PM2 + out, m2_a, mask=cmask)
    if tl.program_id(1) == 0:  # the count is the same for every channel block
        tl.store(PCNT + pid_p, n_a)


@triton.jit
def _apply_kernel(
    X, Y, MEAN, RSTD, W, B, C, inner, P,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    mask = (p < P)[:, None] & cmask[None, :]
    offs = _offsets(p, c, C, inner)
    mean = tl.load(MEAN + c, mask=cmask, other=0.0)
    rstd = tl.load(RSTD + c, mask=cmask, other=0.0)
    scale = rstd
    if HAS_WEIGHT:
        scale = scale * tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    y = (x - mean[None, :]) * scale[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_sums_kernel(
    DY, X, MASK, MEAN, RSTD, PSDY, PSDYX, C, inner, P, chunk,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    pid_p = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    mean = tl.load(MEAN + c, mask=cmask, other=0.0)
    rstd = tl.load(RSTD + c, mask=cmask, other=0.0)
    start = pid_p * chunk
    end = tl.minimum(start + chunk, P)
    sdy = tl.zeros([BLOCK_C], dtype=tl.float32)
    sdyx = tl.zeros([BLOCK_C], dtype=tl.float32)
    for p0 in range(start, end, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        mask = (p < end)[:, None] & cmask[None, :]
        offs = _offsets(p, c, C, inner)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_MASK:  # a non-finite padded value is a constant: it enters neither sum (0 * inf = NaN)
            valid = tl.load(MASK + p, mask=p < end, other=0) != 0
            # nor does a padded position without gradient: a finite padded value far from the mean
            # (3e38, or 1e38 at rstd 100) overflows xhat to inf, and 0 * inf would be NaN
            mask = mask & (valid[:, None] | (_finite(x) & (dy != 0.0)))
            dy = tl.where(mask, dy, 0.0)
        xhat = tl.where(mask, (x - mean[None, :]) * rstd[None, :], 0.0)
        sdy += tl.sum(dy, axis=0)
        sdyx += tl.sum(dy * xhat, axis=0)
    out = pid_p.to(tl.int64) * C + c
    tl.store(PSDY + out, sdy, mask=cmask)
    tl.store(PSDYX + out, sdyx, mask=cmask)


@triton.jit
def _bwd_dx_kernel(
    DY, X, MASK, MEAN, RSTD, W, SDY, SDYX, DX, COUNT, C, inner, P,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, HAS_WEIGHT: tl.constexpr, TRAINING: tl.constexpr,
    HAS_MASK: tl.constexpr,
):  # fmt: skip
    # training: dx = w * rstd * (dy - [valid] * (sum(dy) + xhat * sum(dy * xhat)) / count), the sums
    # over every position (every output depends on the statistics), count = valid positions;
    # eval: dx = w * rstd * dy
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    mask = (p < P)[:, None] & cmask[None, :]
    offs = _offsets(p, c, C, inner)
    rstd = tl.load(RSTD + c, mask=cmask, other=0.0)
    scale = rstd
    if HAS_WEIGHT:
        scale = scale * tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    if TRAINING:
        mean = tl.load(MEAN + c, mask=cmask, other=0.0)
        count = tl.maximum(tl.load(COUNT), 1.0)
        m_dy = tl.load(SDY + c, mask=cmask, other=0.0) / count
        m_dyx = tl.load(SDYX + c, mask=cmask, other=0.0) / count
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        xhat = (x - mean[None, :]) * rstd[None, :]
        corr = m_dy[None, :] + xhat * m_dyx[None, :]
        dx = dy - corr
        if HAS_MASK:
            # a padded input gets no gradient through the statistics, and a non-finite one none at all
            valid = tl.load(MASK + p, mask=p < P, other=0) != 0
            dx = tl.where(valid[:, None], dx, tl.where(_finite(x), dy, 0.0))
        dx = dx * scale[None, :]
    else:
        dx = dy * scale[None, :]
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)


def _launch(x3: Tensor) -> tuple[int, int, int, int, int, int]:
    """(C, inner, P, BLOCK_P, BLOCK_C, chunk) for the grids (settings: ``CHANNELS_*`` in kernels/config.py)."""
    outer, c, inner = x3.shape
    p = outer * inner
    block_p = config.CHANNELS_BLOCK_P
    block_c = min(config.CHANNELS_MAX_BLOCK_C, _next_pow2(c))
    if x3.is_cuda:
        # enough chunks to give every SM CHANNELS_PROGRAMS_PER_SM programs with the channel blocks
        sms = _sm_count(x3.device.index or 0)
        want = max(1, config.CHANNELS_PROGRAMS_PER_SM * sms // triton.cdiv(c, block_c))
    else:
        want = config.INTERPRETER_PROGRAMS
    chunk = max(block_p, triton.cdiv(triton.cdiv(p, want), block_p) * block_p)
    return c, inner, p, block_p, block_c, chunk


def _batch_stats(x3: Tensor, mask: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Per-channel mean, biased variance (fp32) and count (valid positions, a 0-d fp32 tensor) of
    a contiguous (outer, C, inner) tensor; ``mask``: None or one uint8 flag per position."""
    c, inner, p, block_p, block_c, chunk = _launch(x3)
    chunks = triton.cdiv(p, chunk)
    pmean = torch.empty((chunks, c), dtype=torch.float32, device=x3.device)
    pm2 = torch.empty((chunks, c), dtype=torch.float32, device=x3.device)
    pcnt = torch.empty((chunks, 1), dtype=torch.float32, device=x3.device)
    # the first valid position (argmax: the first of the largest flags; 0 when none is valid), on the device
    first = mask.reshape(-1).argmax() if mask is not None else x3
    _stats_kernel[(chunks, triton.cdiv(c, block_c))](
        x3, mask if mask is not None else x3, first, pmean, pm2, pcnt, c, inner, p, chunk,
        BLOCK_P=block_p, BLOCK_C=block_c, HAS_MASK=mask is not None, num_warps=config.CHANNELS_WARPS,
    )  # fmt: skip
    # stage 2: Chan's combination of the chunks, in a fixed order
    count = pcnt.sum()
    denom = count.clamp_min(1)
    mean = (pmean * pcnt).sum(0) / denom
    m2 = pm2.sum(0) + (pcnt * (pmean - mean).square()).sum(0)
    return mean, m2 / denom, count


def _non_finite_padding(x3: Tensor, mask: Tensor) -> Tensor:
    """Where ``x3`` holds inf or NaN at a padded position (``mask``: one flag per position)."""
    return ~torch.isfinite(x3) & (mask[:, None, :] == 0)


def _channels_fwd_impl(
    x3: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    mean_in: Optional[Tensor],
    var_in: Optional[Tensor],
    mask: Optional[Tensor],
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, mean, rstd, biased var, count) for a contiguous (outer, C, inner) ``x3``; batch statistics
    over the positions where ``mask`` (uint8, (outer, inner), or None) is set, or the given
    ``mean_in``/``var_in`` (evaluation). ``count`` is the number of valid positions (0-d, fp32)."""
    outer, c, inner = x3.shape
    y = torch.empty_like(x3)
    if not use_kernel(x3) or outer * inner == 0:
        yr, m, r, v, n = _ref_fwd(x3, weight, bias, mean_in, var_in, mask, eps)
        return y.copy_(yr), m, r, v, n
    if mean_in is None:
        mean, var, count = _batch_stats(x3, mask)
        rstd = torch.where(count > 0, torch.rsqrt(var + eps), torch.zeros_like(var))  # empty: y = bias
    else:
        mean, var = mean_in.float().clone(), var_in.float().clone()
        # fp32 as the fake says, whatever the default dtype; a fill on the device, not a host copy
        count = torch.full((), float(outer * inner), dtype=torch.float32, device=x3.device)
        rstd = torch.rsqrt(var + eps)
    _, _, p, block_p, block_c, _ = _launch(x3)
    _apply_kernel[(triton.cdiv(p, block_p), triton.cdiv(c, block_c))](
        x3, y, mean, rstd, weight if weight is not None else x3, bias if bias is not None else x3,
        c, inner, p, BLOCK_P=block_p, BLOCK_C=block_c,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, num_warps=config.CHANNELS_WARPS,
    )  # fmt: skip
    return y, mean, rstd, var, count


channels_fwd = torch.library.custom_op("normscope::channels_fwd", mutates_args=())(_channels_fwd_impl)


@channels_fwd.register_fake
def _channels_fwd_fake(x3, weight, bias, mean_in, var_in, mask, eps):
    c = x3.shape[1]
    stat = lambda: x3.new_empty((c,), dtype=torch.float32)  # noqa: E731
    return torch.empty_like(x3), stat(), stat(), stat(), x3.new_empty((), dtype=torch.float32)


def _channels_bwd_impl(
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
    p = outer * inner
    if not use_kernel(x3) or p == 0:
        acc = torch.float64 if x3.dtype == torch.float64 else torch.float32
        dyf = dy.to(acc)
        xhat = (x3.to(acc) - mean.to(acc)[:, None]) * rstd.to(acc)[:, None]
        if mask is not None:  # as the kernel: a non-finite padded value enters no sum and gets no gradient
            bad = _non_finite_padding(x3, mask)
            dyf, xhat = torch.where(bad, 0, dyf), torch.where(bad, 0, xhat)
        sdy, sdyx = dyf.sum((0, 2)), (dyf * xhat).sum((0, 2))
        scale = rstd.to(acc) * (weight.to(acc) if weight is not None else 1)
        dx = dyf
        if training and p:
            corr = (sdy[:, None] + xhat * sdyx[:, None]) / count.to(acc).clamp_min(1)
            if mask is not None:
                corr = torch.where(mask[:, None, :] != 0, corr, 0)
            dx = dyf - corr
        return (dx * scale[:, None]).to(x3.dtype), sdyx.float(), sdy.float()
    _, _, _, block_p, block_c, chunk = _launch(x3)
    chunks = triton.cdiv(p, chunk)
    psdy = torch.empty((chunks, c), dtype=torch.float32, device=x3.device)
    psdyx = torch.empty((chunks, c), dtype=torch.float32, device=x3.device)
    _bwd_sums_kernel[(chunks, triton.cdiv(c, block_c))](
        dy, x3, mask if mask is not None else x3, mean, rstd, psdy, psdyx, c, inner, p, chunk,
        BLOCK_P=block_p, BLOCK_C=block_c, HAS_MASK=mask is not None, num_warps=config.CHANNELS_WARPS,
    )  # fmt: skip
    sdy, sdyx = psdy.sum(0), psdyx.sum(0)  # deterministic second stage
    dx = torch.empty_like(x3)
    _bwd_dx_kernel[(triton.cdiv(p, block_p), triton.cdiv(c, block_c))](
        dy, x3, mask if mask is not None else x3, mean, rstd, weight if weight is not None else x3, sdy, sdyx, dx,
        count, c, inner, p,
        BLOCK_P=block_p, BLOCK_C=block_c, HAS_WEIGHT=weight is not None, TRAINING=training,
        HAS_MASK=mask is not None, num_warps=config.CHANNELS_WARPS,
    )  # fmt: skip
    return dx, sdyx, sdy


channels_bwd = torch.library.custom_op("normscope::channels_bwd", mutates_args=())(_channels_bwd_impl)


@channels_bwd.register_fake
def _channels_bwd_fake(dy, x3, weight, mean, rstd, mask, count, training):
    c = x3.shape[1]
    return torch.empty_like(x3), x3.new_empty((c,), dtype=torch.float32), x3.new_empty((c,), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x3, weight, bias, mean_in, var_in, mask, eps = inputs
    _, mean, rstd, _, count = output
    ctx.save_for_backward(x3, weight, mean, rstd, mask, count)
    ctx.training, ctx.eps = mean_in is None, eps
    ctx.b_dtype = bias.dtype if bias is not None else None


def _backward(ctx, dy, dmean, drstd, dvar, dcount):
    x3, weight, mean, rstd, mask, count = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: a backward that is itself differentiable
        return _backward_differentiable(ctx, dy, x3, weight, mean, rstd, mask)
    dx, dw, db = _eager.pick(
        channels_bwd, _channels_bwd_impl, dy.contiguous(), x3, weight, mean, rstd, mask, count, ctx.training
    )
    return (
        dx,
        dw.to(weight.dtype) if weight is not None else None,
        db.to(ctx.b_dtype) if ctx.b_dtype is not None else None,
        None, None, None, None,
    )  # fmt: skip


def _backward_differentiable(ctx, dy, x3, weight, mean, rstd, mask):
    """The gradients as differentiable ops, for ``create_graph=True`` (double backward): the
    kernel's backward has no derivative of its own, so differentiate the reference instead
    (training: batch statistics recomputed from x; evaluation: the running ones, constants)."""
    need = ctx.needs_input_grad
    need_w = weight is not None and need[1]
    wanted = [t for t, n in ((x3, need[0]), (weight, need_w)) if n]
    dx = dw = db = None
    if mask is not None:  # a non-finite padded value is a constant: no cotangent in, no gradient out
        bad = _non_finite_padding(x3, mask)
        dy = torch.where(bad, 0, dy)
    if wanted:
        with torch.enable_grad():
            if ctx.training:
                xs = torch.where(bad, 0, x3) if mask is not None else x3
                y = _ref_fwd(xs, weight, None, None, None, mask, ctx.eps)[0]
            else:
                acc = torch.float64 if x3.dtype == torch.float64 else torch.float32
                # the running statistics are constants; detached, since the saved ``mean``/``rstd`` are
                # this op's own outputs, through which the grad below reached this backward again, with
                # no output gradient (None: AttributeError)
                mean, rstd = mean.detach(), rstd.detach()
                y = (x3.to(acc) - mean.to(acc)[:, None]) * rstd.to(acc)[:, None]
                y = (y * weight.to(acc)[:, None] if weight is not None else y).to(x3.dtype)
            grads = list(torch.autograd.grad(y, wanted, dy.to(y.dtype), create_graph=True))
        dx = grads.pop(0) if need[0] else None
        dw = grads.pop(0).to(weight.dtype) if need_w else None
    if ctx.b_dtype is not None and need[2]:
        db = dy.sum((0, 2)).to(ctx.b_dtype)
    return dx, dw, db, None, None, None, None


channels_fwd.register_autograd(_backward, setup_context=_setup_context)
#: channels_fwd with the same functions, for eager mode (see kernels/_eager.py)
_ChannelsEager = _eager.function(_channels_fwd_impl, _setup_context, _backward)


def batch_norm_channels(
    x: Tensor,
    channel_dim: int,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    running_mean: Optional[Tensor] = None,
    running_var: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """BatchNorm with statistics per index of ``channel_dim`` (batch statistics, or the running
    ones when both are given). ``mask``: a bool tensor of x's shape without the channel axis
    (one flag per position, shared by all channels); only set positions enter the statistics.
    Returns ``(y, batch mean, batch biased var, count)`` (the running ones in evaluation).
    Inputs are assumed valid; non-contiguous input is copied first."""
    shape = x.shape
    # a channels_last (4-D) or channels_last_3d (5-D) input gives an output in its layout, as torch's
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    cl = fmt is not None and not x.is_contiguous() and x.is_contiguous(memory_format=fmt)
    x = x.contiguous()
    c = shape[channel_dim]
    outer = 1
    for s in shape[:channel_dim]:
        outer *= s
    x3 = x.reshape(outer, c, -1)  # the engine backend declines empty scopes
    m2 = mask.reshape(outer, x3.shape[2]).to(torch.uint8) if mask is not None else None
    y, mean, _, var, count = _eager.call(
        channels_fwd, _ChannelsEager, _channels_fwd_impl,
        x3,
        dense(weight), dense(bias), dense(running_mean), dense(running_var), m2, float(eps),
    )  # fmt: skip
    y = y.view(shape)
    return (y.contiguous(memory_format=fmt) if cl else y), mean, var, count
