"""Fused Triton kernels: the canonical views they read, their launches and their plain-PyTorch references.

The kernels know nothing of scopes or of the engine: the ``"triton"`` backend
(:mod:`normscope.backends.triton`) maps a call onto one of these views, enforces their contract
(strides, dtypes, devices) and is the only way in. Triton itself is imported only when a kernel is
first used, so ``import normscope`` stays cheap and works without Triton.

What exists (see ``docs/kernels.md``):

* :mod:`.rows` -- LayerNorm / RMSNorm over the last axes, forward and backward, with optional
  weight, ``(weight + offset)``, bias and fused residual add; any row length.
* :mod:`.groups` -- GroupNorm / InstanceNorm (and GroupNorm(1, C)) on (N, C, *), forward and
  backward, per-channel affine; contiguous and channels_last / channels_last_3d input each have
  kernels that read and write that memory in place.
* :mod:`.channels` -- BatchNorm on any channel axis, training (two-stage deterministic
  reduction; the engine updates running statistics) and evaluation, forward and backward, with
  an optional per-position mask (masked BatchNorm1d on (B, S, D)).
* :mod:`.modern` -- the modern norms over rows: the modulated (AdaLN) norm, q + k norm in one
  launch, PolyNorm, Derf.
* :mod:`.fused` -- the reference of the fused residual add + RMSNorm
  (:func:`normscope.functional.fused_add_rms_norm` is the op).
* Candidates beside the default kernels, unmeasured and off unless a measured-choice row, a pin in
  :mod:`.config` or :func:`.variants.use_variant` names them (:mod:`.variants` says which variant of a
  family runs): :mod:`.rows_once` -- rows past the single block read once (one program per row, or split
  over programs that meet on their partial sums); :mod:`.channels_split` -- BatchNorm as a per-channel
  split reduction; :mod:`.groups_onchip` -- GroupNorm / InstanceNorm with the whole group on chip.

Private to the package: :mod:`._common` (what every family shares: launch arithmetic, Chan's
combination), :mod:`._rowbody` (the body of a block of rows, the rows and modern kernels' one
spelling), :mod:`._ref` (every family's plain-PyTorch reference, importable without Triton) and
:mod:`._eager` (the eager autograd path).
"""

from __future__ import annotations

from .fused import fused_add_rms_norm_ref, triton_available

#: Whether Triton is importable (the kernels can run on CUDA, or on CPU with TRITON_INTERPRET=1).
AVAILABLE: bool = triton_available()

__all__ = ["AVAILABLE", "fused_add_rms_norm_ref"]
