"""The engine: one entry point that normalizes over a scope, and the contract its backends keep.

``norm(x, scope, ...)`` resolves the scope on ``x``'s shape and hands a :class:`Call` to a
backend. The engine knows the contract -- :class:`Backend`: ``why_not`` (can it run this call
exactly?), ``why_not_auto`` (should the automatic order pick it?) and ``prepare`` (the function
that runs it) -- not the backends themselves: they live in :mod:`normscope.backends`, which names
them and their automatic order in one place and registers them here.

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
is traced (:func:`capture`, :func:`record`) -- lives in :mod:`contextvars`: per thread and per
asyncio task, as torch's grad mode and autocast state are. A ``with use_backend(...)`` in one
thread never changes another's calls, and leaving it restores only its own thread's choice; a
``torch.compile`` in one thread plans on stand-ins in that thread and never captures or reroutes an
eager call of another (:func:`compiling` asks about this thread; torch's own
``torch.compiler.is_compiling()`` answers for the process). The caches shared between threads --
the plans by signature here and in :mod:`normscope.hot`, the traced plans -- hold values that
depend only on their key and are never mutated once stored, so a read and a concurrent write of
one dict (each one atomic in CPython) see either the old table or the new one, both right; the
one publication that takes two steps (a traced plan and the token naming it) holds a lock.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from . import reference as ref
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

ENV_VAR = "NORMSCOPE_BACKEND"


class Running(NamedTuple):
    """Running statistics of a BatchNorm/InstanceNorm-style layer (1-d tensors over the affine
    axis, or None when the layer tracks none).

    ``momentum`` is the update factor actually used this step (the layer resolves torch's
    ``momentum=None`` cumulative average into ``1 / num_batches_tracked``).
    ``use_input_stats``: normalize with this batch's statistics (and update the running ones if
    present), or with the running ones (evaluation).
    """

    mean: Tensor | None
    var: Tensor | None
    momentum: float
    use_input_stats: bool


class Call(NamedTuple):
    """Everything a backend needs for one normalization.

    With ``residual`` the call is the fused ``h = x + residual; y = norm(h)`` of :func:`add_norm`:
    ``h`` is rounded to the residual's dtype (fp32 with ``residual_fp32``) before it is normalized,
    and the scale is ``weight + weight_offset``. Only a backend with ``fuses_residual`` sees such a
    call; for the others the engine adds first.

    ``weight_offset`` and ``casting`` are a model family's options for the last-axes LayerNorm and
    RMSNorm scopes: the scale is ``weight + weight_offset`` formed in fp32 (Gemma's ``1 + w`` is 1.0),
    and ``casting`` says where the result is rounded to the input dtype -- ``"torch"`` (torch's layers;
    with an offset, as ``"gemma"``), ``"gemma"`` (normalize, scale and shift in fp32, round last) or
    ``"llama"`` (normalize in fp32, round, then scale in the weight's dtype).
    :func:`normscope.reference.cast_affine` is the definition; a backend runs such a call exactly or
    declines it in ``why_not``.

    ``op`` names the torch op a layer stands for when two ops compute the same scope: GroupNorm(C, C)
    resolves to InstanceNorm's scope, but torch runs it through ``group_norm`` (more accurate in half
    precision, and it keeps channels_last), so ``op="group_norm"`` asks the aten backend for that op.
    """

    x: Tensor
    scope: Resolved
    weight: Tensor | None
    bias: Tensor | None
    eps: float
    mask: Tensor | None
    running: Running | None
    residual: Tensor | None = None
    weight_offset: float = 0.0
    residual_fp32: bool = False
    op: str | None = None
    casting: str = "torch"


Runner = Callable[[Call], Tensor]

#: ``entry(x, weight, bias, eps, running)``: a plan run on a layer's call, whose other fields are the
#: planned call's (see :func:`layer_entry`)
LayerEntry = Callable[[Tensor, "Tensor | None", "Tensor | None", float, "Running | None"], Tensor]


#: ``call_of((x, scope, weight, bias, eps, mask, running, residual, weight_offset, residual_fp32, op,
#: casting))``:
#: a :class:`Call` from all its fields, in order, without the NamedTuple's Python-level ``__new__``
#: (a frame that was a measurable share of a small layer's per-call cost); for the layers' hot path.
call_of = functools.partial(tuple.__new__, Call)


def _anything(call: Call) -> str | None:
    return None


class Backend(NamedTuple):
    """A way to run calls.

    * ``why_not(call)``: None when the backend runs ``call`` exactly (torch's numbers, or the
      reference's where torch has no op), else a short reason. Forced and automatic choice both ask.
    * ``prepare(call, automatic)``: the function that runs calls like ``call``; ``automatic`` says
      whether the engine chose it (a backend may guard an automatic run, see the aten backend). The
      function may carry a ``layer_entry`` attribute, the same run as ``entry(x, weight, bias, eps,
      running)``, which layers call without building a :class:`Call` (:func:`layer_entry`).
    * ``why_not_auto(call)``: asked only by the automatic order, after ``why_not``: a reason not to
      be *chosen* for a call it could run (a fast path not measured faster on this device).
    * ``fuses_residual``: it runs :func:`add_norm` calls itself (else the engine adds first).

    ``why_not``, ``why_not_auto`` and ``prepare`` may look only at the call's *signature* -- the
    resolved scope (shape included), dtype, device, which of mask, running statistics, weight,
    bias and residual are present, and which axes the mask broadcasts over -- because their
    answers are cached per signature (:func:`signature`). Strides are not in it: a backend handles
    any layout itself.
    """

    name: str
    why_not: Callable[[Call], str | None]
    prepare: Callable[[Call, bool], Runner]
    why_not_auto: Callable[[Call], str | None] = _anything
    fuses_residual: bool = False


# ----------------------------------------------------------------------------------------------
# what backends and layers share: running statistics, recomputation, tracing, masks


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
        for buf, new in ((run.mean, mean), (run.var, unbiased)):
            acc = ref.acc_dtype(buf.dtype)
            upd = buf.to(acc) * (1 - f) + new.reshape(buf.shape).to(acc) * f
            buf.copy_(upd)


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
    run = _BACKENDS["reference"].prepare(call, False)
    if not wide or call.x.dtype == torch.float64:
        return run(call)

    def up(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(torch.float64)

    y = run(call._replace(x=up(call.x), weight=up(call.weight), bias=up(call.bias)))
    return y.to(call.x.dtype)


def tracing() -> bool:
    """Whether torch.compile (dynamo) or the TorchScript tracer is recording this call (or the
    engine is planning a call dynamo traces, see :func:`capture`)."""
    return compiling() or torch.jit.is_tracing() or _TRACING_CHOICE.get()


def transformed() -> bool:
    """Whether this call runs inside a torch.func transform (vmap, grad, jacrev, ...): there a Python
    bool of a tensor (``.item()``) cannot run under vmap, nor an autograd.Function without
    ``setup_context``. Asked at run time, never in ``why_not``: plans are cached per signature, and
    one signature is called both inside and outside transforms."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def position_mask(mask: Tensor, x: Tensor, d: int) -> Tensor | None:
    """A mask as one flag per position -- a view with x's shape without axis ``d`` -- or None when it
    varies along ``d`` (no per-position form: backends that need one leave the call to the reference)."""
    k = d - (x.dim() - mask.dim())  # the mask's axis that broadcasts against x's axis d
    if k >= 0 and mask.shape[k] != 1:
        return None
    return torch.broadcast_to(mask, x.shape).select(d, 0)


# ----------------------------------------------------------------------------------------------
# registry and dispatch

_BACKENDS: dict[str, Backend] = {}
_AUTO: list[str] = []
_PLANS: dict[tuple, tuple[str, Runner]] = {}
_MAX_PLANS = 4096

# What a call reads besides its arguments, per thread and per asyncio task (see "Per-thread state"
# in the module docstring). Values are immutable and only ever replaced (``set``), never mutated: a
# context copied for a task or thread then shares nothing it could change under another.

#: the innermost use_backend() name ("auto" for ``use_backend(None)``), None outside any
_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("normscope_forced", default=None)
#: what last_backend() answers
_LAST: contextvars.ContextVar[str | None] = contextvars.ContextVar("normscope_last", default=None)
#: inside _as_traced(): the planning of a call dynamo traces (tracing() is True)
_TRACING_CHOICE: contextvars.ContextVar[bool] = contextvars.ContextVar("normscope_tracing_choice", default=False)
#: inside capture(): the list dispatch() appends the plans it made to instead of running them
_CAPTURED: contextvars.ContextVar[list | None] = contextvars.ContextVar("normscope_captured", default=None)
#: the slots of the checked calls in progress (record()), innermost last
_RECORDS: contextvars.ContextVar[tuple] = contextvars.ContextVar("normscope_records", default=())


class _TracedView(threading.local):
    """The forced backend as dynamo can read it: dynamo traces no ``ContextVar.get``, but it reads an
    attribute of a thread-local object and guards on its value -- a guard evaluated, like the
    attribute, in the calling thread. Kept equal to :data:`_FORCED` by :func:`use_backend` on entry
    and exit; read only while dynamo traces (:func:`requested_backend`, :mod:`normscope.hot`)."""

    def __init__(self) -> None:
        self.forced: str | None = None


_TRACED_VIEW = _TracedView()


def register_backend(backend: Backend, *, before: str | None = None) -> None:
    """Add a backend to the automatic order: just ahead of ``before``, else last.

    :mod:`normscope.backends` registers the built-in ones in their order; use this for a backend
    of your own (it must keep the :class:`Backend` contract)."""
    _BACKENDS[backend.name] = backend
    if backend.name in _AUTO:
        _AUTO.remove(backend.name)
    at = _AUTO.index(before) if before is not None and before in _AUTO else len(_AUTO)
    _AUTO.insert(at, backend.name)
    _PLANS.clear()


def backends() -> list[str]:
    """Names of the registered backends, in automatic order."""
    return list(_AUTO)


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force a backend inside a ``with`` block (``None`` restores automatic choice)."""
    if name is not None:
        _check_backend_name(name, "use_backend(name)")
    token = _FORCED.set(name or "auto")
    _TRACED_VIEW.forced = name or "auto"
    try:
        yield
    finally:
        # back to what this thread (or task) had on entry: another thread's blocks are its own
        _FORCED.reset(token)
        _TRACED_VIEW.forced = _FORCED.get()


def last_backend() -> str | None:
    """Name of the backend that ran this thread's (or asyncio task's) most recent normalization
    (None before any). A compiled layer (torch.compile) records its backend when its graph is
    traced, not on every call."""
    return _LAST.get()


def _check_backend_name(name: str, where: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{where}: expected a backend name (str), got {type(name).__name__} {name!r}")
    if name != "auto" and name not in _BACKENDS:
        valid = ", ".join(["auto", *_BACKENDS])
        raise ValueError(f"{where}: unknown backend {name!r}; expected one of: {valid}")


def constant_when_compiled(fn: Callable) -> Callable:
    """Mark ``fn`` (no arguments, reads the environment) as a constant for torch.compile: dynamo
    calls it once while tracing and bakes its answer in, instead of tracing the read -- which guards
    on the whole of ``os.environ`` (its every key), so that any environment variable set later
    recompiles the graph, and evaluates that guard on every call (measured: a compiled LayerNorm
    cost ~30 us a call more than torch.nn's, mostly this). Eagerly ``fn`` runs as it is.

    The mark is the attribute ``torch.compiler.assume_constant_result`` sets (torch 2.4 to 2.13),
    set here directly: calling it imports ``torch._dynamo`` (~0.7 s) at ``import normscope``, for
    users who never compile. ``tests/core/test_engine.py`` checks that the two marks agree."""
    fn._dynamo_marked_constant = True
    return fn


@constant_when_compiled
def _environ_get() -> str | None:
    """``os.environ.get(ENV_VAR)``, read on every eager call (users set it at run time; under
    torch.compile when the graph is traced, see :func:`constant_when_compiled`) but without the
    ``KeyError`` that ``os.environ.get`` raises and catches inside when the variable is unset -- the
    usual case: that cost ~1.2 µs a call, a measurable share of a small layer's per-call cost
    (benchmarks/cpu_overhead.py); the mapping's own dict of encoded names answers in ~0.06 µs."""
    data = getattr(os.environ, "_data", None)
    if data is None:  # not CPython's os._Environ
        return os.environ.get(ENV_VAR)
    value = data.get(_ENV_KEY)
    return None if value is None else os.environ.decodevalue(value)


_ENV_KEY = os.environ.encodekey(ENV_VAR) if hasattr(os.environ, "encodekey") else ENV_VAR


def report_backend(name: str) -> None:
    """Say that backend ``name`` ran the current call (what :func:`last_backend` answers): for a
    backend's runner that hands a call on (:func:`recompute`) and for ops outside :func:`dispatch`
    (the Triton modern kernels). Traced by dynamo it is a constant, recorded when traced."""
    if _is_compiling() and _traces_here():  # compiling(), inline
        _report_traced(name)
    elif _LAST.get() is not name:
        _LAST.set(name)


@constant_when_compiled
def _report_traced(name: str) -> str:
    _LAST.set(name)
    return name


def requested_backend(backend: str | None = None) -> str:
    """The backend a call asks for: ``backend`` if given, else the innermost :func:`use_backend`,
    else ``NORMSCOPE_BACKEND``, else ``"auto"``."""
    if backend is not None:
        _check_backend_name(backend, "backend")
        return backend
    forced = _TRACED_VIEW.forced if compiling() else _FORCED.get()
    if forced is not None:
        return forced
    env = _environ_get()
    if env:
        _check_backend_name(env, f"environment variable {ENV_VAR}")
        return env
    return "auto"


def request_key() -> str | None:
    """What :func:`requested_backend` (without ``backend=``) depends on, read as cheaply as possible
    and not validated: the innermost :func:`use_backend` name, else the raw ``NORMSCOPE_BACKEND``.
    For keys of caches whose misses go through :func:`requested_backend` (the layers' hot path)."""
    forced = _FORCED.get()
    if forced is not None:
        return forced
    return _ENV_DATA.get(_ENV_KEY) if _ENV_DATA is not None else os.environ.get(ENV_VAR)


_ENV_DATA = getattr(os.environ, "_data", None)  # CPython's os._Environ: its dict of encoded names


def signature(call: Call) -> tuple:
    """What a backend's choice may depend on (see :class:`Backend`)."""
    r, res = call.running, call.residual
    return (
        call.scope,
        call.x.dtype,
        call.x.device.type,
        # which axes the mask broadcasts over (a per-position mask vs one that varies by channel)
        None if call.mask is None else tuple(n == 1 for n in call.mask.shape),
        None if r is None else (r.use_input_stats, r.mean is None, r.var is None),
        # shapes, not just presence: a plan is validated once per signature (see _validate)
        None if call.weight is None else call.weight.shape,
        None if call.bias is None else call.bias.shape,
        None if r is None or r.mean is None else r.mean.shape,
        None if r is None or r.var is None else r.var.shape,
        None if res is None else (res.dtype, res.shape, call.residual_fp32),
        call.weight_offset,
        call.op,
        call.casting,
    )


def _validate(call: Call) -> None:
    """What a backend may take for granted, checked once per signature (so never on the hot path):
    weight, bias and running statistics fit the scope's affine axes -- a kernel indexing a wrong-size
    buffer would read or write out of bounds -- and live on the input's device."""
    s = call.scope
    affine = tuple(s.shape[d] for d in s.affine)
    n_aff = 1
    for n in affine:
        n_aff *= n
    for name, t in (("weight", call.weight), ("bias", call.bias)):
        if t is None:
            continue
        if not s.affine:
            raise ValueError(f"norm: this scope has no affine axes, but `{name}` was given (shape {tuple(t.shape)})")
        if tuple(t.shape) != affine and not (t.dim() == 1 and t.numel() == n_aff):
            raise ValueError(
                f"norm: expected `{name}` of shape {affine} (the scope's affine axes {s.affine} of an input of "
                f"shape {tuple(s.shape)}), got {tuple(t.shape)}"
            )
    r = call.running
    if r is not None:
        if not s.affine and (r.mean is not None or r.var is not None):
            raise ValueError("norm: running statistics need a scope with affine (kept, per-channel) axes")
        for name, t in (("running.mean", r.mean), ("running.var", r.var)):
            if t is not None and t.numel() != n_aff:
                raise ValueError(
                    f"norm: expected `{name}` with {n_aff} elements (one per index of the affine axes {s.affine} "
                    f"of an input of shape {tuple(s.shape)}), got shape {tuple(t.shape)}"
                )
    if call.residual is not None and tuple(call.residual.shape) != tuple(s.shape):
        raise ValueError(f"norm: expected `residual` of shape {tuple(s.shape)}, got {tuple(call.residual.shape)}")
    for name, t in (("weight", call.weight), ("bias", call.bias), ("residual", call.residual), ("mask", call.mask)):
        if t is not None and t.device != call.x.device:
            raise ValueError(f"norm: expected `{name}` on {call.x.device}, got {t.device}")


def _plain(call: Call) -> Call:
    """The plain call a non-fusing backend runs for an add_norm call (``x`` stands in for ``h``:
    the answers depend on the signature only, and ``h`` has ``x``'s shape)."""
    return call._replace(residual=None, weight_offset=0.0, residual_fp32=False)


def _why_not(b: Backend, call: Call, automatic: bool) -> str | None:
    if call.residual is not None and not b.fuses_residual:
        call = _plain(call)
    reason = b.why_not(call)
    if reason is None and automatic:
        reason = b.why_not_auto(call)
    return reason


def _choose(call: Call, name: str) -> str:
    """The backend that runs ``call`` when ``name`` is requested: the first of the automatic order
    that takes it (``"auto"``), else ``name`` itself; ValueError saying why when none can."""
    if name == "auto":
        reasons = {}
        for name in _AUTO:
            reasons[name] = _why_not(_BACKENDS[name], call, True)
            if reasons[name] is None:
                return name
        why = "; ".join(f"{n}: {r}" for n, r in reasons.items())
        raise ValueError(f"no backend can run this normalization ({why})")
    reason = _why_not(_BACKENDS[name], call, False)
    if reason is not None:
        raise ValueError(f"backend {name!r} cannot run this normalization: {reason}")
    return name


def _prepare(name: str, call: Call, automatic: bool) -> tuple[str, Runner]:
    b = _BACKENDS[name]
    if call.residual is None or b.fuses_residual:
        return name, b.prepare(call, automatic)
    return name, _adding(b.prepare(_plain(call), automatic))


def _plan(call: Call, name: str) -> tuple[str, Runner]:
    _validate(call)
    return _prepare(_choose(call, name), call, name == "auto")


def _traced_plan(call: Call, name: str) -> tuple[str, Runner]:
    """:func:`_plan` while dynamo traces: the choice of backend made once, eagerly, on a stand-in of
    the call's signature (:func:`_choice_for_trace`), so that dynamo traces -- and guards on -- only
    the chosen backend's ``prepare`` and runner, not every ``why_not`` of the automatic order: each
    function dynamo inlines is guarded on every call of the compiled graph (measured, a compiled
    LayerNorm cost ~20 us a call more than torch.nn's, most of it the planning's guards).
    Symbolic sizes (dynamic shapes) have no constant signature: then the choice is traced."""
    _validate(call)
    sig = _static_signature(call)
    chosen = _choose(call, name) if sig is None else _choice_for_trace(sig, name)
    return _prepare(chosen, call, name == "auto")


def _static_signature(call: Call) -> tuple | None:
    """Everything ``why_not`` may read (see :class:`Backend`) as Python constants, or None when a
    size is symbolic."""
    x, s, r, res = call.x, call.scope, call.running, call.residual
    tensors = (x, call.weight, call.bias, call.mask, res, *((r.mean, r.var) if r is not None else ()))
    for t in tensors:
        if t is not None and symbolic(t.shape):
            return None
    if symbolic(s.shape):
        return None

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
    """Whether a size of ``shape`` is symbolic (a SymInt: dynamic shapes, torch.export).

    While dynamo traces, ``isinstance(n, torch.SymInt)`` and ``type(n) is int`` both answer as for
    an int, so there torch's ``has_static_value`` is asked (dynamo answers it for the traced size,
    without a guard); a torch without it (< 2.6) is answered "symbolic", the safe side."""
    if not compiling():
        return any(isinstance(n, torch.SymInt) for n in shape)
    # imported here, not at import time: it loads torch._dynamo (~0.7 s), which dynamo, tracing
    # this, has loaded already
    from torch.fx.experimental import symbolic_shapes

    has_static_value = getattr(symbolic_shapes, "has_static_value", None)
    return has_static_value is None or not all(has_static_value(n) for n in shape)


def compiling() -> bool:
    """Whether dynamo (torch.compile, torch.export) is tracing this call, on this thread.

    ``torch.compiler.is_compiling()`` alone is not that: dynamo answers it True where it traces, but
    torch (2.13) also holds it True, process-wide, for as long as any thread compiles -- so eager
    calls of every other thread would read it True. This asks it first (False, the usual eager
    answer, costs one call) and then :func:`_traces_here`."""
    return _is_compiling() and _traces_here()


@constant_when_compiled
def _traces_here() -> bool:
    """Eagerly: whether this thread is inside a dynamo trace (its ``TracingContext`` is set) and not
    in the engine's own eager planning for that trace (:func:`_as_traced`), which runs as eager code.
    Where dynamo traces a call of it, dynamo runs it eagerly -- the answer is True -- and bakes that in."""
    from torch._guards import TracingContext  # loaded with torch; imported here, where dynamo runs

    return TracingContext.try_get() is not None and not _TRACING_CHOICE.get()


# module-level names, not ``torch.<...>`` reads: while dynamo traces a layer (normscope.hot) the
# same module object read from two of our modules costs a guard evaluated in Python on every call
_is_compiling = torch.compiler.is_compiling


def stand_in(shape: tuple, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A stride-0 view of one element with this shape, dtype and device: all that the checks, the
    scope's resolution and the choice of backend read of a tensor (plans do not depend on strides)."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)


@contextlib.contextmanager
def _as_traced() -> Iterator[None]:
    """Plan inside as for a traced call (:func:`tracing` is True): the eager planning of a call that
    dynamo traces (``_choice_for_trace``)."""
    token = _TRACING_CHOICE.set(True)
    try:
        yield
    finally:
        _TRACING_CHOICE.reset(token)


_TRACE_CHOICES: dict[tuple, str] = {}


@constant_when_compiled
def _choice_for_trace(sig: tuple, name: str) -> str:
    """:func:`_choose` on a stand-in of signature ``sig`` (stride-0 views of one element, of the
    call's shapes, dtypes and device), memoized: dynamo runs it once, eagerly, and bakes the name in."""
    key = (sig, name)
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
        with _as_traced():
            found = _choose(call, name)
        if len(_TRACE_CHOICES) >= _MAX_PLANS:
            _TRACE_CHOICES.clear()
        _TRACE_CHOICES[key] = found
    return found


def _adding(inner: Runner) -> Runner:
    """Run an add_norm call on a backend that does not fuse the add: add, then normalize."""

    def run(c: Call) -> tuple[Tensor, Tensor]:
        h = _add(c.x, c.residual, c.residual_fp32)
        hn, w = h, c.weight
        if w is not None and (c.weight_offset != 0.0 or w.dtype != h.dtype):
            # the scale (w + offset) is formed in fp32, as the definition does, so a bf16 weight plus
            # 1.0 is not rounded to bf16; the normalization then runs on h in fp32 too
            acc = ref.acc_dtype(h.dtype)
            hn, w = h.to(acc), w.to(acc) + c.weight_offset
        y = inner(c._replace(x=hn, weight=w, residual=None, weight_offset=0.0, residual_fp32=False))
        return y.to(c.x.dtype), h

    return run


def _add(x: Tensor, residual: Tensor, residual_fp32: bool) -> Tensor:
    """``x + residual`` computed in fp32 (fp64 for fp64) and rounded once to the residual's dtype,
    or kept in fp32 with ``residual_fp32``: the definition every backend of add_norm shares."""
    acc = ref.acc_dtype(residual.dtype if x.dtype == residual.dtype else torch.float32)
    out = torch.float32 if residual_fp32 and residual.dtype != torch.float64 else residual.dtype
    if x.dtype == residual.dtype == out:
        return x + residual  # torch rounds a half-precision sum once from fp32 too
    return (x.to(acc) + residual.to(acc)).to(out)


def plan(call: Call, backend: str | None = None) -> tuple[str, Runner]:
    """``(name, runner)``: the backend that :func:`dispatch` runs ``call`` on and its runner, from
    the plan cache (planned afresh, uncached, while tracing or for symbolic sizes). A runner serves
    every call with the same :func:`signature`; the hot path keeps it per call signature (:mod:`normscope.hot`)."""
    requested = requested_backend(backend)
    if compiling():
        # under dynamo the planning is traced once per graph anyway; storing it in _PLANS would be
        # a side effect on a dict keyed by trace-time objects (Resolved) that dynamo cannot replay,
        # which breaks torch.compile(fullgraph=True)
        return _traced_plan(call, requested)
    key = (signature(call), requested)
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
    captured = _CAPTURED.get()
    if captured is not None:  # planning a traced call on stand-ins (normscope.hot): plan it, run nothing
        captured.append((call, _plan(call, requested_backend(backend))))
        return call.x
    planned = plan(call, backend)
    stack = _RECORDS.get()
    if stack:  # a call the hot path is checking: what it dispatched (once; twice is not a plan)
        slot = stack[-1]
        slot[0] = (call, planned) if slot[0] is None else False
        start = slot[1]
        if start is not None:  # the call is checked and about to run: the caller's side effect
            slot[1] = None
            start()
    return run(planned, call)


# ----------------------------------------------------------------------------------------------
# what the hot path (normscope.hot) learns from a checked call


def record(start: Callable[[], None] | None = None) -> list:
    """Open a slot in which :func:`dispatch` records the ``(call, (name, runner))`` it runs next on
    this thread (see :func:`recorded`); ``start``: called once, when that call has passed every check
    and is about to run (a layer's bookkeeping, such as counting a batch, that a refused call must
    not do and a call that raises while it runs must have done, as torch's layers do)."""
    slot = [None, start]
    _RECORDS.set((*_RECORDS.get(), slot))
    return slot


def recorded(slot: list) -> tuple | None:
    """Close ``slot``: the ``(call, plan)`` dispatched while it was open, or None when there was none,
    more than one, or the checked call declined (:func:`decline_record`)."""
    stack = _RECORDS.get()
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is slot:
            _RECORDS.set(stack[:i] + stack[i + 1 :])
            break
    return slot[0] or None


def decline_record() -> None:
    """The call being checked must not be remembered (see :func:`normscope.hot.per_call`)."""
    stack = _RECORDS.get()
    if stack:
        stack[-1][0] = False


@contextlib.contextmanager
def capture() -> Iterator[list]:
    """Inside: :func:`dispatch` plans as for a traced call (:func:`tracing` is True) and appends
    ``(call, (name, runner))`` to the yielded list instead of running anything."""
    captured: list = []
    token = _CAPTURED.set(captured)
    try:
        with _as_traced():
            yield captured
    finally:
        _CAPTURED.reset(token)


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
