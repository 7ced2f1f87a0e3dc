"""What a call reads besides its arguments, per thread and per asyncio task, and the questions about
tracing that every part of the engine asks.

The forced backend (:func:`normscope.engine.use_backend`), what ran last
(:func:`normscope.engine.last_backend`) and whether the engine is planning a traced call live in
:mod:`contextvars` (see "Per-thread state" in :mod:`normscope.engine`). Values are immutable and only
ever replaced (``set``), never mutated: a context copied for a task or thread then shares nothing it
could change under another.

The names here are read by the registry, the planner, the engine's entry points and the hot path
(:mod:`normscope.hot`, which inlines some of them): they are public within the package. Depends on
:mod:`normscope._contract` only.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator

import torch

from ._contract import ENV_VAR

__all__ = [
    "FORCED",
    "LAST",
    "TRACING_CHOICE",
    "TRACED_VIEW",
    "ENV_KEY",
    "ENV_DATA",
    "constant_when_compiled",
    "environ_get",
    "request_key",
    "report_backend",
    "last_backend",
    "compiling",
    "traces_here",
    "is_compiling",
    "tracing",
    "transformed",
    "transformed_eagerly",
    "as_traced",
]

#: the innermost use_backend() name ("auto" for ``use_backend(None)``), None outside any
FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("normscope_forced", default=None)
#: what last_backend() answers
LAST: contextvars.ContextVar[str | None] = contextvars.ContextVar("normscope_last", default=None)
#: inside as_traced(): the planning of a call dynamo traces (tracing() is True)
TRACING_CHOICE: contextvars.ContextVar[bool] = contextvars.ContextVar("normscope_tracing_choice", default=False)


class TracedView(threading.local):
    """The forced backend as dynamo can read it: dynamo traces no ``ContextVar.get``, but it reads an
    attribute of a thread-local object and guards on its value -- a guard evaluated, like the
    attribute, in the calling thread. Kept equal to :data:`FORCED` by ``use_backend`` on entry
    and exit; read only while dynamo traces (``requested_backend``, :mod:`normscope.hot`)."""

    def __init__(self) -> None:
        self.forced: str | None = None


TRACED_VIEW = TracedView()


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


#: CPython's ``os._Environ`` keeps its values in a dict of encoded names: read there, a lookup of an
#: unset variable raises and catches no KeyError inside ``os.environ.get``
ENV_DATA = getattr(os.environ, "_data", None)
ENV_KEY = os.environ.encodekey(ENV_VAR) if hasattr(os.environ, "encodekey") else ENV_VAR


@constant_when_compiled
def environ_get() -> str | None:
    """``os.environ.get(ENV_VAR)``, read on every eager call (users set it at run time; under
    torch.compile when the graph is traced, see :func:`constant_when_compiled`) but without the
    ``KeyError`` that ``os.environ.get`` raises and catches inside when the variable is unset -- the
    usual case: that cost ~1.2 µs a call, a measurable share of a small layer's per-call cost
    (benchmarks/cpu_overhead.py); the mapping's own dict of encoded names answers in ~0.06 µs."""
    if ENV_DATA is None:  # not CPython's os._Environ
        return os.environ.get(ENV_VAR)
    value = ENV_DATA.get(ENV_KEY)
    return None if value is None else os.environ.decodevalue(value)


def request_key() -> str | None:
    """What ``requested_backend`` (without ``backend=``) depends on, read as cheaply as possible
    and not validated: the innermost ``use_backend`` name, else the raw ``NORMSCOPE_BACKEND``.
    For keys of caches whose misses go through ``requested_backend`` (the layers' hot path)."""
    forced = FORCED.get()
    if forced is not None:
        return forced
    return ENV_DATA.get(ENV_KEY) if ENV_DATA is not None else os.environ.get(ENV_VAR)


def last_backend() -> str | None:
    """Name of the backend that ran this thread's (or asyncio task's) most recent normalization
    (None before any). A compiled layer (torch.compile) records its backend when its graph is
    traced, not on every call."""
    return LAST.get()


def report_backend(name: str) -> None:
    """Say that backend ``name`` ran the current call (what :func:`last_backend` answers): for a
    backend's runner that hands a call on (``recompute``) and for ops outside ``dispatch``
    (the Triton modern kernels). Traced by dynamo it is a constant, recorded when traced."""
    if is_compiling() and traces_here():  # compiling(), inline
        _report_traced(name)
    elif LAST.get() is not name:
        LAST.set(name)


@constant_when_compiled
def _report_traced(name: str) -> str:
    LAST.set(name)
    return name


def compiling() -> bool:
    """Whether dynamo (torch.compile, torch.export) is tracing this call, on this thread.

    ``torch.compiler.is_compiling()`` alone is not that: dynamo answers it True where it traces, but
    torch (2.13) also holds it True, process-wide, for as long as any thread compiles -- so eager
    calls of every other thread would read it True. This asks it first (False, the usual eager
    answer, costs one call) and then ``traces_here()``."""
    return is_compiling() and traces_here()


@constant_when_compiled
def traces_here() -> bool:
    """Eagerly: whether this thread is inside a dynamo trace (its ``TracingContext`` is set) and not
    in the engine's own eager planning for that trace (``as_traced()``), which runs as eager code.
    Where dynamo traces a call of it, dynamo runs it eagerly -- the answer is True -- and bakes that in."""
    from torch._guards import TracingContext  # loaded with torch; imported here, where dynamo runs

    return TracingContext.try_get() is not None and not TRACING_CHOICE.get()


_compiler = torch.compiler

if hasattr(_compiler, "_is_compiling_flag") and hasattr(_compiler, "_compile_session_context"):

    @constant_when_compiled
    def is_compiling() -> bool:
        """``torch.compiler.is_compiling()``: its flag, read without its two Python frames.

        Eagerly torch's function answers ``_is_compiling_flag`` (after asking
        ``torch.jit.is_scripting()``, False outside TorchScript, which never runs this code). A
        layer's hot path asks it on every call, and inside a model -- between the model's other
        code, with its own code and torch's module dictionaries out of cache -- torch's two frames
        cost several microseconds a call (``benchmarks/families.py``: a patched norm's time inside a
        model). Where dynamo traces a call of it, dynamo runs it (a constant, as torch's function
        is): torch holds the flag True for a whole compile session (``_compile_session_context``,
        whose presence is what selects this reader) and for an export, so the answer is True there
        as torch's, without a guard on the flag's value that would fail on every run of the graph."""
        return _compiler._is_compiling_flag

else:  # a torch whose compile session does not hold the flag: its function, which dynamo answers
    # a module-level name, not a ``torch.<...>`` read: while dynamo traces a layer (normscope.hot)
    # the same module object read from two of our modules costs a guard evaluated in Python on
    # every call
    is_compiling = torch.compiler.is_compiling


def tracing() -> bool:
    """Whether torch.compile (dynamo) or the TorchScript tracer is recording this call (or the
    engine is planning a call dynamo traces, see ``as_traced()``)."""
    return compiling() or torch.jit.is_tracing() or TRACING_CHOICE.get()


def transformed() -> bool:
    """Whether this call runs inside a torch.func transform (vmap, grad, jacrev, ...): there a Python
    bool of a tensor (``.item()``) cannot run under vmap, nor an autograd.Function without
    ``setup_context``. Or inside forward-mode AD's dual level (``torch.autograd.forward_ad``, which
    torch.func.jvp does not use): there an autograd.Function without ``jvp`` and the ``out=`` ops
    raise NotImplementedError on a dual tensor, where torch's own norms give its tangent (RMSNorm on
    the rows path did). Asked at run time, never in ``why_not``: plans are cached per signature, and
    one signature is called both inside and outside transforms."""
    return torch._C._functorch.peek_interpreter_stack() is not None or _forward_ad._current_level >= 0


def transformed_eagerly() -> bool:
    """:func:`transformed`, not while dynamo traces. Dynamo runs its trace under a functorch
    interpreter, so :func:`transformed` answers True there whatever runs; a compiled graph holds the
    kernels' custom ops all the same. The Triton kernels (which have no batching or forward-derivative
    rules) ask this one: an eager call inside a transform runs elsewhere, a traced call keeps them."""
    return not compiling() and transformed()


#: the module whose ``_current_level`` is the innermost dual level (-1 outside any); read per call,
#: as ``dual_level`` rebinds it on entry and exit
_forward_ad = torch.autograd.forward_ad


@contextlib.contextmanager
def as_traced() -> Iterator[None]:
    """Plan inside as for a traced call (:func:`tracing` is True): the eager planning of a call that
    dynamo traces (:func:`normscope._planning.choice_for_trace`, :func:`normscope._capture.capture`)."""
    token = TRACING_CHOICE.set(True)
    try:
        yield
    finally:
        TRACING_CHOICE.reset(token)
