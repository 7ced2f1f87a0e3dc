"""The layers' hot path: argument checks, scope resolution and planning once per input signature.

A layer's forward is the same Python work on every call with the same input shape, dtype and
device: the functional API checks the arguments, the scope is resolved on the shape, the engine
looks up the backend's runner. None of that changes between such calls, and at small shapes it
cost several times the ATen op itself (``benchmarks/cpu_overhead.py``). So the first call of a
signature goes the checked way (:mod:`normscope.functional`) and the layer remembers what it
resolved; later calls with the same signature run the plan's entry directly
(:func:`normscope.engine.layer_entry`: the runner, called with the call's tensors and ``eps``).

Two levels, both exact:

* **the layer's last call** (:func:`last`): the layer keeps, in its ``__dict__``, the plan of its
  last call with the input's shape, dtype and device, the requested backend and *the very tensors*
  (parameters, buffers) it ran with. A call matches when its input has the same signature, the same
  backend is requested and the layer holds the same tensor objects. The rest of the layer's
  configuration (``eps``, ``normalized_shape``, ``training``, ...) changes only through attribute
  assignment, ``_apply`` (``.to()``, ``.half()``, ...) or (un)registering, and each of those forgets
  the remembered call (:class:`HotLayer`). A parameter whose data is swapped in place (``p.data =
  ...``) keeps its identity: should its new shape, dtype or device not fit, the op refuses it, and a
  hot call that raises is re-run the checked way, which says why in the layer's terms.
* **the shared table** (:func:`shared`), for a layer whose calls alternate between signatures:
  keyed by everything the checks, the resolution and the plan read -- the layer's configuration,
  the input's and every tensor's shape, dtype and device, the requested backend.

Masked calls and non-tensor input always take the checked path. While dynamo traces
(torch.compile), :func:`shared` plans the call once, eagerly, on stand-ins of its tensors
(:func:`normscope.engine.traced_layer_plan`) and the layer runs the plan's entry: dynamo traces
and guards on that runner only, not on the checks and planning, whose guards made a compiled
layer measurably slower than torch.nn's.

Every line of :func:`last` runs on every call of every layer, where a small layer's whole budget is
a few microseconds and the ATen op itself takes ~6 (``benchmarks/cpu_overhead.py``), so it is written
for its cost: C-level calls only (``attrgetter``, ``map(operator.is_, ...)``), no key to hash. For the
same reason the layers read their tensors from ``_parameters``/``_buffers`` (:func:`direct`) rather
than through ``nn.Module.__getattr__``, a Python call each.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from .. import engine
from ..engine import _ENV_KEY
from ..engine import _forced as _FORCED

_is_compiling = torch.compiler.is_compiling
_sig = operator.attrgetter("shape", "dtype", "device")
_is = operator.is_
_SLOT = "_normscope_hot"  # in the layer's __dict__: (class, input signature, request, tensors, plan)
_environ_get = engine._ENV_DATA.get if engine._ENV_DATA is not None else lambda _: engine.request_key()
_TENSOR_NAMES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
_LAST = engine._last  # what engine.last_backend() answers


def direct(cls: type) -> bool:
    """Whether a layer of class ``cls`` may read its tensors from its ``_parameters``/``_buffers``
    dicts: no class in its MRO defines one of their names itself (a property of a subclass would
    shadow the dicts, as ``nn.Module.__getattr__`` is asked only when nothing else answers).
    :class:`HotLayer` stores the answer per class as ``_normscope_direct``. A name missing from the
    dicts (moved out by ``parametrize``, ``weight_norm``, pruning, FSDP) is read the usual way."""
    return not any(n in vars(c) for c in cls.__mro__ for n in _TENSOR_NAMES)


def last(layer: torch.nn.Module, x: object, *tensors: Tensor | None) -> engine.LayerPlan | None:
    """The :data:`~normscope.engine.LayerPlan` of the layer's last hot call when this call matches
    it (see the module docstring), else None; the layer runs its ``entry``. A hit is recorded as the
    call's backend (:func:`normscope.engine.last_backend`)."""
    if _is_compiling():  # first: dynamo folds it, and reads (guards on) nothing else here
        return None
    slot = layer.__dict__.get(_SLOT)
    if (
        slot is not None
        and isinstance(x, Tensor)
        and slot[1] == _sig(x)
        and slot[2] == (_FORCED[-1] if _FORCED else _environ_get(_ENV_KEY))  # engine.request_key(), inline
        and all(map(_is, slot[3], tensors))
        and slot[0] is type(layer)
    ):
        found = slot[4]
        _LAST[0] = found[1][0]  # the call's backend, for engine.last_backend(): a store, no call
        return found
    return None


def shared(layer: torch.nn.Module, config: tuple, x: object, *tensors: Tensor | None) -> tuple:
    """``(key, found)`` from the shared table: ``found`` as :func:`last` returns it (and then also
    the layer's last call), or None when the call must take the checked path -- afterwards
    :func:`remember` it under ``key`` (None: never remembered -- non-tensor input, tracing).

    ``config``: ``(checked, *settings)``: the layer's checked call, ``checked(config, x,
    *tensors)``, and everything it reads besides the tensors. While dynamo traces, ``found`` is
    planned by running that call on stand-ins (:func:`normscope.engine.traced_layer_plan`);
    ``checked=None``: the layer's checked path is traced instead."""
    if _is_compiling():
        return None, (None if config[0] is None else _traced(config, x, tensors))
    if not isinstance(x, Tensor):
        return None, None
    parts = [config, _sig(x), engine.request_key()]
    for t in tensors:  # a loop, not a comprehension: no extra frame (Python 3.11)
        parts.append(None if t is None else _sig(t))
    k = tuple(parts)
    try:
        found = engine.layer_plan(k)
    except TypeError:  # unhashable (symbolic sizes): the checked path
        return None, None
    if found is not None:
        _keep(layer, x, tensors, found)
        _LAST[0] = found[1][0]
    return k, found


def _traced(config: tuple, x: object, tensors: tuple) -> tuple | None:
    """:func:`shared`'s answer while dynamo traces: None (the checked path, traced) for symbolic
    sizes (dynamic shapes) or a non-tensor argument, which have no constant signature."""
    metas = []
    for t in (x, *tensors):
        if t is None:
            metas.append(None)
        elif _is_tensor(t) and not _symbolic(t.shape):
            metas.append((tuple(t.shape), t.dtype, t.device))
        else:
            return None
    request = _FORCED[-1] if _FORCED else _environ_constant()  # engine.request_key(), a constant to dynamo
    return _traced_layer_plan(config, tuple(metas), request)


# What _traced reads, as names of this module: a module object (engine, torch) or class (Tensor)
# that dynamo reaches from two of our modules costs a guard evaluated in Python on every call of
# the compiled graph (see normscope.engine.traced_layer_plan)
_is_tensor = torch.is_tensor
_symbolic = engine.symbolic
_environ_constant = engine._environ_get
_traced_layer_plan = engine.traced_layer_plan


def remember(layer: torch.nn.Module, k: tuple | None, call: engine.Call, *tensors: Tensor | None) -> None:
    """After a checked call has run: remember its resolved scope and plan under ``k`` (the shared
    table) and as the layer's last call."""
    if k is None:
        return
    found = engine.remember_layer_plan(k, call)
    if found is not None:
        _keep(layer, call.x, tensors, found)


def _keep(layer: torch.nn.Module, x: Tensor, tensors: tuple, found: tuple) -> None:
    layer.__dict__[_SLOT] = (type(layer), _sig(x), engine.request_key(), tensors, found)


def forget(layer: torch.nn.Module) -> None:
    """Drop the layer's last call (its configuration or tensors are changing)."""
    layer.__dict__.pop(_SLOT, None)


class HotLayer:
    """Mixin of the layers with a hot path: whatever can change their configuration or tensors
    forgets the last call (:func:`forget`), and their remembered plan (closures, not state) is left
    out of pickles and deep copies (the copy plans afresh on its first call)."""

    _normscope_direct = False

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        cls._normscope_direct = direct(cls)

    def __setattr__(self, name: str, value) -> None:
        forget(self)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        forget(self)
        super().__delattr__(name)

    def register_parameter(self, name: str, param) -> None:
        forget(self)
        super().register_parameter(name, param)

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        forget(self)
        super().register_buffer(name, tensor, persistent)

    def _apply(self, fn, recurse: bool = True):
        forget(self)
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        if _SLOT in state:
            state = dict(state)
            del state[_SLOT]
        return state


__all__ = ["direct", "last", "shared", "remember", "forget", "HotLayer"]
