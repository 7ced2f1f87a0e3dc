"""The ``"triton"`` engine backend: maps a call onto a kernel's canonical view, or says why not.

Automatic choice: CUDA tensors only. Forced (``use_backend("triton")`` or ``NORMSCOPE_BACKEND=
triton``) with ``TRITON_INTERPRET=1``, CPU tensors are accepted too and run in Triton's
interpreter -- that is how the kernels are tested without a GPU. (A per-call ``backend="triton"``
is not visible to this check, so on CPU use the context manager or the environment variable.)
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import Tensor

from .. import engine
from .. import reference as ref
from ..engine import Backend, Call

NAME = "triton"
#: Let the automatic order pick the (correct, not yet tuned) BatchNorm kernel over ATen/cuDNN.
#: Masked BatchNorm always takes the kernel: its only alternative is the unfused reference.
AUTO_BATCH_NORM = False
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _device_reason(x: Tensor) -> str | None:
    if x.device.type == "cuda":
        return None
    if x.device.type == "cpu" and _interpreting() and engine._requested(None) == NAME:
        return None
    return (
        f"the Triton kernels run on CUDA tensors, got a {x.device.type} tensor (on CPU they run only when "
        "forced with TRITON_INTERPRET=1)"
    )


def why_not(call: Call) -> str | None:
    """None when a kernel runs ``call``, else the reason it cannot."""
    reason = _device_reason(call.x)
    if reason is not None:
        return reason
    if call.x.dtype not in _DTYPES:
        return f"the kernels take float32/float16/bfloat16 input, got {call.x.dtype} (they accumulate in fp32)"
    s = call.scope
    if s.count == 0:
        return "scopes of zero elements"
    kind = _kind(s)
    if kind is None:
        return (
            "no kernel for this scope: kernels exist for the last axes with a per-element affine "
            "(LayerNorm/RMSNorm), for (N, C, *) groups with a per-channel affine (GroupNorm/InstanceNorm) "
            "and for per-channel statistics over every other axis (BatchNorm)"
        )
    if kind[0] == "channels" and call.mask is None and not AUTO_BATCH_NORM and engine._requested(None) != NAME:
        return (
            "unmasked BatchNorm stays on ATen/cuDNN in automatic mode until the channels kernel is tuned "
            "(force it with use_backend('triton') or NORMSCOPE_BACKEND=triton)"
        )
    if call.mask is not None and kind[0] != "channels":
        return "masked normalization has a kernel only for BatchNorm scopes (per-channel statistics)"
    if call.running is not None and kind[0] != "channels":
        return "running statistics have a kernel only for BatchNorm scopes"
    if call.running is not None and not call.running.use_input_stats:
        if call.running.mean is None or call.running.var is None:
            return "evaluation with running statistics needs running mean and var"
    return None


def _kind(s) -> tuple[str, int] | None:
    """("rows", 0), ("groups", G) or None: which canonical view a resolved scope maps onto."""
    ndim, k = len(s.shape), len(s.reduce)
    if s.groups == 1 and k and s.reduce == tuple(range(ndim - k, ndim)) and s.affine in ((), s.reduce):
        return "rows", 0
    if ndim >= 2 and s.groups == 1 and s.centered and len(s.reduce) == ndim - 1:
        (d,) = set(range(ndim)) - set(s.reduce)
        if s.affine in ((d,), ()):
            return "channels", d  # BatchNorm: statistics per index of axis d over every other axis
    if ndim >= 2 and s.affine in ((1,), ()):
        if s.reduce == tuple(range(1, ndim)) and (s.groups == 1 or s.group_dim == 1):
            return "groups", s.groups  # GroupNorm(G, C); G = 1: LayerNorm over (C, *), per-channel affine
        if ndim >= 3 and s.groups == 1 and s.reduce == tuple(range(2, ndim)):
            return "groups", s.shape[1]  # InstanceNorm: one group per channel
    return None


def prepare(call: Call) -> Callable[[Call], Tensor]:
    kind, groups = _kind(call.scope)
    centered = call.scope.centered
    if kind == "channels":
        from . import channels as chn

        d = groups

        def run_channels(c: Call) -> Tensor:
            r = c.running
            if r is not None and not r.use_input_stats:
                return chn.batch_norm_channels(c.x, d, c.weight, c.bias, c.eps, r.mean, r.var)[0]
            pos_mask = None
            if c.mask is not None:
                pos_mask = engine.position_mask(c.mask, c.x, d)
                if pos_mask is None:  # the mask varies along the channel axis: no kernel for that
                    return engine._recompute(c)  # runs the reference and says so in last_backend()
                pos_mask = pos_mask.contiguous()  # the kernel reads one flag per position from memory
            y, mean, var, count = chn.batch_norm_channels(c.x, d, c.weight, c.bias, c.eps, mask=pos_mask)
            if r is not None:  # the engine's own update rule (unbiased variance, momentum)
                shape = c.scope.stat_shape
                n = count if pos_mask is not None else c.scope.count
                engine._update_running(c, ref.Moments(mean.reshape(shape), var.reshape(shape), n))
            return y

        return run_channels
    if kind == "groups":
        from . import groups as grp  # imports Triton (reads TRITON_INTERPRET) on first use

        def run_groups(c: Call) -> Tensor:
            return grp.group_norm(c.x, groups, c.weight, c.bias, c.eps, centered)

        return run_groups
    from . import rows

    n = call.scope.count

    def run(c: Call) -> Tensor:
        return rows.rows_norm(c.x, c.weight, c.bias, c.eps, centered, n=n)[0]

    return run


def register() -> None:
    """Put the Triton backend first in the engine's automatic order."""
    engine.register_backend(Backend(NAME, why_not, prepare), auto_first=True)
