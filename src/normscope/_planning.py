"""Planning a call while dynamo traces it.

Under ``torch.compile`` the choice of backend is made once, eagerly, on a stand-in of the call's
signature (:func:`choice_for_trace`), so that dynamo traces -- and guards on -- only the chosen
backend's ``prepare`` and runner, not every ``why_not`` of the automatic order: each function dynamo
inlines is guarded on every call of the compiled graph (measured, a compiled LayerNorm cost ~20 us a
call more than torch.nn's, most of it the planning's guards). Symbolic sizes (dynamic shapes) have no
constant signature: then the choice is traced.

Depends on :mod:`normscope._contract`, :mod:`normscope._state` and :mod:`normscope._registry`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import _registry
from ._contract import Call, Runner, Running
from ._registry import MAX_PLANS, PLAN_TABLES, choose, prepare, validate
from ._state import as_traced, compiling, constant_when_compiled
from .scope import Resolved

__all__ = ["traced_plan", "static_signature", "choice_for_trace", "symbolic", "stand_in"]


def traced_plan(call: Call, name: str) -> tuple[str, Runner]:
    """:func:`normscope._registry.plan_call` while dynamo traces: the choice made on a stand-in of
    the call's signature (:func:`choice_for_trace`), or traced for symbolic sizes."""
    validate(call)
    sig = static_signature(call)
    chosen = None if sig is None else choice_for_trace(sig, name)
    if chosen is None:  # symbolic sizes, or no backend runs the call: choose() traced, raising its ValueError
        # as an eager call does -- raised inside choice_for_trace, which dynamo runs as a constant, it
        # reached the caller wrapped in dynamo's InternalTorchDynamoError
        chosen = choose(call, name)
    return prepare(chosen, call, name == "auto")


def static_signature(call: Call) -> tuple | None:
    """Everything ``why_not`` may read (see :class:`~normscope.engine.Backend`) as Python constants,
    or None when a size is symbolic."""
    x, s, r, res = call.x, call.scope, call.running, call.residual
    tensors = (x, call.weight, call.bias, call.mask, res, *((r.mean, r.var) if r is not None else ()))
    for t in tensors:
        if t is not None and symbolic(t.shape):
            return None
    if symbolic(s.shape):
        return None
    if isinstance(call.weight_offset, (int, float)) and symbolic((call.weight_offset,)):
        return None  # a symbolic float (automatic dynamic: an offset that changed between calls), not a constant

    def meta(t: Tensor | None) -> tuple | None:
        return None if t is None else (tuple(t.shape), t.dtype)

    return (
        (tuple(s.shape), s.reduce, s.centered, s.groups, s.group_dim, s.affine),
        tuple(x.shape),
        x.dtype,
        str(x.device),
        meta(call.weight),
        meta(call.bias),
        meta(call.mask),
        None if r is None else (r.use_input_stats, meta(r.mean), meta(r.var)),
        meta(res),
        call.residual_fp32,
        call.weight_offset,
        call.op,
        call.casting,
    )


def symbolic(shape: Sequence) -> bool:
    """Whether a size of ``shape`` is symbolic (a SymInt: dynamic shapes, torch.export) -- or a number of
    it, the same question of an eps or a setting (a SymFloat: a float dynamo made dynamic).

    While dynamo traces, ``isinstance(n, torch.SymInt)`` and ``type(n) is int`` both answer as for
    an int, so there torch's ``has_static_value`` is asked (dynamo answers it for the traced size,
    without a guard); a torch without it (< 2.6) is answered "symbolic", the safe side."""
    if not compiling():
        return any(isinstance(n, (torch.SymInt, torch.SymFloat)) for n in shape)
    # imported here, not at import time: it loads torch._dynamo (~0.7 s), which dynamo, tracing
    # this, has loaded already
    from torch.fx.experimental import symbolic_shapes

    has_static_value = getattr(symbolic_shapes, "has_static_value", None)
    return has_static_value is None or not all(has_static_value(n) for n in shape)


def stand_in(shape: tuple, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A stride-0 view of one element with this shape, dtype and device: all that the checks, the
    scope's resolution and the choice of backend read of a tensor (plans do not depend on strides)."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)


_TRACE_CHOICES: dict[tuple, str] = {}
PLAN_TABLES.append(_TRACE_CHOICES.clear)


@constant_when_compiled
def choice_for_trace(sig: tuple, name: str) -> str | None:
    """:func:`normscope._registry.choose` on a stand-in of signature ``sig`` (stride-0 views of one
    element, of the call's shapes, dtypes and device), memoized: dynamo runs it once, eagerly, and
    bakes the name in."""
    key = (sig, name, _registry.GENERATION)
    found = _TRACE_CHOICES.get(key)
    if found is None:
        (shape, reduce, centered, groups, group_dim, affine), x_shape, dtype, device = sig[:4]
        weight, bias, mask, running, residual, residual_fp32, offset, op, casting = sig[4:]

        def meta_in(m: tuple | None) -> Tensor | None:
            return None if m is None else stand_in(m[0], m[1], device)

        run = None
        if running is not None:
            run = Running(meta_in(running[1]), meta_in(running[2]), 0.1, running[0])
        call = Call(
            meta_in((x_shape, dtype)),
            Resolved(shape, reduce, centered, groups, group_dim, affine),
            meta_in(weight),
            meta_in(bias),
            1e-5,
            meta_in(mask),
            run,
            meta_in(residual),
            offset,
            residual_fp32,
            op,
            casting,
        )
        with as_traced():
            try:
                found = choose(call, name)
            except ValueError:  # no backend takes it: traced_plan traces choose(), which raises it
                return None
        if len(_TRACE_CHOICES) >= MAX_PLANS:
            _TRACE_CHOICES.clear()
        _TRACE_CHOICES[key] = found
    return found
