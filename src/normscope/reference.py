"""The reference: every normalization in plain PyTorch ops, written to be read.

This is the oracle every fast path is tested against, the fallback on any device, and the code a
learner should read. The four steps are split into two pure functions:

    moments(x, scope, mask)  -> Moments(mean, var, count)     steps 1-2: mean and variance
    apply(x, mean, rstd, ...) -> y                            steps 3-4: normalize and affine

with :func:`rstd` in between. Running statistics (BatchNorm), synchronized statistics
(SyncBatchNorm) and another tensor's statistics (AdaIN) plug in between the two steps.

Numerics (DESIGN.md): statistics are accumulated in fp32 (fp64 for fp64 input); the variance is
two-pass -- the mean first, then the mean of squared deviations -- so an input with mean 1e4 and
std 1e-2 still normalizes to unit variance, which E[x^2] - E[x]^2 in fp32 would not.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
from torch import Tensor

from .scope import Resolved

__all__ = [
    "Moments",
    "acc_dtype",
    "autocasting",
    "no_autocast",
    "moments",
    "rstd",
    "constant_gives_bias",
    "apply",
    "normalize",
    "CASTINGS",
    "cast_affine",
]


class Moments(NamedTuple):
    """First two moments of each scope, in the accumulation dtype, shaped ``scope.stat_shape``.

    ``mean`` is zeros for an uncentered scope and ``var`` is then the mean square. ``count`` is the
    number of elements in each scope: an int without a mask, a tensor (shaped like ``mean``) with
    one. ``var`` is the biased (population) variance; BatchNorm's running estimate rescales it by
    ``count / (count - 1)``.
    """

    mean: Tensor
    var: Tensor
    count: int | Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are accumulated in: fp64 for fp64, fp32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def autocasting(device: torch.device) -> bool:
    """Whether autocast is on for ``device``'s type (False for a type autocast does not know, e.g. meta)."""
    kind = device.type
    return torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """A block in which ``device``'s autocast is off, where it is on. For a backend's sums taken as matrix
    products (``bmm``, ``mv``): autocast runs those in bf16/fp16 -- fp32 statistics summed in bf16 were
    ~1e-2 off -- where torch's norms, whose own sums autocast leaves alone, keep their accumulation dtype."""
    if autocasting(device):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


_is_batched = torch._C._functorch.is_batchedtensor


def channels_last(x: Tensor) -> torch.memory_format | None:
    """channels_last / channels_last_3d when ``x`` is laid out so (and not also contiguous), else None:
    the layout torch's norms keep for their output."""
    if x.is_contiguous():
        return None
    if _is_batched(x):
        # inside torch.func.vmap a batched tensor's layout in any other format cannot be asked
        # (functorch raises "NYI: querying is_contiguous inside of vmap"): vmap over a non-batch
        # axis gives one that is not contiguous, which a BatchNorm(2d/3d) call asked it of. Its
        # logical layout is none: torch.nn's batching rules keep none either
        return None
    for fmt, nd in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if x.dim() == nd and x.is_contiguous(memory_format=fmt):
            return fmt
    return None


def _grouped(t: Tensor, scope: Resolved) -> Tensor:
    return t.reshape(scope.grouped_shape()) if scope.groups > 1 else t


def _ungrouped_stat(t: Tensor, scope: Resolved) -> Tensor:
    # (.., G, 1, ..) in grouped coordinates -> (.., G, ..) in input coordinates
    return t.squeeze(scope.group_dim + 1) if scope.groups > 1 else t


def moments(x: Tensor, scope: Resolved, mask: Tensor | None = None) -> Moments:
    """Mean and biased variance of every scope of ``x``.

    ``mask``, if given, is a bool tensor broadcastable to ``x``; only True elements count. A scope
    with no valid element gets mean 0, variance 0 and count 0 (see :func:`rstd`).
    """
    xf = _grouped(x.to(acc_dtype(x.dtype)), scope)
    dims = scope.grouped_reduce() if scope.groups > 1 else scope.reduce
    if not dims:
        # one element a scope (GroupNorm(C, C) on (N, C), keep= every axis): torch reads dim=()
        # as "reduce everything", so reduce over a new trailing axis of size 1 instead
        m = moments(x.unsqueeze(-1), _trailing_scope(scope), None if mask is None else mask.unsqueeze(-1))
        count = m.count.squeeze(-1) if isinstance(m.count, Tensor) else m.count
        return Moments(m.mean.squeeze(-1), m.var.squeeze(-1), count)
    if mask is None and xf.numel() == 0:
        # empty input: scopes (if any) are empty; mean 0, variance 0, as an all-masked scope below,
        # instead of var_mean's NaN and its degrees-of-freedom warning
        zeros = xf.new_zeros(xf.sum(dim=dims, keepdim=True).shape)
        return Moments(_ungrouped_stat(zeros, scope), _ungrouped_stat(zeros.clone(), scope), scope.count)
    if mask is None:
        if scope.centered:
            var, mean = torch.var_mean(xf, dim=dims, correction=0, keepdim=True)
        else:
            var = xf.square().mean(dim=dims, keepdim=True)
            mean = torch.zeros_like(var)
        count: int | Tensor = scope.count
    else:
        if scope.groups > 1:  # the grouped view needs the mask at full size
            m = _grouped(mask.expand(x.shape), scope).to(xf.dtype)
            count = m.sum(dim=dims, keepdim=True)
        else:
            # keep the mask at its broadcast shape ((N, 1, L) for BatchNorm1d): the products below
            # broadcast it, so no full-size float mask is materialized; a reduced axis the mask
            # broadcasts over multiplies the count instead
            m = mask.reshape((1,) * (x.dim() - mask.dim()) + tuple(mask.shape))
            count = m.sum(dim=dims, keepdim=True, dtype=xf.dtype)
            count = count * math.prod([x.shape[d] for d in dims if m.shape[d] == 1])  # list: dynamo
        # a fill, not a multiply by the mask: inf/NaN in the padding must not reach the sums
        # (0 * inf = NaN), neither forward nor backward. masked_fill, not torch.where: where lays its
        # output out from the mask first, so a batch's mask whose samples are not outermost in memory (a
        # transposed (B, S) mask, the fp32 copy of an expanded one) summed a sample in another order in
        # the batch than alone (scope isolation); masked_fill keeps xf's layout, the scope's own
        padding = ~(m.bool() if m.dtype != torch.bool else m)
        denom = count.clamp_min(1)
        if scope.centered:
            # corrected two-pass (Chan, Golub & LeVeque 1983): the first mean carries the fp32
            # rounding of a large sum; the mean of the deviations removes it from both moments
            mean = xf.masked_fill(padding, 0).sum(dim=dims, keepdim=True) / denom
            dev = (xf - mean).masked_fill(padding, 0)  # deviations of valid elements, 0 elsewhere
            # sum(dev) is identically 0 as a function of x (only its rounding is not), so the
            # correction carries no gradient of any order: detach it and save autograd the work
            shift = (dev.sum(dim=dims, keepdim=True) / denom).detach()
            mean = mean + shift
            # shift^2 <= mean(dev^2); clamped to the largest finite value, an overflowing scope (a huge
            # valid value: mean(dev^2) = inf) has variance inf, where inf - inf was NaN
            sq = (shift * shift).clamp_max(torch.finfo(shift.dtype).max)
            var = ((dev * dev).sum(dim=dims, keepdim=True) / denom - sq).clamp_min(0)
        else:
            xm = xf.masked_fill(padding, 0)
            var = (xm * xm).sum(dim=dims, keepdim=True) / denom
            mean = torch.zeros_like(var)
        count = _ungrouped_stat(count, scope)
        mean, var = _ungrouped_stat(mean, scope), _ungrouped_stat(var, scope)
        return Moments(mean, var, count.expand(mean.shape))
    return Moments(_ungrouped_stat(mean, scope), _ungrouped_stat(var, scope), count)


def _trailing_scope(scope: Resolved) -> Resolved:
    n = len(scope.shape)
    return Resolved(scope.shape + (1,), (n,), scope.centered, 1, -1, scope.affine)


def rstd(var: Tensor, eps: float, count: int | Tensor | None = None, constant_bias: bool = False) -> Tensor:
    """``1 / sqrt(var + eps)``; 0 where a scope has no valid element, so its output is the bias.

    ``constant_bias`` (see :func:`constant_gives_bias`): with ``eps == 0`` a scope of zero variance
    gets 0 too -- its output the bias, its gradients 0 -- where ``1 / sqrt(0)`` would give NaN."""
    if constant_bias and eps == 0:
        # rsqrt of 1 there, not of 0: the where passes the scope a zero gradient, and 0 times rsqrt's
        # infinite derivative at 0 would be NaN
        zero = var == 0
        r = torch.where(zero, 0, torch.rsqrt(torch.where(zero, 1, var)))
    else:
        r = torch.rsqrt(var + eps)
    if isinstance(count, int) and count == 0:
        return torch.zeros_like(r)
    if isinstance(count, Tensor):
        r = torch.where(count > 0, r, torch.zeros_like(r))
    return r


def constant_gives_bias(scope: Resolved, op: str | None, device: torch.device) -> bool:
    """Whether torch computes this scope's statistics with its CPU batch_norm kernel (BatchNorm,
    InstanceNorm; not a GroupNorm layer's call, ``op="group_norm"``), whose inverse standard
    deviation is 0 for a zero variance with ``eps == 0``: on a CPU ``instance_norm`` of a constant
    channel with ``eps=0`` gives the bias there, where ``layer_norm`` and ``group_norm`` give NaN.
    Not on other devices: torch's CUDA kernels (cuDNN's and its own) give NaN there too (measured on
    an H200, torch 2.11), and so does ``1 / sqrt(0)`` here."""
    f = scope.form
    return device.type == "cpu" and scope.centered and op != "group_norm" and (f.instance or f.channel is not None)


def _affine_view(p: Tensor, scope: Resolved) -> Tensor:
    # weight/bias cover scope.affine; give them singleton axes everywhere else
    shape = [scope.shape[d] if d in scope.affine else 1 for d in range(len(scope.shape))]
    return p.reshape(shape)


def apply(
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    scope: Resolved,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """``(x - mean) * rstd * weight + bias``, computed in the statistics' dtype, returned in x's.

    ``mean`` and ``rstd`` are shaped ``scope.stat_shape`` (one value per group on a grouped axis).

    ``mask`` (the one :func:`moments` took, True = valid): padding may hold anything. A padded
    position is normalized like any other, but one whose output is not finite -- a non-finite padded
    value (inf, NaN), or a finite one too large to normalize (``torch.finfo(dtype).max`` as a fill,
    whose ``(x - mean) * rstd`` overflows) -- is a constant: its output is the formula's (+-inf or
    NaN) and it passes no gradient to anything -- itself, the weight, the bias or the statistics.
    Without this every product it enters would turn a zero gradient into ``0 * inf = NaN`` in the
    backward (the weight's ``sum(dy * xhat)`` first), and the gradient of every valid input with it.
    Other padding is untouched: its outputs' gradients flow as they do for valid positions.
    """
    if mask is not None:
        xf = x.to(mean.dtype)
        with torch.no_grad():
            raw = apply(xf, mean, rstd, scope, weight, bias)
        bad = ~torch.isfinite(raw) & ~mask  # broadcasts: the mask may be (N, 1, L) for (N, C, L)
        # every output from finite values (0 at the bad positions: their cotangent is zeroed by the
        # where below, so 0 * finite = 0 exactly), then the bad positions' own values put back
        y = apply(torch.where(bad, 0, xf), mean, rstd, scope, weight, bias)
        return torch.where(bad, raw, y).to(x.dtype)
    xf = x.to(mean.dtype)
    if scope.groups == 1 and weight is not None and not set(scope.affine) & set(scope.reduce):
        # the weight varies only along kept axes (BatchNorm, InstanceNorm, LayerNorm2d): fold it
        # into rstd, a statistic-sized product, and finish in one addcmul -- two full-size ops
        # fewer, forward and backward. The mean is still subtracted first (large offsets).
        scale = rstd * _affine_view(weight, scope).to(rstd.dtype)
        centered = xf - mean if scope.centered else xf
        if bias is None:
            return (centered * scale).to(x.dtype)
        return torch.addcmul(_affine_view(bias, scope).to(scale.dtype), centered, scale).to(x.dtype)
    if scope.groups > 1:
        g = scope.group_dim + 1
        y = (_grouped(xf, scope) - mean.unsqueeze(g)) * rstd.unsqueeze(g)
        y = y.reshape(x.shape)
    else:
        y = (xf - mean) * rstd if scope.centered else xf * rstd
    if weight is not None:
        y = y * _affine_view(weight, scope).to(y.dtype)
    if bias is not None:
        y = y + _affine_view(bias, scope).to(y.dtype)
    return y.to(x.dtype)


#: the casting orders of the model families (see :func:`cast_affine`)
CASTINGS = ("torch", "gemma", "llama")


def cast_affine(
    y: Tensor,
    scope: Resolved,
    weight: Tensor | None,
    bias: Tensor | None,
    weight_offset: float,
    casting: str,
    dtype: torch.dtype,
) -> Tensor:
    """A model family's affine on ``y`` -- the input normalized, without affine, in the accumulation
    dtype (or already rounded to ``dtype`` for ``"llama"``) -- rounded to ``dtype`` where the family
    rounds. The one definition of the casting orders; the backends that run them give these bits.

    * ``"gemma"`` (Gemma, Gemma 2/3, OLMo 2): scale by ``weight + weight_offset`` formed in fp32 (a
      bf16 ``1 + w`` would round away any ``|w| < 2^-8``, Liger #1462), shift in fp32, round last:
      ``(x32 * rstd * (1 + w32)).to(x.dtype)``. ``"torch"`` with an offset is this too.
    * ``"llama"`` (Llama, Mistral, Qwen 2/3, diffusers): round the normalized value first, then scale
      in the weight's dtype (type promotion: an fp32 weight on bf16 input gives fp32):
      ``w * (x32 * rstd).to(x.dtype)``; with an offset the scale ``w32 + offset`` times the rounded
      value in fp32, rounded once to the promoted dtype. A bias is added after, in the same way.
    """
    if casting == "llama":
        y = y.to(dtype)
        if weight is not None:
            w = _affine_view(weight, scope)
            if weight_offset == 0.0:
                y = w * y
            else:
                acc = acc_dtype(dtype)
                y = ((w.to(acc) + weight_offset) * y.to(acc)).to(torch.promote_types(weight.dtype, dtype))
        return y if bias is None else y + _affine_view(bias, scope)
    if weight is not None:
        y = y * (_affine_view(weight, scope).to(y.dtype) + weight_offset)
    if bias is not None:
        y = y + _affine_view(bias, scope).to(y.dtype)
    return y.to(dtype)


def normalize(
    x: Tensor,
    scope: Resolved,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    mask: Tensor | None = None,
) -> Tensor:
    """The four steps, end to end."""
    m = moments(x, scope, mask)
    return apply(x, m.mean, rstd(m.var, eps, m.count), scope, weight, bias, mask)
