"""Fused Triton kernels and the ``"triton"`` engine backend.

Importing this package never fails: when Triton is installed it registers the ``"triton"``
backend with the engine (first in the automatic order; it declines, with a reason, whatever it
cannot run), and :data:`AVAILABLE` is True. Triton itself is imported only when a kernel is first
prepared, so ``import normscope`` stays cheap.

What exists (see ``docs/kernels.md``):

* :mod:`.rows` -- LayerNorm / RMSNorm over the last axes, forward and backward, with optional
  weight, ``(weight + offset)``, bias and fused residual add; any row length.
* :mod:`.groups` -- GroupNorm / InstanceNorm (and GroupNorm(1, C)) on (N, C, *), forward and
  backward, per-channel affine; contiguous and channels_last / channels_last_3d input each have
  kernels that read and write that memory in place.
* :func:`fused_add_rms_norm` -- ``(rms_norm(x + residual), x + residual)`` in one pass.

* :mod:`.channels` -- BatchNorm on any channel axis, training (two-stage deterministic
  reduction; the engine updates running statistics) and evaluation, forward and backward, with
  an optional per-position mask (masked BatchNorm1d on (B, S, D)).

Other masked scopes run on the reference.
"""

from __future__ import annotations

from .fused import fused_add_rms_norm, fused_add_rms_norm_ref, triton_available

#: Whether Triton is importable (the kernels can run on CUDA, or on CPU with TRITON_INTERPRET=1).
AVAILABLE: bool = triton_available()

if AVAILABLE:
    from .backend import register as _register

    _register()

__all__ = ["AVAILABLE", "fused_add_rms_norm", "fused_add_rms_norm_ref"]
