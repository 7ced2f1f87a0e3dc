"""The engine: one entry point that normalizes over a scope, and the contract its backends keep.

``norm(x, scope, ...)`` resolves the scope on ``x``'s shape and hands a :class:`Call` to a
backend. The engine knows the contract -- :class:`Backend`: ``why_not`` (can it run this call
exactly?), ``why_not_auto`` (should the automatic order pick it?) and ``prepare`` (the function
that runs it) -- not the backends themselves: they live in :mod:`normscope.backends`, which names
them and their automatic order in one place and registers them here.

This module is the engine's public face; its parts, each depending only on those before it:

==========================  ==========================================================================
:mod:`normscope._contract`  the contract types: :class:`Call`, :class:`Running`, :class:`Backend`
:mod:`normscope._state`     what a call reads besides its arguments (per thread), questions about tracing
:mod:`normscope._registry`  the registered backends, the automatic choice, the plan of one call
:mod:`normscope._planning`  the choice made once, eagerly, for a call dynamo traces
:mod:`normscope._capture`   what the hot path (:mod:`normscope.hot`) learns from a checked call
this module                 the entry points (:func:`norm`, :func:`add_norm`, ...), the plan cache
                            and the dispatch, and what backends and layers share
==========================  ==========================================================================

Per call the first backend of the automatic order that can run it, and agrees to be picked,
runs. A user can force one: the ``backend=`` argument, else :func:`use_backend` (a context
manager), else the ``NORMSCOPE_BACKEND`` environment variable. A forced backend that cannot run a
call raises ValueError saying why -- it never silently falls back. :func:`last_backend` says
which one ran.

Running statistics live here too, between the two steps: with ``running=Running(...)`` the batch
statistics update the running estimates (``use_input_stats=True``) or the running estimates
replace them (``False``). :func:`update_running` is the one update rule every backend and layer
uses.

:func:`add_norm` is the fused residual form ``h = x + residual; y = norm(h)``: a backend that
fuses the add (``Backend.fuses_residual``) gets the whole call; for any other the engine adds,
then runs the plain call on the same backend.

**Scope isolation.** A scope's statistics come from its elements and nothing else, and so do its
bits: for one scope the algorithm, its blocking and its reduction order depend only on that scope's
own extent, dtype, device and layout -- never on how many scopes the call holds, on their
neighbours, or on values outside the scope (padding included). An automatic choice between two
paths is made on the scope's extent (a row's length), or the two paths give the same bits per
scope; kernels pack and split per scope. Per-sample norms are then batch-invariant on every
backend, as torch.nn is on CPU. Weight gradients (a sum over scopes) are deterministic run to run.
BatchNorm's scope spans the batch by definition: there the rule is about the channel. See
``docs/guarantees.md`` for the tests that hold each promise.

**Per-thread state.** Whatever a call reads besides its arguments -- the forced backend
(:func:`use_backend`), what ran last (:func:`last_backend`), what the planner captures while a call
is traced (:func:`capture`, :func:`record`) -- lives in :mod:`contextvars` (:mod:`normscope._state`): per thread, as
torch's grad mode and autocast state are, and per asyncio task too (torch's are not: a task's
``torch.no_grad()`` open across an ``await`` holds for the tasks that run meanwhile). A new
``threading.Thread`` -- a pool's worker too -- starts with no block open, as it starts with grad mode
on, whatever blocks its creator had open; ``asyncio.to_thread`` and ``contextvars.copy_context().run``
carry the caller's context, so the forced backend follows there (torch's grad mode does not).
A ``with use_backend(...)`` in one thread never changes another's calls, and leaving it restores only
its own thread's choice; a ``torch.compile`` in one thread plans on stand-ins in that thread and
never captures or reroutes an eager call of another (:func:`compiling` asks about this thread;
torch's own ``torch.compiler.is_compiling()`` answers for the process). The caches shared between threads --
the plans by signature here and in :mod:`normscope.hot`, the traced plans -- hold values that
depend only on their key and are never mutated once stored, so a read and a concurrent write of
one dict (each one atomic in CPython) see either the old table or the new one, both right; the
one publication that takes two steps (a traced plan and the token naming it) holds a lock.

**Activation checkpointing** (``torch.utils.checkpoint``) recomputes a segment's forward during the
backward, under the state the backward runs in: it restores autocast, not this. A forward inside
``use_backend(name)`` whose backward runs outside the block recomputes on another backend -- the
non-reentrant checkpoint then raises its CheckpointError (other tensors saved), the reentrant one
differentiates the other backend's forward. Run the backward inside the block, or pass
``context_fn=lambda: (contextlib.nullcontext(), normscope.use_backend(name))`` to the checkpoint.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _capture, _planning, _registry, _state
from . import reference as ref
from ._capture import capture, decline_record, record, recorded
from ._contract import ENV_VAR, Backend, Call, LayerEntry, Runner, Running, call_of  # noqa: F401  (the facade)
from ._planning import stand_in, symbolic  # noqa: F401  (the facade)
from ._registry import (
    backends,
    register_backend,
    requested_backend,
    signature,
    use_backend,
)
from ._state import (
    compiling,
    constant_when_compiled,
    last_backend,
    report_backend,
    request_key,
    tracing,
    transformed,
    transformed_eagerly,
)
from .scope import Resolved, Scope

__all__ = [
    "Running",
    "Call",
    "call_of",
    "LayerEntry",
    "Backend",
    "norm",
    "add_norm",
    "stats",
    "apply",
    "register_backend",
    "backends",
    "use_backend",
    "last_backend",
    "report_backend",
    "requested_backend",
    "request_key",
    "constant_when_compiled",
    "update_running",
    "running_as_stats",
    "recompute",
    "tracing",
    "compiling",
    "transformed",
    "transformed_eagerly",
    "position_mask",
    "plan",
    "run",
    "layer_entry",
    "record",
    "recorded",
    "decline_record",
    "capture",
    "stand_in",
]

# Names of this module for what the dispatch reads of the parts: dynamo, tracing a call, guards on
# every module object it reads an attribute of, on every call of the compiled graph
_PLANS, _BACKENDS, _MAX_PLANS = _registry.PLANS, _registry.BACKENDS, _registry.MAX_PLANS
_plan, _traced_plan = _registry.plan_call, _planning.traced_plan
_CAPTURED_GET, _RECORDS_GET = _capture.CAPTURED.get, _capture.RECORDS.get


# ----------------------------------------------------------------------------------------------
# what backends and layers share: running statistics, recomputation, masks


def update_running(call: Call, m: ref.Moments) -> None:
    """Fold one batch's moments into ``call.running`` (momentum, unbiased variance), in place.

    Statistics may be finer than the buffers (InstanceNorm: one per sample and channel); the
    buffers then take their average over the extra kept axes, as torch's instance_norm does.
    The update is done in fp32 (fp64 for fp64 buffers) and rounded once into the buffers' dtype,
    as torch's kernels do for half-precision buffers."""
    run, s = call.running, call.scope
    if run.mean is None or run.var is None or run.momentum == 0.0:
        return
    extra = tuple(d for d in range(len(s.shape)) if d not in s.reduce and d not in s.affine)
    count = m.count
    if isinstance(count, int) and count == 0:  # empty batch: no statistics (NaN), and torch leaves the buffers
        return
    with torch.no_grad():
        mean, var = m.mean.detach(), m.var.detach()
        if isinstance(count, Tensor):
            n = count.detach()
            unbiased = var * n / (n - 1).clamp_min(1)
        else:
            unbiased = var * (count / (count - 1)) if count > 1 else var
        if extra:
            mean, unbiased = mean.mean(extra, keepdim=True), unbiased.mean(extra, keepdim=True)
        f = run.momentum
        # inside a torch.func grad transform (grad, vjp, jvp, jacrev, hessian) an in-place op on a buffer
        # the transform captured raises ("would mutate a captured Tensor"); written through an alias of
        # it -- a tensor of the transform's level, the buffer's memory -- it updates the buffer, as
        # torch's instance_norm writes its running statistics (``at::alias(running_mean).copy_``)
        alias = transformed()
        for buf, new in ((run.mean, mean), (run.var, unbiased)):
            acc = ref.acc_dtype(buf.dtype)
            upd = buf.to(acc) * (1 - f) + new.reshape(buf.shape).to(acc) * f
            (torch.ops.aten.alias(buf) if alias else buf).copy_(upd)


def running_as_stats(call: Call) -> tuple[Tensor, Tensor]:
    """``(mean, rstd)`` from the running buffers, shaped to broadcast against ``call.x``."""
    s, run = call.scope, call.running
    shape = [s.shape[d] if d in s.affine else 1 for d in range(len(s.shape))]
    dt = ref.acc_dtype(call.x.dtype)
    mean = run.mean.to(dt).reshape(shape)
    return mean, ref.rstd(run.var.to(dt).reshape(shape), call.eps)


def recompute(call: Call, wide: bool = False) -> Tensor:
    """Run ``call`` on the reference from inside another backend's runner, and say so in
    :func:`last_backend` (a fast path that finds, at run time, that it cannot be exact).

    ``wide``: run the reference in float64 and return the input's dtype (the gradient too, through
    the casts). For the rare call the fast paths find cancelling (``|mean| * rstd`` past 1024,
    :mod:`normscope.backends.aten`): there fp32 sums lose what float64 keeps -- measured, the output
    of mean 1e4, std 1e-2 fp32 input went from ~4e-2 off the float64 result to rounding."""
    report_backend("reference")
    run = _registry.backend_runner("reference", call, False)  # an add_norm call: the add, then the norm
    if not wide or call.x.dtype == torch.float64:
        return run(call)

    def up(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(torch.float64)

    y = run(call._replace(x=up(call.x), weight=up(call.weight), bias=up(call.bias)))
    return y.to(call.x.dtype)


def position_mask(mask: Tensor, x: Tensor, d: int) -> Tensor | None:
    """A mask as one flag per position -- a view with x's shape without axis ``d`` -- or None when it
    varies along ``d`` (no per-position form: backends that need one leave the call to the reference)."""
    k = d - (x.dim() - mask.dim())  # the mask's axis that broadcasts against x's axis d
    if k >= 0 and mask.shape[k] != 1:
        return None
    return torch.broadcast_to(mask, x.shape).select(d, 0)


# ----------------------------------------------------------------------------------------------
# plan and dispatch


def plan(call: Call, backend: str | None = None) -> tuple[str, Runner]:
    """``(name, runner)``: the backend that :func:`dispatch` runs ``call`` on and its runner, from
    the plan cache (planned afresh, uncached, while tracing or for symbolic sizes). A runner serves
    every call with the same :func:`signature`; the hot path keeps it per call signature (:mod:`normscope.hot`)."""
    requested = requested_backend(backend)
    if compiling():
        # under dynamo the planning is traced once per graph anyway; storing it in PLANS would be
        # a side effect on a dict keyed by trace-time objects (Resolved) that dynamo cannot replay,
        # which breaks torch.compile(fullgraph=True)
        return _traced_plan(call, requested)
    key = (signature(call), requested, _registry.GENERATION)  # the generation: see _registry.GENERATION
    try:
        found = _PLANS.get(key)
    except TypeError:
        # symbolic sizes (torch.export / torch.compile with dynamic dims, e.g. ONNX export with a
        # dynamic batch) are unhashable: choose afresh, uncached -- this runs once, at trace time
        return _plan(call, requested)
    if found is None:
        found = _plan(call, requested)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = found
    return found


def run(planned: tuple[str, Runner], call: Call):
    """Run ``call`` with a plan from :func:`plan` (and say so in :func:`last_backend`)."""
    report_backend(planned[0])
    return planned[1](call)


def layer_entry(call: Call, planned: tuple[str, Runner]) -> LayerEntry:
    """How a layer's hot path runs ``planned`` on calls that differ from ``call`` only in ``x``,
    ``weight``, ``bias``, ``eps`` and ``running`` (the layer's remembered signature fixes the rest):
    the runner's own ``layer_entry`` where its backend writes its runners in that form (aten: a
    small layer's call then builds no :class:`Call`, ~1 us of ~15 for LayerNorm(64) on CPU,
    ``benchmarks/cpu_overhead.py``), else the runner on a Call with the planned call's other fields."""
    runner = planned[1]
    entry = getattr(runner, "layer_entry", None)
    if entry is not None:
        return entry
    s, mask, residual, op = call.scope, call.mask, call.residual, call.op
    offset, fp32, casting = call.weight_offset, call.residual_fp32, call.casting

    def run(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Tensor:
        return runner(call_of((x, s, w, b, eps, mask, r, residual, offset, fp32, op, casting)))

    return run


def dispatch(call: Call, backend: str | None = None):
    """Run ``call`` on the requested backend, or on the first automatic one that takes it."""
    if compiling():  # traced: no state of this thread's eager calls applies (nor can be read)
        return run(plan(call, backend), call)
    captured = _CAPTURED_GET()
    if captured is not None:  # planning a traced call on stand-ins (normscope.hot): plan it, run nothing
        captured.append((call, _plan(call, requested_backend(backend))))
        return call.x
    planned = plan(call, backend)
    stack = _RECORDS_GET()
    if stack:  # a call the hot path is checking: what it dispatched (once; twice is not a plan)
        slot = stack[-1]
        slot[0] = (call, planned) if slot[0] is None else False
        start = slot[1]
        if start is not None:  # the call is checked and about to run: the caller's side effect
            slot[1] = None
            start()
    return run(planned, call)


def norm(
    x: Tensor,
    scope: Scope | Resolved,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    mask: Tensor | None = None,
    running: Running | None = None,
    backend: str | None = None,
    op: str | None = None,
    weight_offset: float = 0.0,
    casting: str = "torch",
) -> Tensor:
    """Normalize ``x`` over ``scope``: the one engine behind every layer.

    Layers and :func:`normscope.normalize` check their arguments first, with messages in their
    own terms; the engine checks once per call signature (shape, dtype, which tensors are given)
    that weight, bias and running statistics fit the scope, so a wrong size raises ValueError
    instead of reaching a kernel. ``op``, ``weight_offset``, ``casting``: see :class:`Call`.
    """
    resolved = scope if isinstance(scope, Resolved) else scope.resolve(x.shape)
    call = Call(x, resolved, weight, bias, eps, mask, running, None, weight_offset, False, op, casting)
    return dispatch(call, backend)


def add_norm(
    x: Tensor,
    residual: Tensor,
    scope: Scope | Resolved,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    weight_offset: float = 0.0,
    residual_fp32: bool = False,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(norm(h), h)`` with ``h = x + residual`` rounded to the residual's dtype (fp32 with
    ``residual_fp32``) and the scale ``weight + weight_offset``: the pre-norm block's add and norm,
    on the backend :func:`norm` would pick (one fused pass where a backend fuses it). Inputs are
    assumed valid (:func:`normscope.functional.fused_add_rms_norm` checks them)."""
    resolved = scope if isinstance(scope, Resolved) else scope.resolve(x.shape)
    call = Call(x, resolved, weight, bias, eps, None, None, residual, float(weight_offset), bool(residual_fp32))
    return dispatch(call, backend)


def stats(x: Tensor, scope: Scope | Resolved, mask: Tensor | None = None, eps: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(mean, rstd)`` of every scope of ``x`` in fp32 (fp64 for fp64 input), shaped to broadcast
    against ``x`` (one value per group on a grouped axis)."""
    resolved = scope if isinstance(scope, Resolved) else scope.resolve(tuple(x.shape))
    m = ref.moments(x, resolved, mask)
    return m.mean, ref.rstd(m.var, eps, m.count)


def apply(
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    scope: Scope | Resolved,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Normalize ``x`` with given statistics and apply the affine (the second pure step); ``mask``:
    the valid elements, as :func:`normscope.reference.apply` takes it (a non-finite padded value is
    normalized but passes no gradient)."""
    resolved = scope if isinstance(scope, Resolved) else scope.resolve(tuple(x.shape))
    return ref.apply(x, mean, rstd, resolved, weight, bias, mask)


# The parts' own names under this module's: tests set and read the per-thread state and the
# registry through ``engine._FORCED``, ``engine._BACKENDS``, ``engine._choose``... (no module of the
# package reads them here: each imports the part it needs, tests/core/test_imports.py)
_AUTO = _registry.AUTO
_FORCED, _LAST, _TRACING_CHOICE, _TRACED_VIEW = _state.FORCED, _state.LAST, _state.TRACING_CHOICE, _state.TRACED_VIEW
_CAPTURED, _RECORDS = _capture.CAPTURED, _capture.RECORDS
_ENV_DATA, _ENV_KEY = _state.ENV_DATA, _state.ENV_KEY
_environ_get, _traces_here = _state.environ_get, _state.traces_here
_as_traced, _is_compiling = _state.as_traced, _state.is_compiling
_choose, _validate, _prepare = _registry.choose, _registry.validate, _registry.prepare
_check_backend_name = _registry.check_backend_name
_choice_for_trace, _static_signature = _planning.choice_for_trace, _planning.static_signature
