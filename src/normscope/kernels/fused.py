"""Fused residual add + RMSNorm, the pre-norm transformer block's ``h = x + r; y = rms_norm(h)``: its reference.

Unfused, PyTorch reads x and r, writes h, reads h again, writes y (5 passes over the activation);
the fused kernel reads x and r and writes h and y (4), and computes the statistics from registers.
The result is defined as *exactly* "add, then norm": ``h`` is rounded to its dtype before it is
normalized, so swapping the fused op in changes no bit of the residual stream.

The public op is :func:`normscope.functional.fused_add_rms_norm` (it goes through the engine, so
it obeys a forced backend and reports ``last_backend()``); the kernel is :func:`.rows.rows_norm`
with a residual, reached through the ``"triton"`` backend. This module holds the plain-PyTorch
reference beside them.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor


def triton_available() -> bool:
    """Whether Triton can be imported (without importing it: ``import normscope`` stays cheap)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked installation counts as absent
        return False


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
