"""Fused residual add + RMSNorm, the pre-norm transformer block's ``h = x + r; y = rms_norm(h)``.

Unfused, PyTorch reads x and r, writes h, reads h again, writes y (5 passes over the activation);
the fused kernel reads x and r and writes h and y (4), and computes the statistics from registers.
The result is defined as *exactly* "add, then norm": ``h`` is rounded to its dtype before it is
normalized, so swapping the fused op in changes no bit of the residual stream.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from .. import _checks as check


def triton_available() -> bool:
    """Whether Triton can be imported (without importing it: ``import normscope`` stays cheap)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked installation counts as absent
        return False


_TRITON = triton_available()
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fused_add_rms_norm_ref(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
    residual_fp32: bool = False,
) -> tuple[Tensor, Tensor]:
    """The reference for :func:`fused_add_rms_norm` in plain PyTorch ops (any device, any dtype)."""
    dt = torch.float32 if residual_fp32 and residual.dtype != torch.float64 else residual.dtype
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = (x.to(acc) + residual.to(acc)).to(dt)
    hf = h.to(acc)
    y = hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.to(acc) + weight_offset)
    return y.to(x.dtype), h


def fused_add_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
    residual_fp32: bool = False,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Add a residual and apply RMSNorm in one pass; returns ``(normed, new_residual)``.

    .. math::
        h = x + r, \qquad y = \frac{h}{\sqrt{\mathrm{mean}(h^2) + \epsilon}} \cdot (w + \text{offset})

    RMSNorm: Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019. The fusion is
    the one of pre-norm transformer blocks (``residual = residual + sublayer(...)`` followed by the
    next block's norm).

    Args:
        x: the sublayer output, shape ``(*, N)``.
        residual: the residual stream, same shape as ``x``.
        weight: per-feature scale of shape ``(N,)``, or None. Default: ``None``
        eps: added to the mean square. Default: ``1e-6``
        weight_offset: the scale is ``weight + weight_offset`` (1.0 for Gemma's ``(1 + w)``). Default: ``0.0``
        residual_fp32: keep the new residual in fp32 (for bf16/fp16 models). Default: ``False``
        backend: ``"triton"`` (the kernel; CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"reference"``
            (plain PyTorch) or None for automatic: the kernel for CUDA tensors when Triton is installed.
            Default: ``None``

    Shape:
        - x, residual: ``(*, N)``; normed: like ``x``; new_residual: like ``residual`` (fp32 with
          ``residual_fp32``).

    Example::

        >>> x, r = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
        >>> y, h = fused_add_rms_norm(x, r, torch.ones(8))
        >>> torch.allclose(h, x + r)
        True
    """
    where = "fused_add_rms_norm"
    check.tensor(x, "x", where)
    check.tensor(residual, "residual", where)
    if residual.shape != x.shape:
        raise ValueError(
            f"{where}: expected `residual` of the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}"
        )
    if x.dim() == 0:
        raise ValueError(f"{where}: expected `x` with at least 1 dimension, got a 0-d tensor")
    if weight is not None:
        check.tensor(weight, "weight", where)
        if tuple(weight.shape) != (x.shape[-1],):
            raise ValueError(f"{where}: expected `weight` of shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if backend not in (None, "auto", "triton", "reference"):
        raise ValueError(f"{where}: expected `backend` in None, 'auto', 'triton', 'reference', got {backend!r}")
    kernel_ok = _TRITON and x.dtype in _KERNEL_DTYPES and residual.dtype in _KERNEL_DTYPES
    kernel_ok = kernel_ok and x.shape[-1] > 0 and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    if backend == "triton" and not kernel_ok:
        raise ValueError(
            f"{where}: backend 'triton' cannot run this call: it needs Triton installed, a float32/float16/"
            f"bfloat16 tensor on CUDA (or TRITON_INTERPRET=1 on CPU); got {x.dtype} on {x.device.type}, "
            f"triton installed: {_TRITON}"
        )
    if backend == "reference" or not kernel_ok or (backend in (None, "auto") and not x.is_cuda):
        return fused_add_rms_norm_ref(
            x, residual, weight, eps, weight_offset=weight_offset, residual_fp32=residual_fp32
        )
    from .rows import rows_norm

    y, h = rows_norm(
        x, weight, None, eps, False, residual=residual, weight_offset=weight_offset, residual_fp32=residual_fp32
    )
    return y, h
