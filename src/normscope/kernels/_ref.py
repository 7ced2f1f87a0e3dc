"""The kernels' references: each kernel family's contract in plain PyTorch ops, one function a family.

What this covers: the rows family (LayerNorm / RMSNorm over the last axis, with the fused residual
add, ``weight + weight_offset`` and its closed-form backward), the groups family (GroupNorm /
InstanceNorm on (N, C, *)), the channels family (BatchNorm on the (outer, C, inner) view, masked or
not) and the modern row kernels (modulated norm, PolyNorm, Derf). A row's statistics and affine are
spelled once (:func:`_rows_acc`) and the row families are that on their view: groups are rows of
``(N * G, C / G * HW)``, PolyNorm three uncentred rows, the modulated norm a row then its modulation;
the channels family reduces over (outer, inner) of each channel instead.
The numerics are the engine's (:mod:`normscope.reference`: two-pass variance, fp32 accumulation, fp64
for fp64 input), written again here because the kernels know nothing of scopes or of the engine
(tests/backends/test_backends.py holds that layering): the backends' tests compare the two.

These run where a kernel does not (a CPU tensor without ``TRITON_INTERPRET=1``, empty input), are
what a double backward differentiates, and are what the tests compare the kernels with. Limits:
they are written to be read, not to be fast; nothing here imports Triton, so they work without it.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "channels_fwd_ref",
    "derf_ref",
    "fused_add_rms_norm_ref",
    "groups_bwd_ref",
    "groups_fwd_ref",
    "group_norm_ref",
    "modulated_ref",
    "poly_ref",
    "res_dtype",
    "rows_bwd_ref",
    "rows_fwd_ref",
    "rows_ref",
]


def res_dtype(residual: Tensor, residual_fp32: bool) -> torch.dtype:
    """The dtype of the residual sum ``x + residual``: the residual's, or fp32 with ``residual_fp32``."""
    return torch.float32 if residual_fp32 and residual.dtype != torch.float64 else residual.dtype


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are accumulated in: fp64 for fp64, fp32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_acc(
    xf: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    centered: bool,
    weight_offset: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` of every row (last axis) of ``xf`` (already in the accumulation dtype),
    ``y`` not rounded: the biased variance about the mean (two passes, never E[x^2] - E[x]^2; RMS: the
    mean square), then the scale ``w + weight_offset`` and the bias in the same dtype."""
    if centered:
        mean = xf.mean(-1, keepdim=True)
        y = xf - mean
        var = y.square().mean(-1, keepdim=True)
    else:
        var = xf.square().mean(-1, keepdim=True)
        mean, y = torch.zeros_like(var), xf
    rstd = torch.rsqrt(var + eps)
    y = y * rstd
    if weight is not None:
        y = y * (weight.reshape(-1).to(y.dtype) + weight_offset)
    if bias is not None:
        y = y + bias.reshape(-1).to(y.dtype)
    return y, mean.squeeze(-1), rstd.squeeze(-1)


def rows_fwd_ref(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    eps: float = 1e-5,
    centered: bool = True,
    weight_offset: float = 0.0,
    residual_fp32: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """The rows kernel's forward: ``(y in x's dtype, s = x + residual or None, mean fp32, rstd fp32)``,
    statistics over the last axis. Differentiable in every tensor argument."""
    acc = acc_dtype(x.dtype)
    xf, s = x.to(acc), None
    if residual is not None:
        s = (xf + residual.to(acc)).to(res_dtype(residual, residual_fp32))
        xf = s.to(acc)  # normalize what "add, then norm" sees: the sum after its rounding
    y, mean, rstd = _rows_acc(xf, weight, bias, eps, centered, weight_offset)
    return y.to(x.dtype), s, mean.float(), rstd.float()


def rows_ref(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    centered: bool = True,
    residual: Tensor | None = None,
    weight_offset: float = 0.0,
    residual_fp32: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The reference for :func:`normscope.kernels.rows.rows_norm`: ``(y, s)`` (any device, any dtype;
    fp32 statistics, fp64 for fp64 input)."""
    return rows_fwd_ref(x, weight, bias, residual, eps, centered, weight_offset, residual_fp32)[:2]


def fused_add_rms_norm_ref(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
    residual_fp32: bool = False,
) -> tuple[Tensor, Tensor]:
    """The reference for :func:`normscope.functional.fused_add_rms_norm`: ``(y, h)``, ``h = x + residual``
    rounded to its dtype and ``y = rms_norm(h) * (weight + weight_offset)`` -- the rows reference with
    a residual, uncentred."""
    y, h = rows_ref(x, weight, None, eps, False, residual, weight_offset, residual_fp32)
    return y, h


def _rows_dx(g: Tensor, xhat: Tensor, rstd: Tensor, centered: bool) -> Tensor:
    """The closed-form input gradient of a row normalization (rows on the last axis, ``rstd`` (M, 1)):
    ``rstd * (g - xhat * mean(g * xhat) - mean(g))``, RMS without the last term; ``g = dy * w``."""
    n = g.shape[-1]
    dx = g - xhat * ((g * xhat).sum(-1, keepdim=True) / n)
    if centered:
        dx = dx - g.sum(-1, keepdim=True) / n
    return dx * rstd


def rows_bwd_ref(dy, dres, xs, weight, mean, rstd, centered, has_bias, weight_offset):
    """The rows kernel's backward in closed form: ``(dx, dW fp32, dB fp32)`` on the 2-D view ``xs``
    (the normalized input) with the saved ``mean``/``rstd``. Differentiable in every argument (the
    double backward evaluates it with grad enabled)."""
    acc = acc_dtype(xs.dtype)
    xf, dyf = xs.to(acc), dy.to(acc)
    rstd = rstd.to(acc)[:, None]
    xhat = (xf - mean.to(acc)[:, None]) * rstd
    g = dyf * (weight.to(acc) + weight_offset) if weight is not None else dyf
    dx = _rows_dx(g, xhat, rstd, centered)
    if dres is not None:
        dx = dx + dres.to(acc)
    return dx, (dyf * xhat).sum(0).float(), dyf.sum(0).float()


def _channel_view(x: Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _channel_affine(y: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    if weight is not None:
        y = y * weight.to(y.dtype).reshape(_channel_view(y))
    if bias is not None:
        y = y + bias.to(y.dtype).reshape(_channel_view(y))
    return y


def groups_fwd_ref(x, weight, bias, groups, eps, centered):
    """The groups kernel's forward: ``(y, mean, rstd)``, statistics per (sample, group) -- the rows
    reference on the ``(N * groups, C / groups * HW)`` view -- and the per-channel affine in fp32."""
    acc = acc_dtype(x.dtype)
    y, mean, rstd = _rows_acc(x.to(acc).reshape(x.shape[0] * groups, -1), None, None, eps, centered)
    y = _channel_affine(y.reshape(x.shape), weight, bias)
    return y.to(x.dtype), mean.float(), rstd.float()


def group_norm_ref(
    x: Tensor,
    groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    centered: bool = True,
) -> Tensor:
    """Plain-PyTorch GroupNorm over (N, C, *) (``centered=False``: the RMS variant), fp32 statistics."""
    return groups_fwd_ref(x, weight, bias, groups, eps, centered)[0]


def groups_bwd_ref(dy, x, weight, mean, rstd, groups, centered, has_bias):
    """The groups kernel's backward in closed form: ``(dx, dW fp32, dB fp32)`` -- the rows formula on
    each (sample, group), with ``g = dy * weight`` per channel."""
    acc = acc_dtype(x.dtype)
    rows = x.shape[0] * groups
    r = rstd.to(acc)[:, None]
    xhat = ((x.to(acc).reshape(rows, -1) - mean.to(acc)[:, None]) * r).reshape(x.shape)
    dyf = dy.to(acc)
    g = _channel_affine(dyf, weight, None)
    dx = _rows_dx(g.reshape(rows, -1), xhat.reshape(rows, -1), r, centered).reshape(x.shape)
    red = [0, *range(2, x.dim())]
    return dx, (dyf * xhat).sum(red).float(), dyf.sum(red).float()


def channels_fwd_ref(x3, weight, bias, mean_in, var_in, mask, eps):
    """The channels kernel's forward on a (outer, C, inner) ``x3``: ``(y, mean, rstd, biased var,
    count)``, batch statistics per channel over the positions ``mask`` ((outer, inner), nonzero =
    valid, or None) keeps, or the given ``mean_in``/``var_in`` (evaluation)."""
    acc = acc_dtype(x3.dtype)
    xf = x3.to(acc)
    count = torch.full((), float(x3.shape[0] * x3.shape[2]), dtype=torch.float32, device=x3.device)  # the fake's dtype
    if mean_in is not None:
        # copies, as the kernel's: a custom op's outputs never alias its inputs (fp32 buffers would)
        mean, var = mean_in.to(acc, copy=True), var_in.to(acc, copy=True)
    elif mask is None:
        var, mean = torch.var_mean(xf, dim=(0, 2), correction=0)
    else:
        m = mask.to(acc)[:, None, :]
        count = m.sum((0, 2))[0] if x3.shape[1] else m.sum()
        denom = count.clamp_min(1)
        valid = m != 0  # where, not a product with m: padding may hold inf or NaN
        mean = torch.where(valid, xf, 0).sum((0, 2)) / denom
        var = torch.where(valid, (xf - mean[:, None]).square(), 0).sum((0, 2)) / denom
    rstd = torch.rsqrt(var + eps)
    if mean_in is None:
        rstd = torch.where(count > 0, rstd, torch.zeros_like(rstd))  # no valid position: y = bias
    y = _channel_affine((xf - mean[:, None]) * rstd[:, None], weight, bias)
    return y.to(x3.dtype), mean.float(), rstd.float(), var.float(), count.float()


def modulated_ref(x, shift, scale, weight, bias, eps, centered, per_shift, per_scale):
    """The modulated (AdaLN) kernel's reference on its 2-D views: ``norm(x) * (1 + scale) + shift``,
    ``shift``/``scale`` one row per ``per_shift``/``per_scale`` rows of x, rounded once."""
    xf = x.to(acc_dtype(x.dtype))
    n = _rows_acc(xf, weight, bias, eps, centered)[0]
    if scale is not None:
        n = n * (1 + scale.to(n.dtype).repeat_interleave(per_scale, 0))
    if shift is not None:
        n = n + shift.to(n.dtype).repeat_interleave(per_shift, 0)
    return n.to(x.dtype)


def poly_ref(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """PolyNorm over the last axis: ``w0 rms(x^3) + w1 rms(x^2) + w2 rms(x) + b``, powers in fp32."""
    xf = x.to(acc_dtype(x.dtype))
    w = weight.to(xf.dtype)
    rms = lambda u: _rows_acc(u, None, None, eps, False)[0]  # noqa: E731
    return (w[0] * rms(xf**3) + w[1] * rms(xf**2) + w[2] * rms(xf) + bias.to(xf.dtype)).to(x.dtype)


def derf_ref(x: Tensor, alpha: Tensor, shift: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """Derf, element-wise: ``erf(alpha * x + shift)``, then ``* weight + bias`` over the last axis."""
    acc = acc_dtype(x.dtype)
    y = torch.erf(x.to(acc) * alpha.to(acc).reshape(()) + shift.to(acc).reshape(()))
    if weight is not None:
        y = y * weight.to(acc) + bias.to(acc)
    return y.to(x.dtype)
