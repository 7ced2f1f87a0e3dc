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
from ..engine import Backend, Call

NAME = "triton"
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
    if call.mask is not None:
        return "masked normalization has no kernel yet"
    if call.running is not None:
        return "running statistics (BatchNorm) have no kernel yet"
    s = call.scope
    ndim, k = len(s.shape), len(s.reduce)
    if s.groups != 1 or k == 0 or s.reduce != tuple(range(ndim - k, ndim)):
        return "only scopes over the last axes (LayerNorm/RMSNorm rows) have a kernel yet"
    if s.affine not in ((), s.reduce):
        return "the affine must span the reduced axes (per-element weight and bias)"
    if s.count == 0:
        return "rows of zero elements"
    return None


def prepare(call: Call) -> Callable[[Call], Tensor]:
    from . import rows  # imports Triton (reads TRITON_INTERPRET) on first use

    centered, n = call.scope.centered, call.scope.count

    def run(c: Call) -> Tensor:
        return rows.rows_norm(c.x, c.weight, c.bias, c.eps, centered, n=n)[0]

    return run


def register() -> None:
    """Put the Triton backend first in the engine's automatic order."""
    engine.register_backend(Backend(NAME, why_not, prepare), auto_first=True)
