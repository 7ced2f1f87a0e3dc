"""The ``"composite"`` backend: masked normalization from a few large ATen ops, with a closed-form backward.

ATen has no masked normalization, and the reference computes one with some fifteen full-size
autograd ops each way (about 4x an unmasked BatchNorm on a CPU). This backend runs the masked
scopes that padding masks produce -- BatchNorm (statistics per channel), InstanceNorm (per sample
and channel), GroupNorm (per sample and group of channels) -- as the same two steps as the
reference, with the work moved onto ops that are fast on any device:

* the view: ``x`` as ``(O, C, I)`` -- ``O`` the axes before the channel axis, ``I`` those after --
  and the mask as one flag per position, ``(O, I)``;
* **statistics**: masked sums -- per sample (InstanceNorm, GroupNorm) torch's reduction of
  ``x * mask``, shared by the batch (BatchNorm) a matrix product ``bmm(x, mask)`` (one read of ``x``
  in BLAS; the mask is 0/1, so each product is exact; BLAS rounds by the data's address, so it is
  never a per-sample sum: :func:`_masked_sums`). The variance is two-pass -- the sum of squared
  deviations from the first mean -- with Chan's correction of that mean, so mean 1e4 / std 1e-2
  still normalizes to unit variance;
* **apply**: one per-channel affine pass (:func:`_affine`: ATen's evaluation-mode BatchNorm kernel,
  or ``addcmul`` for rows) on the centred tensor it keeps for the backward;
* **backward**: the two sums every normalization backward needs, ``sum(dy)`` and ``sum(dy * xhat)``
  over each scope, from ATen's own BatchNorm backward kernel (one pass, both sums), then
  ``dx = rstd * w * dy - mask * (alpha + beta * d)`` in three passes (``d = x - mean0``). Padded positions are
  normalized with the valid elements' statistics, so their ``dy`` reaches the valid inputs
  through the statistics, exactly as in the reference; their own input gets ``rstd * w * dy``.

Padding may hold anything: a non-finite value (or one too large to square) would turn a 0/1
product into NaN, so when a sum comes out non-finite the statistics are computed again with the
padding set to 0 -- exact, since padding has weight 0 -- and the call stays here. Padded outputs
are still the padding's own values normalized (+-inf or NaN for non-finite padding), and a
non-finite padded value is a constant that passes no gradient to anything (itself, the weight, the
bias, the statistics): the rule of :func:`normscope.reference.apply`, without which every gradient
would be ``0 * inf = NaN``. Only a non-finite *valid* value sends the call to the reference
(``last_backend()`` then says ``"reference"``), whose statistics are NaN as torch's would be. A scope
with no valid element gets rstd 0 (its output is the bias), as in the reference.

Layouts: a transposed or channels_last input is read in place (no copy); the output keeps its
layout, as torch's GroupNorm and BatchNorm do.

Higher-order gradients: the backward is a closed form of the first derivative. When autograd asks
for a differentiable backward (``create_graph=True``), it recomputes the call on the reference and
differentiates that, so double backward is exact, not silently zero.

Not covered (declined, so the next backend runs them): masks that vary along the channel axis,
masked uncentered (RMS) scopes, any other scope shape, and masked scopes under tracing
(``torch.compile`` / ``torch.jit``: the reference traces without graph breaks; the masked path
synchronizes once per call to check finiteness).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .. import engine
from .. import reference as ref
from .._strides import fills_memory
from ..engine import Backend, Call, Runner

__all__ = ["NAME", "BACKEND"]

NAME = "composite"


class _View(NamedTuple):
    """Where a scope lives in the ``(O, C, I)`` view.

    ``per_outer``: statistics per index of ``O`` (InstanceNorm, GroupNorm) or shared by all of them
    (BatchNorm). ``groups``: statistics per group of ``C // groups`` consecutive channels.
    """

    channel_dim: int
    per_outer: bool
    groups: int


def _view(call: Call) -> _View | None:
    """The scope's classification (:attr:`normscope.scope.Resolved.form`) as an ``(O, C, I)`` view."""
    s = call.scope
    if not s.centered:
        return None
    f = s.form
    # per sample first: statistics per index of axis 0 are also "BatchNorm over axis 0", but a
    # padding mask varies along axis 0, which that view cannot take
    if f.sample_groups:
        return _View(1, True, s.groups)  # GroupNorm(G, C); G = 1 is LayerNorm over (C, *)
    if f.instance:
        return _View(1, True, s.shape[1])  # InstanceNorm: per sample and channel
    if f.channel is not None:  # BatchNorm: statistics per index of one axis, over all the others
        return _View(f.channel, False, s.shape[f.channel])
    return None


def why_not(call: Call) -> str | None:
    if call.mask is None:
        return "the composite backend runs masked scopes only (unmasked: aten, and the rows backend for RMS scopes)"
    if engine.tracing():
        return "tracing: the reference traces without graph breaks"
    if call.x.device.type == "meta":
        return "meta tensors: the reference has no data-dependent step"
    if any(n == 0 for n in call.scope.shape):
        return "empty input (the reference returns it)"
    if call.running is not None and not call.running.use_input_stats:
        return "evaluation normalizes with the running statistics: no masked statistics to compute"
    v = _view(call)
    if v is None:
        return "no composite form for this scope (masked BatchNorm, InstanceNorm and GroupNorm have one)"
    if call.x.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        return f"floating-point input only, got {call.x.dtype}"
    if engine.position_mask(call.mask, call.x, v.channel_dim) is None:
        return "the mask varies along the channel axis (one flag per position is needed)"
    return None


# ----------------------------------------------------------------------------------------------
# step 1: statistics


class _Stats(NamedTuple):
    """Statistics of every scope, (R, G): R = O for per-sample scopes, else 1; G scopes a row."""

    d: Tensor  # x - mean0, (O, C, I) in the accumulation dtype: what apply and backward work on
    shift: Tensor  # mean - mean0 (Chan's correction), so mean = mean0 + shift
    rstd: Tensor  # 0 for a scope with no valid element
    mean: Tensor
    var: Tensor  # biased
    count: Tensor  # valid elements
    finite: Tensor  # 0-d bool: every masked sum came out finite


#: masked sums over more positions than this are taken by blocks of this many, the blocks' sums added in
#: float64: one batched GEMM (BatchNorm's sums) accumulates its positions one after another, an error
#: growing with their count -- masked InstanceNorm over 2^20 fp32 positions was rms 4.2e-6 off float64,
#: torch's 9e-8; a block's sum is as accurate as torch's. Per-sample sums (torch's reduction of the
#: products) take the same blocks: a block-sized temporary, and no row long enough for ATen to split
#: across threads. The blocks depend on the scope's own length only (isolation)
SUM_BLOCK = 16384


def _masked_sums(t: Tensor, mf: Tensor, per_outer: bool, square: bool = False) -> Tensor:
    """``sum_i t[o, c, i] * mf[o, i]`` (``t[o, c, i] ** 2 * mf[o, i]`` with ``square``), shaped (O, C) --
    or (1, C) summed over O when not per_outer."""
    o, c, i = t.shape
    long = i if per_outer or i > 1 else o // math.gcd(o, 16)  # the positions one product accumulates
    if long > SUM_BLOCK:
        wide = torch.float64 if t.dtype != torch.float64 else t.dtype
        if per_outer or i > 1:
            parts = (
                _masked_sums(t[:, :, s : s + SUM_BLOCK], mf[:, s : s + SUM_BLOCK], per_outer, square)
                for s in range(0, i, SUM_BLOCK)
            )
        else:  # (B*S, D) rows: blocks of rows, each one batch of 16 products as below
            step = 16 * SUM_BLOCK
            parts = (_masked_sums(t[s : s + step], mf[s : s + step], False, square) for s in range(0, o, step))
        total = None
        for part in parts:
            total = part.to(wide) if total is None else total.add_(part)
        return total.to(t.dtype)
    if per_outer:
        # a sample's sums by torch's own reduction, not a BLAS product: MKL's GEMM rounds by the data's
        # address (it peels to an aligned start), so a sample inside a batch -- at offset i * C * I --
        # and the same sample alone summed differently in their last bits (measured: every 16-byte
        # offset class of an AVX2 CPU's sgemm). torch's reduction orders a row's terms by their
        # index only, and the blocks above keep the products' temporary small and every row shorter
        # than ATen's split of one long reduction across threads (SPLIT_ELEMENTS): scope isolation.
        # The square as (t * t) * m, in one temporary: padding too large to square makes the sum
        # non-finite (inf * 0), which sends the call to the statistics with the padding set to 0 --
        # and the backward then keeps that padding out of its masked term (see _MaskedApply)
        m = mf.unsqueeze(1)
        return (torch.mul(t, t).mul_(m) if square else torch.mul(t, m)).sum(-1)
    t = t * t if square else t  # a block's squares (BatchNorm's sums), not the whole input's
    if not per_outer and i == 1:
        # (B*S, D) rows: one matrix-vector product, split into a batch of them -- BLAS runs a
        # batch of 16 several times faster than the single long product
        b = math.gcd(o, 16)
        return torch.bmm(mf.view(b, 1, o // b), t.view(b, o // b, c)).sum(0)
    # statistics shared by the whole batch (BatchNorm): one scope, so no isolation to keep. mf as a
    # transposed (O, I, 1) view: BLAS takes this layout as one batched GEMM, several times faster
    # than the contiguous (O, I, 1) column it treats as O separate matrix-vector products
    col = mf.unsqueeze(1).transpose(1, 2)
    return torch.bmm(t, col).view(o, c).sum(0, keepdim=True)


def _affine(t: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """``t * scale + shift`` with (R, C) factors on an (O, C, I) tensor, R = O or 1, in one pass.

    ATen's BatchNorm evaluation kernel is exactly a per-channel ``t * w + b`` when its running mean
    is 0 and running variance 1 with eps 0 -- and about twice as fast on a CPU as ``addcmul`` with
    (1, C, 1) factors. Per-sample factors use the (1, O * C, I) view, as torch's instance_norm does.
    Rows (I = 1) take ``addcmul``, whose (C,) factors run along the contiguous axis.
    """
    o, c, i = t.shape
    w, b = scale.reshape(-1), shift.reshape(-1)
    if scale.shape[0] == 1 and i == 1:  # (O, C) rows: the factors broadcast along the fast axis
        return torch.addcmul(b, t.view(o, c), w).view(o, c, i)
    if not t.is_contiguous():
        # a transposed or channels_last tensor: per-sample factors have no (1, O * C, I) view of it,
        # and ATen's kernel would return a contiguous output; broadcast (R, C, 1) factors instead --
        # no copy, and the output keeps t's layout, as torch's GroupNorm and BatchNorm keep it
        return torch.addcmul(shift.view(-1, c, 1), t, scale.view(-1, c, 1))
    tv = t if scale.shape[0] == 1 else t.view(1, o * c, i)
    zero, one = torch.zeros_like(w), torch.ones_like(w)
    return torch.batch_norm(tv, w, b, zero, one, False, 0.0, 0.0, False).view(o, c, i)


def _to_scopes(t: Tensor, groups: int) -> Tensor:
    """(R, C) per-channel sums -> (R, G) per-scope sums."""
    r, c = t.shape
    return t if groups == c else t.view(r, groups, c // groups).sum(-1)


def _to_channels(t: Tensor, c: int) -> Tensor:
    """(R, G) per-scope values -> (R, C, 1), each scope's value on each of its channels."""
    r, g = t.shape
    return (t if g == c else t.repeat_interleave(c // g, dim=1)).view(r, c, 1)


def _stats(x3: Tensor, mf: Tensor, v: _View, eps: float, constant_bias: bool = False) -> _Stats:
    """The statistics of every scope; ``constant_bias``: the call's
    :func:`normscope.reference.constant_gives_bias` (a zero variance with eps 0 gives rstd 0)."""
    c = x3.shape[1]
    # valid elements per scope: per outer index (times the channels a group holds), or all of them
    per = mf.sum(1, keepdim=True) if v.per_outer else mf.sum().view(1, 1)
    count = (per * (c // v.groups)).expand(per.shape[0], v.groups)
    denom = count.clamp_min(1)
    s = _to_scopes(_masked_sums(x3, mf, v.per_outer), v.groups)
    mean0 = s / denom
    d = x3 - _to_channels(mean0, c)
    # corrected two-pass (as reference.moments): the deviations' own mean removes the rounding of
    # the first mean from both moments
    shift = _to_scopes(_masked_sums(d, mf, v.per_outer), v.groups) / denom
    s2 = _to_scopes(_masked_sums(d, mf, v.per_outer, square=True), v.groups)
    # as reference.moments: shift^2 clamped finite, so a scope whose squares overflow has variance inf, not NaN
    var = (s2 / denom - (shift * shift).clamp_max(torch.finfo(shift.dtype).max)).clamp_min(0)
    valid = count > 0
    if eps == 0 and constant_bias:  # torch's batch_norm kernel (InstanceNorm's): rstd 0, not 1 / sqrt(0)
        valid = valid & (var != 0)
    rstd = torch.where(valid, torch.rsqrt(var + eps), torch.zeros_like(var))
    finite = torch.isfinite(s).all() & torch.isfinite(s2).all()
    return _Stats(d, shift, rstd, mean0 + shift, var, count, finite)


# ----------------------------------------------------------------------------------------------
# step 2: apply, with its closed-form backward


class _MaskedApply(torch.autograd.Function):
    """``y = (x - mean) * rstd * w + b`` from the centred tensor ``d = x - mean0``.

    Inputs: x (O, C, I) as given (any float dtype), weight and bias (C,) or None, and the
    statistics of :func:`_stats` -- constants here: their dependence on ``x`` is differentiated in
    closed form in :meth:`backward`.
    """

    @staticmethod
    def forward(ctx, x3, weight, bias, d, shift, rstd, count, mf, groups, call, d_out=None, bad=None):
        # d_out, bad: only when the padding holds non-finite values (see ``prepare``): the output is
        # computed from d_out (the padding's own +-inf/NaN there), the backward from d (finite), and
        # the ``bad`` positions (non-finite padding) pass no gradient, as in reference.apply
        c = x3.shape[1]
        rows = rstd.shape[0]
        scale = _to_channels(rstd, c).view(rows, c)
        if weight is not None:
            scale = scale * weight.to(d.dtype).view(1, c)
        base = -_to_channels(shift, c).view(rows, c) * scale
        if bias is not None:
            base = base + bias.to(d.dtype).view(1, c)
        ctx.save_for_backward(x3, weight, bias, d, shift, rstd, count, mf, bad)
        ctx.groups = groups
        v = _view(call)
        # for the reference recomputation of a double backward: the call without its tensors. A tensor
        # kept on ctx bypasses saved-tensor hooks (offloading kept the input alive) and the version
        # check (a mask changed in place after the forward gave a silently wrong gradient): the mask is
        # rebuilt from the saved ``mf``
        ctx.call = call._replace(x=None, weight=None, bias=None, mask=None, running=None, residual=None)
        ctx.shape, ctx.channel_dim = tuple(call.x.shape), v.channel_dim
        # per-sample scopes (InstanceNorm, GroupNorm) even for one sample, where rows == 1 as BatchNorm's
        ctx.per_outer = v.per_outer
        y = _affine(d if d_out is None else d_out, scale, base)
        if y._base is not None and y._base.numel() == y.numel():
            # the kernel's own result, not _affine's reshaping view of it (``run`` shapes it): autograd
            # refuses in-place ops on an output that is a view made inside a Function, and torch's
            # norms allow ``y.add_(1)``, ``y.relu_()`` on theirs
            y = y._base
        return y.to(x3.dtype)

    @staticmethod
    def backward(ctx, dy):
        x3, weight, bias, d, shift, rstd, count, mf, bad = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiate the reference instead
            return _reference_grads(ctx, dy, x3, weight, bias, mf)
        o, c, i = d.shape
        rows = rstd.shape[0]  # O for per-sample scopes, 1 for BatchNorm
        g = dy.reshape(o, c, i).to(d.dtype)
        if bad is not None:  # non-finite padding: a constant, no gradient through it (reference.apply)
            g = _laid_like(g, torch.where(bad, 0, g))
        # sum(dy * d) and sum(dy) per channel in one pass of ATen's BatchNorm backward kernel (with
        # mean 0 and invstd 1 its "xhat" is our d); per (sample, channel) for per-sample scopes
        if ctx.per_outer and (not d.is_contiguous() or i > SUM_BLOCK):
            # a transposed or channels_last input (``_affine``): no (1, O * C, I) view; plain sums --
            # for one sample too: BatchNorm's kernel below sums in another order, and a sample alone
            # would differ in its last bits from the same sample in a batch (scope isolation). A scope
            # of more than SUM_BLOCK positions too: BatchNorm's backward kernel accumulates a channel's
            # positions one after another, an error growing with their count (the weight gradient of a
            # masked InstanceNorm over 40000 fp32 positions was 20x the reference's off float64, past
            # torch's own by 5x), where torch's sum is pairwise. The choice is on the scope's length:
            # the same for a sample alone and in a batch
            sdd, sd = (g * d).sum(2), g.sum(2)
        else:
            if ctx.per_outer:
                gv, dv = g.reshape(1, o * c, i), d.view(1, o * c, i)  # reshape: dy may come in any layout
            else:
                gv, dv = (g.view(o, c), d.view(o, c)) if i == 1 else (g, d)  # (O, C): channels-last loop
            zeros = d.new_zeros(gv.shape[1])
            _, sdd, sd = torch.ops.aten.native_batch_norm_backward(
                gv, dv, None, None, None, zeros, torch.ones_like(zeros), True, 0.0, [False, True, True]
            )
        sdd, sd = sdd.view(rows, c), sd.view(rows, c)
        rstd_c, shift_c = _to_channels(rstd, c), _to_channels(shift, c)
        sxhat = (sdd - shift_c.view(rows, c) * sd) * rstd_c.view(rows, c)  # sum(dy * xhat)
        wc = None if weight is None else weight.to(d.dtype).view(1, c)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dx = rstd * (dxhat - mask * (sum(dxhat) + xhat * sum(dxhat * xhat)) / count), dxhat = dy * w,
            # sums over each whole scope (padding included: its output depends on the statistics);
            # with xhat = rstd * (d - shift) that is k * dy - mask * (alpha + beta * d)
            a = _to_scopes(sd if wc is None else sd * wc, ctx.groups)
            b = _to_scopes(sxhat if wc is None else sxhat * wc, ctx.groups)
            n = count.clamp_min(1)
            beta = rstd * rstd * b / n
            alpha = rstd * a / n - beta * shift
            k = rstd_c if wc is None else rstd_c * wc.view(1, c, 1)
            # padding too large to square in the sums (the only other way here): keep it out of the
            # masked term, which it would overflow before the mask multiplies it by 0
            dm = d if bad is None else _laid_like(d, torch.where(mf.view(o, 1, i) != 0, d, 0))
            # three passes and one allocation: -(alpha + beta * d), masked in place, + k * dy in place
            grad_x = _affine(dm, -_to_channels(beta, c).view(rows, c), -_to_channels(alpha, c).view(rows, c))
            grad_x.mul_(mf.view(o, 1, i))
            grad_x = grad_x.addcmul_(g, k).to(x3.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sxhat.sum(0).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = sd.sum(0).to(bias.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None, None


def _reference_grads(ctx, dy, x3, weight, bias, mf):
    """Gradients of the reference computation of the same call, differentiable (double backward)."""
    call, shape, d = ctx.call, ctx.shape, ctx.channel_dim
    inputs = (x3, weight, bias)
    need = [t is not None and n for t, n in zip(inputs, ctx.needs_input_grad[:3])]
    # the mask from the saved flags (``mf``, one per position), broadcast along the channel axis as the call's
    mask = (mf != 0).reshape(shape[:d] + (1,) + shape[d + 1 :])
    # the reference's two steps, the mask given to apply too (non-finite padding, reference.apply)
    x = x3.reshape(shape)
    xf = x.to(ref.acc_dtype(x.dtype))
    m = ref.moments(xf, call.scope, mask)
    r = ref.rstd(m.var, call.eps, m.count, ref.constant_gives_bias(call.scope, call.op, x.device))
    y = ref.apply(xf, m.mean, r, call.scope, weight, bias, mask).to(x.dtype)
    wanted = [t for t, n in zip(inputs, need) if n]
    grads = iter(torch.autograd.grad(y, wanted, dy.reshape(shape), create_graph=True, allow_unused=True))
    out = [next(grads) if n else None for n in need]
    return (*out, None, None, None, None, None, None, None, None, None)


# ----------------------------------------------------------------------------------------------
# the backend


def _samples_outermost(t: Tensor) -> bool:
    """Whether the samples of an (O, C, I) tensor lie one after another in memory (each sample's
    elements before the next's), as in every layout a sample alone keeps dense: contiguous,
    channels_last, transposed within the sample."""
    if t.shape[0] == 1:
        return True
    return all(n == 1 or st <= t.stride(0) for n, st in zip(t.shape[1:], t.stride()[1:]))


def _laid_like(like: Tensor, t: Tensor) -> Tensor:
    """``t``'s values in ``like``'s memory layout. ``torch.where`` lays its output out from all its
    operands, so for a channels_last or transposed input its result may come back contiguous:
    the sums and the backward then run in another order than for the same input padded with finite
    values, and the valid gradients change in their last bits with the padding's values."""
    if t.stride() == like.stride():
        return t
    return torch.empty_like(like).copy_(t)


def prepare(call: Call, automatic: bool) -> Runner:
    v = _view(call)
    constant_bias = ref.constant_gives_bias(call.scope, call.op, call.x.device)

    def run(c: Call) -> Tensor:
        if engine.transformed():
            # inside torch.func: the finiteness check (a bool of a tensor) and the autograd.Function
            # cannot run there; the reference is plain differentiable ops
            return engine.recompute(c)
        shape = tuple(c.x.shape)
        d = v.channel_dim
        o, ch, i = math.prod(shape[:d]), shape[d], math.prod(shape[d + 1 :])
        acc = ref.acc_dtype(c.x.dtype)
        x3 = c.x.reshape(o, ch, i)
        mf = engine.position_mask(c.mask, c.x, d).reshape(o, i).to(acc)  # (O, I): one flag per position
        d_out = bad = None
        # the masked sums are matrix products, which autocast would run in bf16/fp16 (ref.no_autocast)
        with torch.no_grad(), ref.no_autocast(c.x.device):
            xa = x3.detach().to(acc)
            if not fills_memory(x3.shape, x3.stride()) or (v.per_outer and not _samples_outermost(x3)):
                # a view with gaps (a strided slice): a dense copy, as ``.to`` makes for half types.
                # Its statistics are summed in the layout that the recomputation below, with the
                # padding set to 0, sums them in (_laid_like cannot lay a tensor out with gaps):
                # else the valid outputs would change in their last bits with the padding's values.
                # Per-sample scopes whose samples are not the outermost axis in memory (a (C, B, L)
                # tensor viewed as (B, C, L)) too: such a batch is dense but one sample of it is not,
                # so a sample alone was copied and one in the batch was not, and the backward summed
                # the two in other orders (scope isolation: the layout must be decided per sample).
                # Decided on x3, not on xa: ``.to`` lays the fp32 copy of a view with gaps out densely
                # in an order of its own (a half-precision sample alone, taken from such a batch)
                xa = xa.contiguous()
            st = _stats(xa, mf, v, c.eps, constant_bias)
            finite = bool(st.finite)  # the one host sync of the call
            if not finite:
                # padding may hold anything: a non-finite (or unsquarable) padded value turns a 0/1
                # product into NaN. Statistics again with the padding set to 0 -- exact, as 0 has
                # weight 0 -- then the padding's own values back, for the output only
                valid = mf.view(o, 1, i) != 0
                st = _stats(_laid_like(xa, torch.where(valid, xa, 0)), mf, v, c.eps, constant_bias)
                finite = bool(st.finite)
                if finite:
                    # x - mean0 at the padding (mean0 to rounding: only padded outputs read it)
                    d_out = _laid_like(st.d, torch.where(valid, st.d, xa - _to_channels(st.mean - st.shift, ch)))
                    bad = ~torch.isfinite(xa) & ~valid
                    # what the backward reads: finite
                    st = st._replace(d=_laid_like(st.d, torch.where(bad, 0, d_out)))
        if not finite:  # a non-finite *valid* value: NaN statistics, as torch's layer gives
            return engine.recompute(c)  # outside no_grad: the output keeps its graph
        if c.running is not None:
            sh = c.scope.stat_shape
            engine.update_running(c, ref.Moments(st.mean.reshape(sh), st.var.reshape(sh), st.count.reshape(sh)))
        # inference mode records no graph even where grad mode is on (``torch.enable_grad()`` inside it):
        # there the Function, recording, would save inference tensors, which autograd refuses; torch's
        # norms give an output that requires no grad
        with torch.set_grad_enabled(torch.is_grad_enabled() and not torch.is_inference_mode_enabled()):
            y = _MaskedApply.apply(x3, c.weight, c.bias, st.d, st.shift, st.rstd, st.count, mf, v.groups, c, d_out, bad)
        return y.view(shape)

    return run


BACKEND = Backend(NAME, why_not, prepare)
