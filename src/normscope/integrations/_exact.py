"""Which normscope configuration reproduces a model family's norm class bit for bit: the probe that
:mod:`normscope.integrations.transformers` patches by and :func:`normscope.doctor` reads a layer's casting
order from.

It sits below both: the patching module also holds the Trainer callback, which runs the doctor, so the
doctor could not import the probe from there without a circle.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .. import _state, hot
from .. import functional_modern as FM
from ..convert import first_gradient_differing
from ._probe import EPS_NAMES as _EPS_NAMES
from ._probe import eps_of as _eps
from ._probe import probe_input as _probe_input
from ._probe import randomized as _randomized


class Exact(NamedTuple):
    """A normscope configuration that reproduces a class: RMS (``centered=False``) or LayerNorm,
    the casting order and the weight offset (see :func:`normscope.functional_modern.rms_norm`)."""

    centered: bool
    casting: str
    weight_offset: float

    def __str__(self) -> str:
        kind = "layer_norm" if self.centered else "rms_norm"
        return f"{kind}(casting={self.casting!r}, weight_offset={self.weight_offset:g})"


#: the configurations a candidate class is probed against, in order (the first that matches wins)
CONFIGURATIONS: tuple[Exact, ...] = tuple(
    Exact(centered, casting, offset)
    for centered in (False, True)
    for casting, offset in (("llama", 0.0), ("gemma", 0.0), ("gemma", 1.0), ("torch", 0.0), ("llama", 1.0))
)


# -- probing ---------------------------------------------------------------------------------------

_PROBE_DIM = 64
# (weight dtype, input dtype): a model in fp32, in bf16, and a norm kept in fp32 in a bf16 model
_PROBE_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16))
# the other floating dtypes a model may be cast to after patching: probed once per class, and an input in one
# the configuration does not reproduce runs the original forward. The families' RMS norms upcast with
# ``.to(torch.float32)``, which rounds fp64 input *down*, while normscope computes fp64 in fp64
_OTHER_DTYPES = (torch.float16, torch.float64)


def _shape(m: nn.Module) -> tuple[int, ...] | None:
    """The normalized shape: ``normalized_shape`` (nn.LayerNorm subclasses), else the weight's,
    which must then be 1-D (a (H, D) weight over the last axis only, as Cohere's, is not a scope
    over its own shape)."""
    ns = getattr(m, "normalized_shape", None)
    if isinstance(ns, (tuple, list, torch.Size)) and all(isinstance(n, int) for n in ns):
        return tuple(ns)
    w = getattr(m, "weight", None)
    if isinstance(w, Tensor) and w.dim() == 1:
        return tuple(w.shape)
    return None


_MISSING = object()


def _attr(m: nn.Module, name: str) -> object:
    """``getattr(m, name, None)``, read from the instance's dicts where the name is in one of them:
    ``nn.Module.__getattr__`` is a Python call per name (and an AttributeError raised and caught for
    an absent one, a Llama norm's ``bias``) -- a measurable share of a small layer's call. Anything
    else (a property, a parametrization) is read the usual way."""
    d = m.__dict__
    for where in (d["_parameters"], d["_buffers"], d):
        v = where.get(name, _MISSING)
        if v is not _MISSING:
            return v
    return getattr(m, name, None) if hasattr(type(m), name) else None


def _run(m: nn.Module, x: Tensor, how: Exact, by_weight: tuple | None = None) -> Tensor:
    """``m``'s normalization on normscope: one call of the hot path (:mod:`normscope.hot`) with the
    configuration ``how`` names, planned once per call signature as every layer's is. What it reads
    of ``m`` -- weight, bias, eps, normalized shape -- is read on every call (a model may replace
    them), from the instance's dicts first (:func:`_attr`).

    The families' RMS modules keep no normalized shape, only a 1-D weight: theirs is the weight's,
    and the op of :func:`normscope.functional_modern.by_weight` takes it from there (the hot path
    compares the weight's shape on every call), so that their settings are ``how``'s alone
    (``by_weight``, :data:`_BY_WEIGHT`) and the call reads no more of the module than the weight
    and eps."""
    d = m.__dict__
    centered, casting, offset = how
    w = d["_parameters"].get("weight", _MISSING)
    eps = _MISSING
    for name in _EPS_NAMES:
        eps = d.get(name, _MISSING)
        if eps is not _MISSING:
            break
    if type(eps) is not float:  # an int, a property, a name of its own: read as the probe reads it
        eps = eps if isinstance(eps, int) and not isinstance(eps, bool) else _eps(m)
    # an RMS module whose normalized shape is its weight's: no shape read here (the checked call
    # refuses a weight that is not a 1-D tensor)
    by_weight_shape = not centered and w is not None and w is not _MISSING and "normalized_shape" not in d
    b = shape = None
    if not by_weight_shape:
        if w is _MISSING:
            w = _attr(m, "weight")
        w = w if isinstance(w, Tensor) else None
        if centered:  # an RMS configuration has no bias (the probe matched the module without one)
            b = _attr(m, "bias")
            b = b if isinstance(b, Tensor) else None
        ns = d.get("normalized_shape")
        if isinstance(ns, (tuple, torch.Size)):
            shape = tuple(ns)
        else:
            shape = tuple(w.shape) if w is not None and w.dim() == 1 else _shape(m)
    dense = None if x.is_contiguous() else _dense_order(x, 1 if by_weight_shape else len(shape))
    if dense is not None:  # a permuted view of a dense tensor: normalize that one, permute back
        x = x.permute(dense[0])
    # a weight offset's scale ``w + offset`` is formed by the plan's runner in every call, as the family's
    # module forms it (see normscope.RMSNorm.forward)
    if by_weight_shape:
        planned = by_weight if by_weight is not None else _by_weight(how)
    else:
        key = (centered, shape, offset, type(offset), casting)
        planned = _SETTINGS.get(key)
        if planned is None:
            if len(_SETTINGS) >= _MAX_SETTINGS:
                _SETTINGS.clear()
            planned = _SETTINGS[key] = FM.last_axes(centered, shape, None, offset, casting)
    y = hot.call(planned[0], planned[1], x, w, b, eps)
    return y if dense is None else y.permute(dense[1])


def _by_weight(how: Exact) -> tuple:
    """:func:`normscope.functional_modern.by_weight`'s op and settings for ``how`` (an RMS
    configuration), one per configuration."""
    found = _BY_WEIGHT.get(how)
    if found is None:
        found = _BY_WEIGHT[how] = FM.by_weight(False, None, how.weight_offset, how.casting)
    return found


def _dense_order(x: Tensor, k: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(order, inverse)``: the order of ``x``'s leading axes (all but the ``k`` normalized ones) in
    which ``x`` is a contiguous tensor, where that moves an axis, and its inverse permutation; else
    None. Remembered by shape and strides (a model's norms see a few), except while dynamo traces.

    Why: the families' modules are elementwise ops and a row reduction, whose output keeps the
    input's memory order; a query/key norm receives ``q.view(...).transpose(1, 2)`` (Gemma 3, OLMo 2).
    torch's fused ops copy such an input to a contiguous one first and return a contiguous output:
    a full copy more than the module (+35 % for Gemma 3's ``q_norm`` at 4 x 128 tokens, CPU) and an
    output in another memory order than the original's. Normalizing the dense tensor the view was
    made from and permuting the output back does neither, with every row's bits the same (a row's
    result depends on the row alone)."""
    stride = x.stride()
    key = (x.shape, stride, k)
    traced = _is_compiling()
    if not traced:
        found = _ORDERS.get(key, _MISSING)
        if found is not _MISSING:
            return found
    lead = x.dim() - k
    order = tuple(sorted(range(lead), key=lambda d: -stride[d])) if lead >= 2 else ()  # stable sort
    found = None
    if order and order != tuple(range(lead)):
        order += tuple(range(lead, x.dim()))
        if x.permute(order).is_contiguous():
            found = (order, tuple(sorted(range(len(order)), key=order.__getitem__)))
    if not traced:
        if len(_ORDERS) >= _MAX_SETTINGS:
            _ORDERS.clear()
        _ORDERS[key] = found
    return found


_is_compiling = _state.is_compiling  # torch.compiler.is_compiling() (see there)

#: :func:`_dense_order`'s answers by ``(shape, strides, k)``: what it computes from them alone
_ORDERS: dict[tuple, tuple | None] = {}


#: ``FM.last_axes``' answer by its arguments: a model calls its norms with a few shapes, and one
#: dict lookup is cheaper than the call (a Python frame a norm, 17 a Qwen3 layer stack at 1 x 8
#: tokens). The value is what last_axes returns for the key, never changed once stored
_SETTINGS: dict[tuple, tuple] = {}
_MAX_SETTINGS = 1024
#: :func:`normscope.functional_modern.by_weight`'s op and settings by ``how`` (a few configurations)
_BY_WEIGHT: dict[Exact, tuple] = {}


def _why_unfit(m: nn.Module, forward: Callable) -> str | None:
    """Why ``m`` cannot be expressed as one of :data:`CONFIGURATIONS`, by its structure; None if it may."""
    params = inspect.signature(forward).parameters
    positional = [p for p in params.values() if p.name != "self"]
    if len(positional) != 1 or positional[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        return f"forward takes {[p.name for p in positional]}, not one tensor (a gated or conditioned norm)"
    names = {n for n, _ in m.named_parameters(recurse=False)}
    if names - {"weight", "bias"} or list(m.children()):
        return f"parameters or submodules other than weight/bias ({sorted(names)}, {len(list(m.children()))} children)"
    if list(m.buffers(recurse=False)):
        return "has buffers"
    if _eps(m) is None:
        return f"no epsilon attribute ({', '.join(_EPS_NAMES)})"
    if _shape(m) is None:
        return "no 1-D weight or normalized_shape (the scope is not the weight's shape)"
    return None


def _agree(reference: Callable, m: nn.Module, x: Tensor, how: Exact) -> str | None:
    """None if ``how`` gives ``reference(m, x)``'s bits, else how it differs."""
    with torch.no_grad():
        expected = reference(m, x)
        got = _run(m, x, how)
    if not isinstance(expected, Tensor) or expected.shape != got.shape or expected.dtype != got.dtype:
        what = (
            type(expected).__name__ if not isinstance(expected, Tensor) else f"{expected.dtype} {tuple(expected.shape)}"
        )
        return f"output {what} instead of {got.dtype} {tuple(got.shape)}"
    if not torch.equal(expected, got):
        return f"differs by {(expected.double() - got.double()).abs().max().item():.3g}"
    # the gradients too (input and trainable weights, bit for bit): a patched layer trains as the
    # original does. Gemma 3n's RMSNorm gives the output's bits but takes ``pow(v, -0.5)``, whose
    # gradient rounds otherwise than ``rsqrt``'s (an input gradient 2.4e-7 apart in fp32, as far from
    # float64)
    g = torch.Generator().manual_seed(3)
    dy = torch.randn(tuple(expected.shape), generator=g).to(dtype=expected.dtype, device=expected.device)
    params = [(n, p) for n, p in m.named_parameters(recurse=False) if p.requires_grad]
    runs = [(lambda xi: reference(m, xi), params), (lambda xi: _run(m, xi, how), params)]
    name = first_gradient_differing(runs, x, dy)
    return None if name is None else f"differs in the gradient of {name}"


def _construct(cls: type) -> nn.Module:
    try:
        return cls(_PROBE_DIM, eps=1e-6)
    except TypeError:
        return cls(_PROBE_DIM)


def probe_class(cls: type) -> tuple[Exact | None, str | None]:
    """The configuration of :data:`CONFIGURATIONS` that reproduces ``cls`` bit for bit, or
    ``(None, why not)``. ``cls`` is built as ``cls(64, eps=1e-6)`` (or ``cls(64)``) with random
    weights and run on random input in fp32, in bf16, and with fp32 weights on bf16 input."""
    if not isinstance(cls, type):
        raise TypeError(f"probe_class: expected `cls` to be a class, got {type(cls).__name__}")
    cls = getattr(cls, "_normscope_original", cls)
    try:
        base = _construct(cls)
    except Exception as e:  # noqa: BLE001 -- any constructor failure is a reason not to patch, reported
        return None, f"cannot build it as {cls.__name__}({_PROBE_DIM}, eps=...): {type(e).__name__}: {e}"
    why = _why_unfit(base, cls.forward)
    if why is not None:
        return None, why
    has_bias = isinstance(getattr(base, "bias", None), Tensor)
    misses = []
    for how in CONFIGURATIONS:
        if has_bias and not how.centered:
            continue
        miss = None
        for wdtype, xdtype in _PROBE_DTYPES:
            m = _randomized(_construct(cls), wdtype)
            try:
                miss = _agree(cls.forward, m, _probe_input(_shape(m), xdtype, torch.device("cpu")), how)
            except Exception as e:  # noqa: BLE001 -- a probe that raises is a mismatch, reported
                miss = f"raised {type(e).__name__}: {e}"
            if miss is not None:
                misses.append(f"{how} {miss} for {wdtype} weights on {xdtype} input")
                break
        if miss is None:
            return how, None
    return None, "no normscope configuration reproduces it bit for bit (" + "; ".join(misses[:3]) + ")"
