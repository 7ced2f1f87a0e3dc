"""Fused residual add + RMSNorm, the pre-norm transformer block's ``h = x + r; y = rms_norm(h)``: its reference.

Unfused, PyTorch reads x and r, writes h, reads h again, writes y (5 passes over the activation);
the fused kernel reads x and r and writes h and y (4), and computes the statistics from registers.
The result is defined as *exactly* "add, then norm": ``h`` is rounded to its dtype before it is
normalized, so swapping the fused op in changes no bit of the residual stream.

The public op is :func:`normscope.functional.fused_add_rms_norm` (it goes through the engine, so
it obeys a forced backend and reports ``last_backend()``); the kernel is :func:`.rows.rows_norm`
with a residual, reached through the ``"triton"`` backend. Its reference is the rows family's
(:func:`normscope.kernels._ref.fused_add_rms_norm_ref`, named here too); this module also says
whether Triton is importable. Limits: none of its own -- it imports neither Triton nor a kernel.
"""

from __future__ import annotations

import importlib.util

from ._ref import fused_add_rms_norm_ref

__all__ = ["fused_add_rms_norm_ref", "triton_available"]


def triton_available() -> bool:
    """Whether Triton can be imported (without importing it: ``import normscope`` stays cheap)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked installation counts as absent
        return False
