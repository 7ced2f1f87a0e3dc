"""The one hot path: every layer and :mod:`normscope.functional` call plans once per call signature.

A call's Python work -- checking its arguments, resolving its scope on the input's shape, choosing
a backend -- is the same on every call with the same signature, and at small shapes it cost several
times the ATen op itself (``benchmarks/cpu_overhead.py``). So each operation is an :class:`Op`: its
*checked call* (the argument checks in its own terms, then one engine dispatch) and the plans of the
calls it has checked. :func:`call` runs a call's plan when one was made for its signature, else the
checked call, and remembers what that call dispatched.

**A plan is reused only after comparing everything it reads.** The key of a call holds:

* every tensor it reads -- input, weight, bias, running mean and variance -- as its shape, dtype,
  device and layout (None for an absent one), and the running statistics' strides where the call
  updates them in place (a buffer whose elements share memory is refused there). Compared on every
  call: a parameter whose data was swapped (``p.data = ...``, ``resize_``, ``load_state_dict`` into
  a new shape) keeps its identity but not its signature, and takes the checked path, which refuses
  it in the op's terms -- never an unchecked native op reading or writing out of bounds
  (``torch.native_batch_norm`` checks nothing);
* every other argument the checks read, by value and type (``eps``, ``normalized_shape``,
  ``num_groups``, ``training``, ``momentum``'s type, ``backend``, ...: ``True == 1`` in Python, so
  the types too), and the requested backend (:func:`normscope.engine.request_key`).

The plan itself is the backend's runner in its ``entry(x, weight, bias, eps, running)`` form
(:func:`normscope.engine.layer_entry`), remembered only when the checked call dispatched exactly one
call and passed it the caller's very tensors -- a checked call that reshaped, cast or replaced an
argument, or masked the call, is not one the entry can stand for, and is never remembered. A checked
call may also decline to be remembered (:func:`per_call`: it warns on every call, as torch does).

No exception of a running call is caught: the runner's errors reach the caller as they are, and so
do the exceptions torch uses for control flow (activation checkpointing stops a recomputation early
by raising one from a saved-tensor hook). The one handler is around building and looking up the key,
where no op runs: an argument without a signature sends the call to its checks (a RuntimeError is
caught there only from a nested tensor, which has no sizes to read: the TorchScript tracer raises one
from a size read, and cannot go on past it). A call's side effects happen once: the running
statistics its runner updates, and the caller's own (``start``: BatchNorm's batch count), run once
the call is checked and before it runs.

**Threads.** The plan tables are shared by every thread. A plan depends only on its key and is
never changed once stored; a thread reads ``op.last`` (one tuple) once per call and an entry of
``op.plans`` in one dict operation, so another thread's store -- or the table starting afresh past
its bound -- gives it either the old plan or the new one, both right for the key. What a call
reads besides its arguments -- the forced backend, what ran last -- is per thread and per asyncio
task (:mod:`normscope.engine`, "Per-thread state"), and so is the key's requested backend.

While dynamo traces (``torch.compile``), :func:`call` plans the call once, eagerly, on stand-ins of
its tensors (stride-0 views of one element: the checks, the resolution and the choice read nothing
else), and dynamo traces only the chosen runner: tracing the checks put a guard on every function
and constant they read, evaluated on every call of the compiled graph (measured: a compiled small
model ~5 % slower than torch.nn's). Symbolic sizes (dynamic shapes) have no constant signature: then
the checked call itself is traced.
"""

from __future__ import annotations

import functools
import operator
import threading
import types
from collections.abc import Callable
from typing import NamedTuple, NoReturn

import torch
from torch import Tensor

from . import _registry, _state, engine
from ._planning import stand_in, symbolic
from .engine import Running

__all__ = ["Op", "Plan", "call", "per_call", "tensors", "running", "refuse_script", "refuse_script_function"]

_MAX_PLANS = 4096  # per op; past it the table starts afresh (a bound, not a policy: real code has few)


class Plan(NamedTuple):
    """What a call's signature was planned to: the backend that runs it, the runner's entry, and
    the ``eps`` the checked call passed on (RMSNorm's ``eps=None`` resolved for the dtype)."""

    backend: str
    entry: engine.LayerEntry
    eps: float


class Op:
    """An operation of the hot path: ``checked(settings, x, weight, bias, eps, running, mask)`` --
    its argument checks, then one :func:`normscope.engine.norm` -- and its plans by signature.

    ``settings``: everything besides the tensors and ``eps`` that the checked call reads, the fields
    of the op's ``settings_type`` (a NamedTuple) in its order, built by the op's one settings
    function -- hashable; a value of another type than usual makes a key of its own (see the module
    docstring). The function builds them as a plain tuple, one ``BUILD_TUPLE`` (a NamedTuple's
    construction cost ~0.4 us of a ~17 us call here); the checked call, which runs only when a call
    has no plan, gets them as the NamedTuple and reads them by name.
    """

    __slots__ = ("name", "checked", "settings_type", "plans", "last")

    def __init__(self, name: str, checked: Callable[..., Tensor], settings_type: type[tuple] = tuple) -> None:
        if name in _OPS:
            raise ValueError(f"Op: the name {name!r} is taken (by {_OPS[name]!r})")
        self.name, self.checked, self.settings_type = name, checked, settings_type
        self.plans: dict[tuple, Plan] = {}
        self.last: tuple = ((), None)  # (key, plan) of the last planned call: compared before the table
        _OPS[name] = self

    def __repr__(self) -> str:
        return f"Op({self.name!r}, {len(self.plans)} plans)"


_OPS: dict[str, Op] = {}  # by name: what a traced call names its op by (a constant to dynamo)
#: what a plan depends on of a tensor: its shape, dtype, device and layout. Not its class: a subclass
#: (Parameter, DTensor) runs the same ops through its own dispatch, and no check or choice of backend
#: reads it; nor its strides: the runners take any (``normscope.engine.Backend``)
_sig = operator.attrgetter("shape", "dtype", "device", "layout")
_ENV_GET = _state.ENV_DATA.get if _state.ENV_DATA is not None else (lambda _: _state.request_key())
_ENV_KEY = _state.ENV_KEY
_is_compiling = _state.is_compiling  # torch.compiler.is_compiling(), without its frames where torch allows
_traces_here = _state.traces_here  # `_is_compiling() and _traces_here()`: engine.compiling(), inline
_forced = _state.FORCED.get  # the innermost use_backend() name of this thread (or task), else None
_last = _state.LAST.get  # what engine.last_backend() answers, per thread (or task)
_set_last = _state.LAST.set


def call(
    op: Op,
    settings: tuple,
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    running: Running | None = None,
    mask: Tensor | None = None,
    start: Callable[[], None] | None = None,
) -> Tensor:
    """Run ``op`` on this call: its plan when one was made for the call's signature, else its checked
    call (remembering what that dispatched). See the module docstring for what the key compares.

    ``start``: the caller's side effect of a call that runs (BatchNorm's batch count), called once,
    after the checks pass and before the work starts -- so a refused call changes nothing, and a
    call that raises while it runs (activation checkpointing's early stop) has counted, as in torch."""
    if _is_compiling() and _traces_here():
        return _traced_call(op, settings, x, weight, bias, eps, running, mask, start)
    if mask is not None:  # a mask's values decide the statistics: the checked call, every time
        return _checked(op, settings, x, weight, bias, eps, running, mask, start)[0]
    try:
        r = running
        key = (
            settings,
            type(eps),  # before eps: a tensor given as eps (refused, never planned) stops the comparison here
            eps,
            _forced() or _ENV_GET(_ENV_KEY),  # engine.request_key(), inline
            _sig(x),
            None if weight is None else _sig(weight),
            None if bias is None else _sig(bias),
            None
            if r is None
            else (
                r[3],
                type(r[2]),
                None if r[0] is None else _sig(r[0]),
                None if r[1] is None else _sig(r[1]),
                # where a call updates them in place (training), their strides too: a buffer whose elements
                # share memory (an expanded one) is refused by the checks -- never planned past
                (None if r[0] is None else r[0].stride(), None if r[1] is None else r[1].stride()) if r[3] else None,
            ),
            _GEN,  # the registry's generation: a plan made before a backend was registered is not found
        )
        # the last call's key first: an equal tuple needs no hash (the common case, one signature)
        last = op.last
        if key == last[0]:
            found = last[1]
        else:
            found = op.plans.get(key)
            if found is not None:
                op.last = (key, found)
    except (AttributeError, TypeError):
        # an argument that is no tensor (no signature) or a setting that cannot be hashed (a list,
        # symbolic sizes): the checked call, which says what is wrong or runs it unplanned. Not a
        # RuntimeError: nothing here runs an op, but the TorchScript tracer records even a size read
        # and raises from it (a captured tensor that requires grad), after which it cannot go on --
        # carrying on into the checked call ended the trace in a segfault
        return _checked(op, settings, x, weight, bias, eps, running, None, start)[0]
    except RuntimeError:
        # a nested tensor has no sizes to read (torch raises an internal RuntimeError): to the checks,
        # which refuse it by name. Any other RuntimeError is the TorchScript tracer's (see above): raised
        if not getattr(x, "is_nested", False):
            raise
        return _checked(op, settings, x, weight, bias, eps, running, None, start)[0]
    if found is not None:
        if _last() is not found.backend:  # engine.report_backend(), inline: a set only on a change
            _set_last(found.backend)
        if start is not None:
            start()
        return found.entry(x, weight, bias, found.eps, running)
    y, dispatched = _checked(op, settings, x, weight, bias, eps, running, None, start)
    if dispatched and not engine.tracing() and _consumed(dispatched[0], x, weight, bias, running):
        if len(op.plans) >= _MAX_PLANS:
            op.plans.clear()
            op.last = ((), None)
        c, planned = dispatched
        op.plans[key] = Plan(planned[0], engine.layer_entry(c, planned), c.eps)
    return y


def _checked(op, settings, x, weight, bias, eps, running, mask, start) -> tuple[Tensor, tuple | None]:
    """The op's checked call, and the ``(call, plan)`` it dispatched (None: none, or more than one);
    ``start`` runs as the dispatched call starts (or after a checked call that dispatched nothing)."""
    slot = engine.record(start)
    try:
        y = op.checked(tuple.__new__(op.settings_type, settings), x, weight, bias, eps, running, mask)
    finally:
        dispatched = engine.recorded(slot)
    if slot[1] is not None:  # checked, ran, but dispatched nothing: started all the same
        slot[1]()
    return y, dispatched


def _consumed(
    c: engine.Call, x: Tensor, weight: Tensor | None, bias: Tensor | None, r: Running | None, traced: bool = False
) -> bool:
    """Whether the dispatched call ``c`` is the caller's call as given: its very tensors, no mask, no
    residual, the same running statistics -- the calls a plan's entry can stand for. (``traced``:
    planned on stand-ins, whose momentum stands for any.)"""
    if c.x is not x or c.weight is not weight or c.bias is not bias or c.mask is not None or c.residual is not None:
        return False
    cr = c.running
    if cr is None or r is None:
        return cr is r
    same = cr.mean is r.mean and cr.var is r.var and cr.use_input_stats == r.use_input_stats
    return same and (traced or cr.momentum == r.momentum)


def per_call() -> None:
    """Called by a checked call that must run on every call (it warns, as torch does on each call):
    the call is not remembered."""
    engine.decline_record()


#: ``running((mean, var, momentum, use_input_stats))``: a :class:`~normscope.engine.Running` without
#: the NamedTuple's Python-level ``__new__`` (a frame per call on the hot path)
running = functools.partial(tuple.__new__, Running)


def refuse_script(layer: torch.nn.Module) -> NoReturn:
    """Every normscope layer's ``__prepare_scriptable__``: ``torch.jit.script`` calls it on the module
    it scripts and on each submodule before compiling anything, so a model holding a normscope layer
    gets this TypeError rather than TorchScript's error from deep inside this module. TorchScript
    compiles a subset of Python that the hot path (its plans, checks and backends) is not written in;
    torch.compile and torch.export trace through it."""
    name = type(layer).__name__
    raise TypeError(
        f"torch.jit.script: normscope's {name} cannot be compiled by TorchScript (its forward runs "
        "normscope's planned Python path); use torch.compile(model) or torch.export.export(model, args) "
        "instead -- both trace through normscope layers -- or convert the layers to torch.nn first with "
        "normscope.convert(model, 'torch')"
    )


def refuse_script_function(fn: Callable, name: str) -> None:
    """Give the function ``fn`` (``normscope.functional``'s, public as ``name``) a
    ``__prepare_scriptable__`` that raises :func:`refuse_script`'s TypeError: ``torch.jit.script``
    asks it of a function it is given, and of each function a scripted module's code calls, before
    compiling it."""

    def refuse() -> NoReturn:
        raise TypeError(
            f"torch.jit.script: {name} cannot be compiled by TorchScript (it runs normscope's planned "
            "Python path); use torch.compile or torch.export, which trace through it, or the "
            "torch.nn.functional function of the same name where there is one"
        )

    fn.__prepare_scriptable__ = refuse


# ----------------------------------------------------------------------------------------------
# a layer's tensors


_MISSING = object()
_DIRECT: dict[type, bool] = {}
#: every tensor name a layer reads through :func:`tensors`: a class defining any of them itself is
#: read the usual way for all
_NAMES = frozenset(("weight", "bias", "running_mean", "running_var", "num_batches_tracked"))


def tensors(layer: torch.nn.Module, names: tuple[str, ...]) -> list:
    """The layer's tensors ``names`` (None for one registered as None), as ``getattr`` reads them,
    but from its ``_parameters``/``_buffers`` dicts where that is the same: ``nn.Module.__getattr__``
    is a Python call per name (~0.4 us, a measurable share of a small layer's call). Not where a class
    of the layer defines one of the names itself (a property of a subclass shadows the dicts), nor for
    a name the dicts do not hold (moved out by ``parametrize``, pruning, ``weight_norm``, FSDP).
    ``names``: among :data:`_NAMES` (whose shadowing is what is checked, once per class: a class
    given an attribute of one of these names after a layer of it was first called -- a property set
    on the class then -- is still read from the dicts; checking every class of the MRO on every
    call costs more than the dicts save)."""
    if _is_compiling() and _traces_here():
        return [getattr(layer, n) for n in names]
    cls = type(layer)
    direct = _DIRECT.get(cls)
    if direct is None:
        direct = _DIRECT[cls] = not any(n in vars(c) for c in cls.__mro__ for n in _NAMES)
    if not direct:
        return [getattr(layer, n) for n in names]
    d = layer.__dict__
    params, buffers = d["_parameters"], d["_buffers"]
    out = []
    for n in names:
        t = params.get(n, _MISSING)
        if t is _MISSING:
            t = buffers.get(n, _MISSING)
            if t is _MISSING:
                t = getattr(layer, n)
        out.append(t)
    return out


# ----------------------------------------------------------------------------------------------
# a call while dynamo traces it


def _traced_call(op, settings, x, weight, bias, eps, running, mask, start) -> Tensor:
    found = None if mask is not None else _traced(op, settings, x, weight, bias, eps, running)
    if start is not None:  # traced: a refused call raises when traced, before the graph ever runs
        start()
    if found is None:
        return op.checked(tuple.__new__(op.settings_type, settings), x, weight, bias, eps, running, mask)
    return found.entry(x, weight, bias, found.eps, running)


def _traced(op, settings, x, weight, bias, eps, running) -> Plan | None:
    """The call's plan, made eagerly on stand-ins (:func:`_trace_token`, a constant to dynamo), or
    None -- the checked call is traced -- for symbolic sizes or numbers, or an argument without a
    constant signature."""
    metas = []
    tensors_read = (x, weight, bias) if running is None else (x, weight, bias, running[0], running[1])
    for t in tensors_read:
        if t is None:
            metas.append(None)
        elif _is_tensor(t) and not _symbolic(t.shape):
            metas.append((tuple(t.shape), t.dtype, t.device))
        else:
            return None
    # a number that changed between calls of the compiled code (eps, a setting) is a symbolic one once dynamo
    # makes it dynamic (automatic dynamic, torch.compile's default): no constant to plan with, as for sizes --
    # passed to _trace_token it was dynamo's "assume_constant_result argument conversion failed"
    numbers = [v for v in (eps, *settings) if isinstance(v, (int, float))]
    numbers += [n for v in settings if type(v) is tuple for n in v if isinstance(n, (int, float))]
    if _symbolic(numbers):
        return None
    flags = None if running is None else (len(metas), running[3])
    # the settings as Python constants for dynamo: a type (the keys' ``type(eps)``-like slots, which
    # the checked calls never read) by its name, a float by its hex digits (_constant)
    constants = tuple(v.__name__ if isinstance(v, type) else _constant(v) for v in settings)
    # eps's type too, as the eager key holds it: True == 1.0, and the checks refuse a bool eps
    eps_type = type(eps).__name__
    eps = _constant(eps)
    # engine.request_key() as dynamo reads it: the forced name from the thread's view (a guard per
    # thread), the environment as a constant
    request = _TRACED_VIEW.forced or _environ_constant()
    return getattr(_TRACE_PLANS, _trace_token((op.name, constants, eps, eps_type, flags), tuple(metas), request))


_HEX = "normscope.hot:float.hex"  # the tag of a float handed to _trace_token as its hex digits


def _constant(v: object) -> object:
    """A float as a Python constant for dynamo: ``(_HEX, v.hex())``, in a tuple of them too (a setting's);
    anything else as it is.

    A float dynamo made symbolic (it changed between calls) and then fixed -- an ATen op that takes no
    symbolic float, such as the first of two norms given the same ``eps`` in one traced function, fixes
    its value with a guard -- is still handed on as a symbol, which no ``assume_constant_result``
    function takes ("argument conversion failed" under ``fullgraph=True``); ``float.hex`` of it is a
    string constant (and exactly the float: NaN, infinities and -0.0 included)."""
    if type(v) is float:
        return (_HEX, v.hex())
    return tuple(_constant(n) for n in v) if type(v) is tuple else v


def _from_constant(v: object) -> object:
    """:func:`_constant`'s value back, in a tuple of them too (a setting's)."""
    if type(v) is not tuple:
        return v
    if len(v) == 2 and v[0] == _HEX:
        return float.fromhex(v[1])
    return tuple(_from_constant(n) for n in v)


# What _traced reads, as names of this module: a module object (engine, torch) or class (Tensor)
# that dynamo reaches from two of our modules costs a guard evaluated in Python on every call of
# the compiled graph
_is_tensor = torch.is_tensor
_symbolic = symbolic
_environ_constant = _state.environ_get
_TRACED_VIEW = _state.TRACED_VIEW

#: the plans of the calls planned for a trace, as attributes named by token -- not a dict: dynamo
#: reads a dict's items once per trace, and a trace plans each of its calls after the first has
#: read them; an object's attribute is read when asked for
_TRACE_PLANS = types.SimpleNamespace()
_TRACE_TOKENS: dict[tuple, str] = {}
_tokens = iter(range(1 << 62))
_TRACE_LOCK = threading.Lock()


_GEN = _registry.GENERATION  # the registry's generation, as the keys hold it


def _clear_plans() -> None:
    """Every op's plans and the traced ones start afresh (:func:`normscope.engine.register_backend`):
    the keys take the registry's new generation (the plans of another thread's calls planned with
    the old registry and stored after this are never found), then the tables are emptied."""
    global _GEN
    _GEN = _registry.GENERATION
    for op in list(_OPS.values()):
        op.plans.clear()
        op.last = ((), None)
    with _TRACE_LOCK:
        _TRACE_TOKENS.clear()
        _TRACE_PLANS.__dict__.clear()


_registry.PLAN_TABLES.append(_clear_plans)


@_state.constant_when_compiled
def _trace_token(config: tuple, metas: tuple, request: str | None) -> str:
    """Run the op's checked call on stand-ins of the call's tensors with the engine capturing the
    plan of its dispatch instead of running it; the token names the :class:`Plan` (or None) among
    ``_TRACE_PLANS``' attributes. A call its checks refuse has no plan: the checked call is then
    traced and raises as an eager call does (raised here, dynamo would wrap it in its own exception
    type). Memoized; dynamo calls it once per trace and bakes the token in."""
    key = (config, metas, request, _registry.GENERATION)
    token = _TRACE_TOKENS.get(key)
    if token is None:
        name, constants, eps, _, flags = config
        eps, constants = _from_constant(eps), tuple(_from_constant(v) for v in constants)
        op = _OPS[name]
        settings = tuple.__new__(op.settings_type, constants)  # the fields by name, as the checked call reads them
        stand = [None if m is None else stand_in(*m) for m in metas]
        x, weight, bias = stand[:3]
        run = None if flags is None else running((stand[3], stand[4], 0.0, flags[1]))
        found = None
        # planned for the request the token is keyed by -- the thread's view, which the graph guards on --
        # not for this context's FORCED, which the planning reads here (capture() plans as for a traced
        # call, where compiling() is False) and which the view does not follow across a context switch
        # (an asyncio task, contextvars.copy_context().run): a graph guarded on 'rows' ran another backend
        forced = _state.FORCED.set(request)
        try:
            with engine.capture() as captured:
                try:
                    op.checked(settings, x, weight, bias, eps, run, None)
                except (ValueError, TypeError):  # the checks' errors: raised again by the traced checked call
                    captured.clear()
        finally:
            _state.FORCED.reset(forced)
        if len(captured) == 1 and _consumed(captured[0][0], x, weight, bias, run, traced=True):
            c, planned = captured[0]
            found = Plan(planned[0], engine.layer_entry(c, planned), c.eps)
        # Two threads may trace at once: the plan is stored before its token is published, and
        # under a lock, so that a token another thread reads always names a stored plan
        with _TRACE_LOCK:
            token = _TRACE_TOKENS.get(key)
            if token is None:
                if len(_TRACE_TOKENS) >= _MAX_PLANS:
                    _TRACE_TOKENS.clear()
                    _TRACE_PLANS.__dict__.clear()
                token = f"plan{next(_tokens)}"  # never reused: a graph guards on its plan
                setattr(_TRACE_PLANS, token, found)
                _TRACE_TOKENS[key] = token
    found = getattr(_TRACE_PLANS, token)
    if found is not None:
        # last_backend() names the backend the graph was traced with, from when it was traced: a
        # store traced into the graph would run on every call (measured ~4 % of a small compiled layer)
        _set_last(found.backend)
    return token
