"""The backends the engine knows, the automatic choice among them, and the plan of one call.

:mod:`normscope.backends` registers the built-in backends in their one declared order
(``AUTOMATIC_ORDER``); :func:`register_backend` adds one of a user's. Per call the first backend of
that order that can run the call exactly (``why_not``) and agrees to be chosen (``why_not_auto``)
runs it; a forced one runs or raises saying why (:func:`choose`). :func:`plan_call` is the whole
planning of one call: validate it once per signature, choose, prepare the runner.

Depends on :mod:`normscope._contract` and :mod:`normscope._state`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
import sys
import threading
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from . import reference as ref
from ._contract import ENV_VAR, Backend, Call, Runner
from ._state import FORCED, TRACED_VIEW, compiling, environ_get, tracing
from ._strides import laid_out, strides_like_channels_last

__all__ = [
    "BACKENDS",
    "AUTO",
    "PLANS",
    "MAX_PLANS",
    "PLAN_TABLES",
    "GENERATION",
    "clear_plans",
    "register_backend",
    "backends",
    "use_backend",
    "requested_backend",
    "check_backend_name",
    "signature",
    "validate",
    "choose",
    "prepare",
    "plan_call",
]

#: every registered backend by name
BACKENDS: dict[str, Backend] = {}
#: the automatic order (names of :data:`BACKENDS`)
AUTO: list[str] = []
#: the plans of eager calls by ``(signature, requested backend)`` (:func:`normscope.engine.plan`)
PLANS: dict[tuple, tuple[str, Runner]] = {}
#: a bound on each plan table, not a policy: past it a table starts afresh (real code has few)
MAX_PLANS = 4096
#: how each other table of plans or choices starts afresh (:mod:`normscope.hot`, the traced choices):
#: every plan reads the registry, so registering a backend empties them all
PLAN_TABLES: list[Callable[[], None]] = []
#: how many times the registry has changed. Every table of plans holds it in its keys, read before
#: the plan is made: a plan made by a thread while another registers a backend is stored under the
#: old generation, never found again -- emptying the tables alone leaves a window in which a call
#: planned with the old order stores its plan after they were emptied
GENERATION = 0
_LOCK = threading.Lock()  # one registration at a time


def register_backend(backend: Backend, *, before: str | None = None) -> None:
    """Add a backend to the automatic order: just ahead of ``before``, else last.

    :mod:`normscope.backends` registers the built-in ones in their order; use this for a backend
    of your own (it must keep the :class:`~normscope.engine.Backend` contract)."""
    with _LOCK:
        order = [n for n in AUTO if n != backend.name]
        at = order.index(before) if before is not None and before in order else len(order)
        order.insert(at, backend.name)
        BACKENDS[backend.name] = backend
        AUTO[:] = order  # one list operation: a reader sees the old order or the new one
        clear_plans()


def clear_plans() -> None:
    """Start every table of plans afresh: a new :data:`GENERATION` (called after the registry
    changed: a plan keyed by the new generation was made with the new registry), then the tables
    emptied, their plans of older generations never to be found again."""
    global GENERATION
    GENERATION += 1
    PLANS.clear()
    for clear in PLAN_TABLES:
        clear()


def backends() -> list[str]:
    """Names of the registered backends, in automatic order."""
    return list(AUTO)


def use_backend(name: str | None) -> _UseBackend:
    """Force a backend inside a ``with`` block (``None`` restores automatic choice).

    Per thread and asyncio task, as torch's grad mode. The object it returns may open several blocks,
    one after another or nested, as a ``torch.no_grad()`` object may: each ``with`` opens a block of
    its own; as a decorator, each call of the function runs in a block."""
    if name is not None:
        check_backend_name(name, "use_backend(name)")
    return _UseBackend(name)


#: the ``use_backend`` blocks open in this thread (or asyncio task), innermost last, as ``(object, block)``
_OPEN: contextvars.ContextVar[tuple] = contextvars.ContextVar("normscope_open_blocks", default=())


class _UseBackend(contextlib.ContextDecorator):
    """What :func:`use_backend` returns: a reusable context manager (a contextlib generator opens
    once; a second ``with`` raised AttributeError from contextlib)."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self._open: list[contextlib.AbstractContextManager] = []  # the blocks this object holds open

    def __enter__(self) -> None:
        block = _forcing(self.name)
        block.__enter__()
        self._open.append(block)
        if not compiling():  # dynamo traces no ContextVar.set; a trace is one thread's, in order
            _OPEN.set((*_OPEN.get(), (self, block)))

    def __exit__(self, *exc) -> bool | None:
        # the block this thread (or task) opened last with this object: one object shared by threads or
        # tasks (a module-level ``use_backend(...)``, a decorated function called from several threads)
        # holds blocks of each, and popping the last one opened anywhere closed another thread's block --
        # each then went back to the other's outer backend
        block = None
        if not compiling():
            stack = _OPEN.get()
            for i in range(len(stack) - 1, -1, -1):
                if stack[i][0] is self:
                    block = stack[i][1]
                    _OPEN.set(stack[:i] + stack[i + 1 :])
                    break
        if block is None:  # traced, or entered in another context (a generator resumed in another thread)
            block = self._open[-1]
        self._open.remove(block)
        return block.__exit__(*exc)

    def __call__(self, func: Callable) -> Callable:
        """As a decorator; a generator function's body runs in a block at each resumption (as
        torch.no_grad() does it), not only while the generator object is made -- the block closed
        before the body ever ran, which then ran on the automatic backend. Between resumptions the
        consumer's code runs with its own backend. A coroutine function's body runs in a block from
        its start to its return, across its awaits: the block is the running task's own (a context
        variable), so the tasks that run while it waits keep theirs."""
        if inspect.isasyncgenfunction(func):
            raise TypeError(
                f"use_backend({self.name!r}) cannot decorate the async generator function {func.__qualname__}: "
                "open a `with normscope.use_backend(...)` block inside its body instead"
            )
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def coroutine(*args, **kwargs):
                with self:
                    return await func(*args, **kwargs)

            return coroutine
        if not inspect.isgeneratorfunction(func):
            name = self.name

            @functools.wraps(func)
            def function(*args, **kwargs):
                # a block of an object made here, not ``with self`` (ContextDecorator's): dynamo traces
                # a block opened inside the code it compiles, and refuses one of an object made
                # outside it ("Unsupported context manager"), so a decorated function compiled with
                # fullgraph=True failed where one decorated by torch.no_grad() compiles
                with _UseBackend(name):
                    return func(*args, **kwargs)

            return function

        @functools.wraps(func)
        def generator(*args, **kwargs):
            gen = func(*args, **kwargs)
            try:
                with self:
                    response = gen.send(None)
                while True:
                    try:
                        request = yield response
                    except GeneratorExit:
                        with self:
                            gen.close()
                        raise
                    except BaseException:  # thrown in by the consumer: handed on to the body, in a block
                        with self:
                            response = gen.throw(*sys.exc_info()[1:2])
                    else:
                        with self:
                            response = gen.send(request)
            except StopIteration as e:
                return e.value

        return generator

    def __repr__(self) -> str:
        return f"use_backend({self.name!r})"


@contextlib.contextmanager
def _forcing(name: str | None) -> Iterator[None]:
    """One ``use_backend`` block (its name checked)."""
    if compiling():
        # a block inside code dynamo traces (a compiled function): dynamo cannot trace ContextVar.set (an
        # error under fullgraph=True), and a traced call reads the thread's view alone (requested_backend,
        # normscope.hot._traced), which dynamo follows as it traces and replays on every call of the graph
        previous = TRACED_VIEW.forced
        TRACED_VIEW.forced = name or "auto"
        try:
            yield
        finally:
            TRACED_VIEW.forced = previous
        return
    token = FORCED.set(name or "auto")
    TRACED_VIEW.forced = name or "auto"
    try:
        yield
    finally:
        # back to what this thread (or task) had on entry: another thread's blocks are its own
        try:
            FORCED.reset(token)
        except ValueError:
            # left in another context than it was entered in (a generator holding the block, resumed
            # in another thread or asyncio task), where reset() refuses the token: set back there the
            # value the block found on entry, as torch's grad-mode blocks do -- not raise from the exit
            FORCED.set(None if token.old_value is contextvars.Token.MISSING else token.old_value)
        TRACED_VIEW.forced = FORCED.get()


def check_backend_name(name: str, where: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{where}: expected a backend name (str), got {type(name).__name__} {name!r}")
    if name != "auto" and name not in BACKENDS:
        valid = ", ".join(["auto", *BACKENDS])
        raise ValueError(f"{where}: unknown backend {name!r}; expected one of: {valid}")


def requested_backend(backend: str | None = None) -> str:
    """The backend a call asks for: ``backend`` if given, else the innermost :func:`use_backend`,
    else ``NORMSCOPE_BACKEND``, else ``"auto"``."""
    if backend is not None:
        check_backend_name(backend, "backend")
        return backend
    forced = TRACED_VIEW.forced if compiling() else FORCED.get()
    if forced is not None:
        return forced
    env = environ_get()
    if env:
        check_backend_name(env, f"environment variable {ENV_VAR}")
        return env
    return "auto"


def _meta(t: Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.dtype, t.device)


def signature(call: Call) -> tuple:
    """What a backend's choice may depend on (see :class:`~normscope.engine.Backend`)."""
    r, res = call.running, call.residual
    return (
        call.scope,
        call.x.dtype,
        # the device itself, index included, as every other tensor's: validate compares them
        call.x.device,
        # which axes the mask broadcasts over (a per-position mask vs one that varies by channel)
        None if call.mask is None else (tuple(n == 1 for n in call.mask.shape), call.mask.device),
        None if r is None else (r.use_input_stats, r.mean is None, r.var is None),
        # shapes, not just presence: a plan is validated once per signature (see validate); dtypes
        # and devices too: the rows path takes only some weight dtypes, Llama's casting multiplies in
        # the promoted dtype, and validate checks the devices
        _meta(call.weight),
        _meta(call.bias),
        None if r is None else _meta(r.mean),
        None if r is None else _meta(r.var),
        None if res is None else (res.dtype, res.shape, res.device, call.residual_fp32),
        call.weight_offset,
        call.op,
        call.casting,
    )


def validate(call: Call) -> None:
    """What a backend may take for granted, checked once per signature (so never on the hot path):
    weight, bias and running statistics fit the scope's affine axes -- a kernel indexing a wrong-size
    buffer would read or write out of bounds -- and live on the input's device (the running statistics
    too: a kernel updates them in place)."""
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
    r_mean, r_var = (None, None) if r is None else (r.mean, r.var)
    tensors = (("weight", call.weight), ("bias", call.bias), ("residual", call.residual), ("mask", call.mask))
    for name, t in (*tensors, ("running.mean", r_mean), ("running.var", r_var)):
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


def choose(call: Call, name: str) -> str:
    """The backend that runs ``call`` when ``name`` is requested: the first of the automatic order
    that takes it (``"auto"``), else ``name`` itself; ValueError saying why when none can."""
    if name == "auto":
        reasons = {}
        for name in tuple(AUTO):  # a snapshot: another thread may register a backend meanwhile
            reasons[name] = _why_not(BACKENDS[name], call, True)
            if reasons[name] is None:
                return name
        why = "; ".join(f"{n}: {r}" for n, r in reasons.items())
        raise ValueError(f"no backend can run this normalization ({why})")
    reason = _why_not(BACKENDS[name], call, False)
    if reason is not None:
        raise ValueError(f"backend {name!r} cannot run this normalization: {reason}")
    return name


def prepare(name: str, call: Call, automatic: bool) -> tuple[str, Runner]:
    """``(name, runner)`` of backend ``name`` for ``call`` (an add_norm call on a backend that does
    not fuse the add: the add, then the backend's plain call). A CPU call of one large scope runs
    as a batch of two (:func:`_pairing`). The runner's output is laid out as torch.nn's namesake lays
    it out, whatever the backend (:func:`normscope._strides.output_layout`)."""
    pairing = _pairing(call)
    if pairing is not None:
        inner, alone = backend_runner(name, _pair(call), automatic), backend_runner(name, call, automatic)
        runner = _paired(inner, alone, lone=pairing == "lone")
    else:
        runner = backend_runner(name, call, automatic)
    # whichever backend ran, the output in the layout torch.nn's namesake returns (one rule, here)
    return name, laid_out(runner, call.scope, call.op, call.residual is not None)


def backend_runner(name: str, call: Call, automatic: bool) -> Runner:
    """Backend ``name``'s runner for ``call`` as it stands (no pairing): an add_norm call on a backend
    that does not fuse the add adds first, then runs the backend's plain call."""
    b = BACKENDS[name]
    if call.residual is None or b.fuses_residual:
        return b.prepare(call, automatic)
    return _adding(b.prepare(_plain(call), automatic))


#: ``at::internal::GRAIN_SIZE``. ATen's CPU reductions (TensorIterator) reduce a tensor into *one*
#: value from this many elements up in two passes split across the intra-op threads, where a
#: reduction into several values gives each value to one thread, whole (torch's fused BatchNorm and
#: GroupNorm kernels split a lone channel or group alike). So with two threads or more a scope alone
#: was summed in another order than the same scope among others, and got other bits -- in torch's
#: own rms_norm too (observed: RMSNorm(40000) fp32, ``torch.set_num_threads(2)``,
#: tests/backends/test_batch_invariance.py, "several intra-op threads").
SPLIT_ELEMENTS = 32768
_threads = torch.get_num_threads


def _pairing(call: Call) -> str | None:
    """Why ``call`` runs as a stride-0 pair of its sample, or None: a CPU call of a single scope
    whose first axis is a kept axis of size 1 (a batch of one), without running statistics (the
    buffers' update reads the batch), of :data:`SPLIT_ELEMENTS` elements or more (``"large"``) -- or,
    smaller, a lone group of channels (:func:`_lone_group`, ``"lone"``). Not while tracing: sizes may
    be symbolic, and the bits of a compiled graph are the compiler's."""
    s = call.scope
    if call.x.device.type != "cpu" or call.running is not None or not s.shape or s.shape[0] != 1:
        return None
    if 0 in s.reduce or 0 in s.affine or tracing():
        return None
    n = math.prod(s.shape)
    if s.count != n:
        return None
    if n >= SPLIT_ELEMENTS:
        return "large"
    # a masked call never runs ATen's GroupNorm: a lone masked group runs alone (the composite path
    # lays a stride-0 pair out otherwise than the sample)
    return "lone" if call.mask is None and _lone_group(s) else None


def _lone_group(s) -> bool:
    """Whether the single scope ``s`` of a sample is one group of several channels (GroupNorm(1, C),
    LayerNorm over (C, *) with a per-channel affine: ATen's group_norm). With several intra-op threads
    ATen's CPU GroupNorm backward computes the input gradient of a lone group (``N * G == 1``)
    in another order than the same group among others, at any size: observed with two threads,
    ``torch.nn.functional.group_norm(x, 1)`` on (1, 4, 30) fp32 and (1, 2, 30) fp64, input gradients
    1.5e-8 apart alone and in a batch (tests/backends/test_batch_invariance.py, "a lone group")."""
    return s.centered and len(s.shape) > 2 and s.shape[1] > 1 and s.form.sample_groups


def _input_grad(c: Call) -> bool:
    """Whether autograd records the input's gradient through this call."""
    return c.x.requires_grad and torch.is_grad_enabled()


def _pair(call: Call) -> Call:
    """``call`` on a stride-0 batch of two copies of its sample (no copy is made): every reduction
    then has two values, each reduced by one thread whole, as the scope is among other samples. The
    scope keeps its axes (the batch axis grows from 1 to 2), so every backend sees the same form."""
    s = call.scope
    shape = (2, *s.shape[1:])

    def two(t: Tensor | None) -> Tensor | None:
        # a tensor broadcast against x keeps its own shape (a mask one flag per position stays so):
        # only its batch axis, where it has one (of size 1, as x's), grows to 2
        if t is None or t.dim() < len(shape):
            return t
        return t.expand(2, *t.shape[1:])

    scope = type(s)(shape, s.reduce, s.centered, s.groups, s.group_dim, s.affine)
    return call._replace(x=two(call.x), scope=scope, mask=two(call.mask), residual=two(call.residual))


def _paired(inner: Runner, alone: Runner, lone: bool = False) -> Runner:
    """The runner of a call of one sample, on its pair (:func:`_pair`): the first of the pair's
    results (laid out as torch's by :func:`prepare`: the stride-0 pair has no layout); its gradient reaches the
    sample through the expand as ``g + 0``, the same bits. With one intra-op thread every reduction
    is one pass, whatever it reduces into: the sample alone (``alone``), half the work. ``lone``: paired
    only as a lone group (:func:`_lone_group`), whose order is ATen's contiguous GroupNorm kernel's
    backward's: where no input gradient is recorded (inference, a frozen input) the forward alone has the
    batch's bits, and runs alone at half the work; a channels_last sample (torch's own test of its
    strides, decided per call -- a plan serves every layout) runs the channels_last kernel alone as in
    a batch, and the stride-0 pair, which is not channels_last, would take it to the contiguous one."""

    def run(c: Call):
        if _threads() == 1 or lone and (strides_like_channels_last(c.x) or not _input_grad(c)):
            return alone(c)
        out = inner(_pair(c))
        if isinstance(out, tuple):  # add_norm: (y, h), h in x's channels_last layout where x has one
            fmt = ref.channels_last(c.x)
            return out[0][:1], out[1][:1] if fmt is None else out[1][:1].contiguous(memory_format=fmt)
        return out[:1]

    return run


def plan_call(call: Call, name: str) -> tuple[str, Runner]:
    """Validate ``call``, choose its backend for the request ``name`` and prepare the runner."""
    validate(call)
    return prepare(choose(call, name), call, name == "auto")


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
