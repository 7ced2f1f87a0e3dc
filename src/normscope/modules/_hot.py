"""The layers' hot path: argument checks, scope resolution and planning once per input signature.

A layer's forward is the same Python work on every call with the same input shape, dtype and
device: the functional API checks the arguments, the scope is resolved on the shape, the engine
looks up the backend's runner. None of that changes between such calls, and at small shapes it
cost several times the ATen op itself (``benchmarks/cpu_overhead.py``). So the first call of a
signature goes the checked way (:mod:`normscope.functional`) and the layer remembers what it
resolved (:func:`normscope.engine.remember_layer_plan`); later calls with the same :func:`key` run
the runner directly.

The key holds everything the checks, the resolution and the plan read: the layer's configuration,
the input's shape, dtype and device, each parameter's (and buffer's) shape, dtype and device, and
the requested backend (``backend=`` / ``use_backend`` / ``NORMSCOPE_BACKEND``, read per call), so a
call that the checks would reject never matches a remembered key. Masked calls, non-tensor input
and tracing (torch.compile) always take the checked path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import engine


def _sig(t: Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.dtype, t.device)


def key(config: tuple, x: object, *tensors: Tensor | None) -> tuple | None:
    """The hot-path key of a call, or None when the call must take the checked path."""
    if not isinstance(x, Tensor) or torch.compiler.is_compiling():
        return None
    return (config, x.shape, x.dtype, x.device, engine.requested_backend(), *map(_sig, tensors))


def get(k: tuple | None) -> tuple | None:
    """``(resolved scope, plan)`` remembered for key ``k``, or None."""
    if k is None:
        return None
    try:
        return engine.layer_plan(k)
    except TypeError:  # unhashable (symbolic sizes): the checked path
        return None


def remember(k: tuple | None, call: engine.Call) -> None:
    """After a checked call has run: remember its resolved scope and plan under ``k``."""
    if k is not None:
        engine.remember_layer_plan(k, call)
