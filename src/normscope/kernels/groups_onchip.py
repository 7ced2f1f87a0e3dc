# ruff: noqa: UP007, UP045  -- torch.library reads custom-op schemas from typing.Optional annotations
"""GroupNorm / InstanceNorm with the whole group on chip: the ``"onchip"`` variant of the groups family.

A candidate beside the default kernels (:mod:`.groups`), with the same contract and outputs: **not
measured on a GPU yet, and off by default** -- it runs only where ``kernels.config.GROUPS_VARIANT =
"onchip"`` pins it (the bench, the tests) or a committed measured-choice row names it
(:mod:`normscope.kernels.variants`).

What this covers
----------------
GroupNorm(G, C), InstanceNorm (``G = C``) and GroupNorm(1, C) on (N, C, *), fp32/fp16/bf16, centered
and RMS (``centered=False``), per-channel weight and bias, forward and backward (dx, dW, dB), contiguous
(NCHW) and channels_last / channels_last_3d memory read and written in place -- for groups that **fit
one program's register tile** (:func:`fits`: ``next_pow2(C/G) x next_pow2(H*W) <=
GROUPS_ONCHIP_MAX``). There one program holds its whole group and so reads it once:

* forward: x is loaded once; the mean is the mean of values scaled by ``1/L`` before the sum (no
  overflow near fp32's max), corrected by the mean of the deviations from it, and the variance is the
  mean square of the deviations from the corrected mean -- three reductions over registers, no
  ``E[x^2] - E[x]^2``; then y is written from the same registers (2 passes over memory where the default
  kernels make 3);
* backward: x and dy are loaded once; the two row sums (``sum(g * xhat)``, ``sum(g)``, ``g = dy * w``)
  and dx come from registers (3 passes where the default kernels make 5); per channel, ``sum(dy * xhat)`` and
  ``sum(dy)`` go to per-sample partial rows summed once over the batch (dW, dB: deterministic, no atomics).

**NCHW**: one program per (sample, group), a ``(next_pow2(C/G), next_pow2(H*W))`` tile of the
contiguous ``(C/G, H*W)`` block. **channels_last**: one program per (sample, block of adjacent groups),
a ``(next_pow2(H*W), BLOCK_G, next_pow2(C/G))`` tile, channels fastest, so a tile row is one contiguous
run of ``BLOCK_G * C/G`` channels (at most ``GROUPS_ONCHIP_WIDTH`` unless one group is wider). Every
group's statistics and bits are a function of its sample alone (no split of positions at all, and no
setting reads the batch size): batch-invariant by construction, in both layouts.

Limits
------
* Only groups that fit: ``GROUPS_ONCHIP_MAX = 16384`` elements by default. The backward holds x and dy
  in fp32 registers; ptxas (sm_90, Triton 3.6 and 3.9; ``benchmarks/compile_check.py --only onchip``)
  spills nothing at 8192-element tiles, ~100 B a thread at 16384 (channels_last) and 1.6-3.2 KB at 32768.
  The bench's GroupNorm(32) on 256 x 56 x 56 (8 x 3136, a tile of 32768) therefore runs the default kernels:
  a group that size would need several programs, and so a second read, or a cross-program exchange that
  Triton does not offer portably. The bench measures the candidate on GroupNorm(32) at 28 x 28 and on
  InstanceNorm at 56 x 56 instead.
* ``H*W`` and ``C/G`` that are not powers of two leave masked lanes (3136 in 4096: 23 %).
* Other strides than contiguous / channels_last(_3d) are copied to contiguous NCHW first, as the default.
* Every launch setting (``GROUPS_ONCHIP_*`` in :mod:`normscope.kernels.config`) is a guess: no GPU has
  run this file. ``benchmarks/gpu_check.sh bench`` times it beside the default kernels (bench cases
  ``group_norm_small@onchip``, ``group_norm_small_cl@onchip``, ``instance_norm@onchip``,
  ``instance_norm_cl@onchip``).

The reference (CPU tensors without ``TRITON_INTERPRET=1``, empty input, the double backward) is
:func:`._ref.groups_fwd_ref`, as for the default kernels.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _eager, config
from ._common import dense, use_kernel
from ._common import next_pow2 as _next_pow2
from ._ref import groups_bwd_ref as _ref_bwd
from ._ref import groups_fwd_ref as _ref_fwd
from .groups import _backward_differentiable, _cl_format, _cl_offsets, _empty_out, _laid_out, _setup_context, _view

__all__ = ["fits", "group_norm_onchip", "tiles"]


@triton.jit
def _moments(x, m, inv, CENTERED: tl.constexpr, AXIS_A: tl.constexpr, AXIS_B: tl.constexpr):
    """(mean, var) over axes AXIS_A then AXIS_B of the registers ``x`` (zeros where ``m`` is false): the
    mean of values scaled by ``inv = 1/L`` before the sum, corrected by the mean deviation from it; the
    variance from the deviations about the corrected mean. RMS (not CENTERED): mean 0, var = mean(x^2)."""
    if CENTERED:
        m1 = tl.sum(tl.sum(x * inv, axis=AXIS_A), axis=AXIS_B)
        if AXIS_A == 2:  # channels_last: (positions, groups, channels) -> per group
            m1b = m1[None, :, None]
        else:
            m1b = m1
        d = tl.where(m, x - m1b, 0.0)
        c1 = tl.sum(tl.sum(d, axis=AXIS_A), axis=AXIS_B) * inv
        if AXIS_A == 2:
            c1b = c1[None, :, None]
        else:
            c1b = c1
        e = tl.where(m, d - c1b, 0.0)
        mean = m1 + c1
        var = tl.sum(tl.sum(e * e, axis=AXIS_A), axis=AXIS_B) * inv
    else:
        var = tl.sum(tl.sum(x * x, axis=AXIS_A), axis=AXIS_B) * inv
        mean = var * 0.0
    return mean, var


# ---- NCHW: a (sample, group) is a contiguous (Cg, HW) block


@triton.jit
def _nchw_fwd_kernel(
    X, W, B, Y, MEAN, RSTD, G, Cg, HW, eps,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    CENTERED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(0) % G
    L = Cg * HW
    c = tl.arange(0, BLOCK_C)
    s = tl.arange(0, BLOCK_S)
    m = (c < Cg)[:, None] & (s < HW)[None, :]
    offs = row * L + c[:, None] * HW + s[None, :]
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    mean, var = _moments(x, m, 1.0 / L, CENTERED, 1, 0)
    rstd = tl.rsqrt(var + eps)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    y = (x - mean) * rstd
    if HAS_WEIGHT:
        y = y * tl.load(W + g * Cg + c, mask=c < Cg, other=0.0).to(tl.float32)[:, None]
    if HAS_BIAS:
        y = y + tl.load(B + g * Cg + c, mask=c < Cg, other=0.0).to(tl.float32)[:, None]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _nchw_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DWP, DBP, G, Cg, HW,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    CENTERED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(0) % G
    L = Cg * HW
    c = tl.arange(0, BLOCK_C)
    s = tl.arange(0, BLOCK_S)
    m = (c < Cg)[:, None] & (s < HW)[None, :]
    offs = row * L + c[:, None] * HW + s[None, :]
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=m, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row)
    if CENTERED:
        xhat = tl.where(m, (x - tl.load(MEAN + row)) * rstd, 0.0)
    else:
        xhat = x * rstd
    if HAS_WEIGHT:
        gy = dy * tl.load(W + g * Cg + c, mask=c < Cg, other=0.0).to(tl.float32)[:, None]
    else:
        gy = dy
    c1 = tl.sum(tl.sum(gy * xhat, axis=1), axis=0) / L
    if CENTERED:
        dx = (gy - (xhat * c1 + tl.sum(tl.sum(gy, axis=1), axis=0) / L)) * rstd
    else:
        dx = (gy - xhat * c1) * rstd
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=m)
    # per channel of the group: one writer per (sample, channel); summed over the batch by the host
    if HAS_WEIGHT:
        tl.store(DWP + row * Cg + c, tl.sum(dy * xhat, axis=1), mask=c < Cg)
    if HAS_BIAS:
        tl.store(DBP + row * Cg + c, tl.sum(dy, axis=1), mask=c < Cg)


# ---- channels_last: (N, HW, C) memory; a program holds BLOCK_G adjacent whole groups of one sample


@triton.jit
def _cl_block(G, C, Cg, HW, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's sample offset, groups (and which are real), channel slots and the tile's offsets
    (int64, from the sample's start) and mask."""
    pid = tl.program_id(0)
    gblocks = tl.cdiv(G, BLOCK_G)
    n = pid // gblocks
    g = (pid % gblocks) * BLOCK_G + tl.arange(0, BLOCK_G)
    ch, chm = _cl_offsets(g, 0, Cg, G, BLOCK_G, BLOCK_C)
    s = tl.arange(0, BLOCK_S)
    offs = s.to(tl.int64)[:, None, None] * C + ch[None, :, :]
    m = (s < HW)[:, None, None] & chm[None, :, :]
    return n.to(tl.int64) * HW * C, n, g, g < G, ch, chm, offs, m


@triton.jit
def _cl_fwd_kernel(
    X, W, B, Y, MEAN, RSTD, G, C, Cg, HW, eps,
    BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
    CENTERED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    base, n, g, gm, ch, chm, offs, m = _cl_block(G, C, Cg, HW, BLOCK_S, BLOCK_G, BLOCK_C)
    x = tl.load(X + base + offs, mask=m, other=0.0).to(tl.float32)
    mean, var = _moments(x, m, 1.0 / (HW * Cg), CENTERED, 2, 0)
    rstd = tl.rsqrt(var + eps)
    rows = n * G + g
    tl.store(MEAN + rows, mean, mask=gm)
    tl.store(RSTD + rows, rstd, mask=gm)
    y = (x - mean[None, :, None]) * rstd[None, :, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + ch, mask=chm, other=0.0).to(tl.float32)[None, :, :]
    if HAS_BIAS:
        y = y + tl.load(B + ch, mask=chm, other=0.0).to(tl.float32)[None, :, :]
    tl.store(Y + base + offs, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _cl_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DWP, DBP, G, C, Cg, HW,
    BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
    CENTERED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    base, n, g, gm, ch, chm, offs, m = _cl_block(G, C, Cg, HW, BLOCK_S, BLOCK_G, BLOCK_C)
    x = tl.load(X + base + offs, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(DY + base + offs, mask=m, other=0.0).to(tl.float32)
    rows = n * G + g
    rstd = tl.load(RSTD + rows, mask=gm, other=0.0)[None, :, None]
    if CENTERED:
        mean = tl.load(MEAN + rows, mask=gm, other=0.0)[None, :, None]
        xhat = tl.where(m, (x - mean) * rstd, 0.0)
    else:
        xhat = x * rstd
    if HAS_WEIGHT:
        gy = dy * tl.load(W + ch, mask=chm, other=0.0).to(tl.float32)[None, :, :]
    else:
        gy = dy
    inv = 1.0 / (HW * Cg)
    c1 = (tl.sum(tl.sum(gy * xhat, axis=2), axis=0) * inv)[None, :, None]
    if CENTERED:
        c2 = (tl.sum(tl.sum(gy, axis=2), axis=0) * inv)[None, :, None]
        dx = (gy - (xhat * c1 + c2)) * rstd
    else:
        dx = (gy - xhat * c1) * rstd
    tl.store(DX + base + offs, dx.to(DX.dtype.element_ty), mask=m)
    # per channel: row n of the (N, C) partial buffers, one writer each; summed over the batch by the host
    prow = n.to(tl.int64) * C + ch
    if HAS_WEIGHT:
        tl.store(DWP + prow, tl.sum(dy * xhat, axis=0), mask=chm)
    if HAS_BIAS:
        tl.store(DBP + prow, tl.sum(dy, axis=0), mask=chm)


# ---- launches


def _warps(tile: int) -> int:
    return _next_pow2(min(config.GROUPS_ONCHIP_MAX_WARPS, max(1, tile // config.GROUPS_ONCHIP_WARP_ELEMS)))


def tiles(groups: int, cg: int, hw: int, cl: bool) -> tuple[int, int, int, int]:
    """``(BLOCK_S, BLOCK_G, BLOCK_C, num_warps)`` of a group of ``cg`` channels x ``hw`` positions
    (``BLOCK_G = 1`` for NCHW). A function of one sample's layout (G, C/G, H*W), never of the batch
    size. Settings: ``GROUPS_ONCHIP_*`` in kernels/config.py."""
    bs, bc = _next_pow2(hw), _next_pow2(cg)
    bg = 1
    if cl:  # adjacent whole groups side by side, up to the width (and within the tile)
        bg = max(1, min(_next_pow2(groups), config.GROUPS_ONCHIP_WIDTH // bc, config.GROUPS_ONCHIP_MAX // (bs * bc)))
    return bs, bg, bc, _warps(bs * bg * bc)


def fits(x: Tensor, groups: int) -> bool:
    """Whether a group of ``x`` (already laid out: contiguous or channels_last(_3d)) fits one tile."""
    _, cg, hw = _view(x, groups)
    return _next_pow2(cg) * _next_pow2(hw) <= config.GROUPS_ONCHIP_MAX


def _onchip_fwd_impl(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], groups: int, eps: float, centered: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd) as :func:`.groups._groups_fwd_impl`, for groups that :func:`fits`."""
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
    cl = _cl_format(x) is not None
    bs, bg, bc, warps = tiles(groups, cg, hw, cl)
    args = (x, weight if weight is not None else x, bias if bias is not None else x, y, mean, rstd)
    flags = {"CENTERED": centered, "HAS_WEIGHT": weight is not None, "HAS_BIAS": bias is not None}
    if cl:
        grid = (x.shape[0] * triton.cdiv(groups, bg),)
        _cl_fwd_kernel[grid](
            *args, groups, x.shape[1], cg, hw, eps, BLOCK_S=bs, BLOCK_G=bg, BLOCK_C=bc, **flags, num_warps=warps
        )
    else:
        _nchw_fwd_kernel[(rows,)](*args, groups, cg, hw, eps, BLOCK_C=bc, BLOCK_S=bs, **flags, num_warps=warps)
    return y, mean, rstd


onchip_fwd = torch.library.custom_op("normscope::groups_onchip_fwd", mutates_args=())(_onchip_fwd_impl)


@onchip_fwd.register_fake
def _onchip_fwd_fake(x, weight, bias, groups, eps, centered):
    rows = x.shape[0] * groups
    return _empty_out(x), x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32)


def _onchip_bwd_impl(
    dy: Tensor,
    x: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    groups: int,
    centered: bool,
    has_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dW fp32 or empty, dB fp32 or empty) as :func:`.groups._groups_bwd_impl`."""
    x = _laid_out(x)
    fmt = _cl_format(x)
    dy = dy.contiguous(memory_format=fmt or torch.contiguous_format)  # a copy only if dy's layout differs
    rows, cg, hw = _view(x, groups)
    n, c = x.shape[0], x.shape[1]
    dx = _empty_out(x)
    has_w = weight is not None
    empty = lambda: x.new_empty(0)  # noqa: E731 - a fresh one each time: outputs must not alias
    if rows == 0 or cg * hw == 0:
        z = torch.zeros(c, dtype=torch.float32, device=x.device)
        return dx.zero_(), z if has_w else empty(), z.clone() if has_bias else empty()
    if not use_kernel(x):
        dxr, dw, db = _ref_bwd(dy, x, weight, mean, rstd, groups, centered, has_bias)
        dx.copy_(dxr)
        return dx, dw if has_w else empty(), db if has_bias else empty()
    cl = fmt is not None
    bs, bg, bc, warps = tiles(groups, cg, hw, cl)
    # per-(sample, channel) partials: one writer each, summed over the batch below (no atomics)
    dwp = torch.empty((n, c), dtype=torch.float32, device=x.device) if has_w else None
    dbp = torch.empty((n, c), dtype=torch.float32, device=x.device) if has_bias else None
    args = (dy, x, weight if has_w else x, mean, rstd, dx, dwp if has_w else dx, dbp if has_bias else dx)
    flags = {"CENTERED": centered, "HAS_WEIGHT": has_w, "HAS_BIAS": has_bias}
    if cl:
        grid = (n * triton.cdiv(groups, bg),)
        _cl_bwd_kernel[grid](*args, groups, c, cg, hw, BLOCK_S=bs, BLOCK_G=bg, BLOCK_C=bc, **flags, num_warps=warps)
    else:
        _nchw_bwd_kernel[(rows,)](*args, groups, cg, hw, BLOCK_C=bc, BLOCK_S=bs, **flags, num_warps=warps)
    return dx, dwp.sum(0) if has_w else empty(), dbp.sum(0) if has_bias else empty()


onchip_bwd = torch.library.custom_op("normscope::groups_onchip_bwd", mutates_args=())(_onchip_bwd_impl)


@onchip_bwd.register_fake
def _onchip_bwd_fake(dy, x, weight, mean, rstd, groups, centered, has_bias):
    c = x.shape[1]
    dw = x.new_empty((c,), dtype=torch.float32) if weight is not None else x.new_empty(0)
    db = x.new_empty((c,), dtype=torch.float32) if has_bias else x.new_empty(0)
    return _empty_out(x), dw, db


def _backward(ctx, dy, dmean, drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: differentiate the reference (groups.py's rule)
        return _backward_differentiable(ctx, dy, x, weight)
    dx, dw, db = _eager.pick(
        onchip_bwd, _onchip_bwd_impl, dy, x, weight, mean, rstd, ctx.groups, ctx.centered, ctx.b_dtype is not None
    )
    dw = dw.to(weight.dtype) if weight is not None else None
    db = db.to(ctx.b_dtype) if ctx.b_dtype is not None else None
    return dx, dw, db, None, None, None


onchip_fwd.register_autograd(_backward, setup_context=_setup_context)
#: onchip_fwd with the same functions, for eager mode (see kernels/_eager.py)
_OnchipEager = _eager.function(_onchip_fwd_impl, _setup_context, _backward)


def group_norm_onchip(
    x: Tensor,
    groups: int,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    centered: bool = True,
) -> Tensor:
    """:func:`.groups.group_norm` on the on-chip kernels, for an ``x`` whose groups :func:`fits`
    (:func:`.variants.group_norm` asks, and runs the default kernels otherwise). Same layouts and output."""
    y, _, _ = _eager.call(
        onchip_fwd, _OnchipEager, _onchip_fwd_impl,
        _laid_out(x), dense(weight), dense(bias), int(groups), float(eps), bool(centered),
    )  # fmt: skip
    return y
