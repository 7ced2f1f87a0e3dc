"""Model surgery: replace the normalization layers of any ``nn.Module`` in place.

model, report = normscope.convert(model)                       # torch.nn -> normscope, lossless
model, report = normscope.convert(model, to="torch")           # normscope -> torch.nn, lossless
model, report = normscope.convert(model, to="group:32", where=torch.nn.BatchNorm2d)
model, report = normscope.convert(model, to="dyt", where=lambda name, m: "encoder" in name)
print(report)

Lossless (``to=None`` / ``"normscope"`` and ``to="torch"``) means: the new layer has the old one's
configuration and holds the old one's **own tensor objects** -- every Parameter and buffer is moved,
not copied. So an optimizer (or a gradient hook, a weight tie, an EMA copy) built before the
conversion still acts on the model; each tensor keeps its dtype, device, ``requires_grad`` and
persistence (bf16 weights with fp32 running statistics stay so); a tensor set to None stays None
(a BatchNorm with ``running_mean=None`` normalizes with batch statistics in eval, as torch's does).
The module's hooks (forward, forward-pre, backward, state-dict and load-state-dict, with their
handles still removable), its train/eval mode, ``_version`` and its other public attributes move
too. A layer whose state cannot move without loss -- parametrized tensors
(``torch.nn.utils.parametrize``, ``weight_norm``, ``spectral_norm``), or a tensor the new layer has no
place for -- is refused with a ValueError before the model is touched. The old layer object shares
its tensors with the new one: drop it.

Layers that are not exactly torch.nn's -- a subclass, timm's ``LayerNorm2d``/``RmsNorm``/NormAct
layers, torchvision's ``FrozenBatchNorm2d`` -- are converted only to a normscope configuration that
gives their bits on a probe (a copy of the layer and of the candidate, on a sample of the layer's
input shape, in training and evaluation, in its dtype and in bf16); their child modules (a
NormAct's drop and activation) come along under the same names. A normalization-like layer that no
configuration reproduces stays as it is and is named in ``report.skipped`` with the reason: a
conversion never strips what a layer does, and never skips one silently.
"""

from __future__ import annotations

import inspect
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from . import _surgery
from ._surgery import HOOKS, bare_copy, channels, probe_input, sample, then
from .registry import NormSpec, _resolve_name, get_norm

# a converted NormAct layer saved whole (pickled) before its class came from _surgery names this function
_then = then

__all__ = ["convert", "Replacement", "Report", "Skipped"]


class Replacement(NamedTuple):
    """One replaced layer: its path in the model, the old and new layer (their reprs), the state
    entries carried over, and those of the old layer that the new one has no place for."""

    path: str
    source: str
    target: str
    carried: tuple[str, ...]
    dropped: tuple[str, ...]


class Skipped(NamedTuple):
    """A normalization-like layer left as it was: its path, its repr and why."""

    path: str
    source: str
    reason: str


def _at(path: str) -> str:
    # quoted: a module path such as "1" must not read as a list number
    return "the model itself" if not path else repr(path)


class Report(list):
    """The list of :class:`Replacement`; ``skipped`` lists every normalization-like layer left
    unconverted (:class:`Skipped`, with the reason). ``str(report)`` is a readable table."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.skipped: list[Skipped] = []

    def __str__(self) -> str:
        lines = [f"convert: {len(self)} layer(s) replaced" if self else "convert: no layer replaced"]
        for r in self:
            lines.append(f"  at {_at(r.path)}: {r.source} -> {r.target}")
            dropped = f"; dropped: {', '.join(r.dropped)}" if r.dropped else ""
            lines.append(f"      carried: {', '.join(r.carried) or '-'}{dropped}")
        if self.skipped:
            lines.append(f"convert: {len(self.skipped)} normalization-like layer(s) left as they are")
            lines += [f"  at {_at(s.path)}: {s.source}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


def _pairs() -> list[tuple[type, type]]:
    """(torch.nn class, its normscope namesake): the same constructor, parameters and buffers."""
    from . import modules as M

    return [
        (nn.BatchNorm1d, M.BatchNorm1d),
        (nn.BatchNorm2d, M.BatchNorm2d),
        (nn.BatchNorm3d, M.BatchNorm3d),
        (nn.InstanceNorm1d, M.InstanceNorm1d),
        (nn.InstanceNorm2d, M.InstanceNorm2d),
        (nn.InstanceNorm3d, M.InstanceNorm3d),
        (nn.LayerNorm, M.LayerNorm),
        (nn.RMSNorm, M.RMSNorm),
        (nn.GroupNorm, M.GroupNorm),
        (nn.LocalResponseNorm, M.LocalResponseNorm),
        (nn.SyncBatchNorm, M.SyncBatchNorm),
    ]


def _builder(cls: type) -> Callable[[nn.Module], nn.Module]:
    """A builder of ``cls`` with the configuration of a layer of its namesake (either direction).

    Built on the meta device: every tensor is replaced by the old layer's own (:func:`_move`)."""
    # torch >= 2.13 can drop the bias alone (keyword-only ``bias=False``); passed only then, as the
    # torch versions before it take no such keyword
    nobias = lambda m, affine: {"bias": False} if affine and getattr(m, "bias", 0) is None else {}  # noqa: E731
    meta = {"device": "meta"}
    if issubclass(cls, nn.SyncBatchNorm) or cls.__name__ == "SyncBatchNorm":
        return lambda m: cls(
            m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats, m.process_group,
            **nobias(m, m.affine), **meta,
        )  # fmt: skip
    if issubclass(cls, nn.modules.batchnorm._NormBase):  # BatchNorm*d, InstanceNorm*d
        return lambda m: cls(
            m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats, **nobias(m, m.affine), **meta
        )
    if issubclass(cls, nn.LayerNorm):
        return lambda m: cls(m.normalized_shape, m.eps, m.elementwise_affine, m.bias is not None, **meta)
    if issubclass(cls, nn.RMSNorm):
        return lambda m: cls(m.normalized_shape, m.eps, m.elementwise_affine, **meta)
    if issubclass(cls, nn.GroupNorm):
        return lambda m: cls(m.num_groups, m.num_channels, m.eps, m.affine, **nobias(m, m.affine), **meta)
    if issubclass(cls, nn.LocalResponseNorm):
        return lambda m: cls(m.size, m.alpha, m.beta, m.k)
    raise AssertionError(f"convert: no builder for {cls.__name__}")  # the table above is closed


def _namesakes(reverse: bool = False) -> dict[type, Callable[[nn.Module], nn.Module]]:
    """Exact torch.nn type -> builder of the normscope layer with the same configuration, or
    (``reverse``) exact normscope type -> builder of the torch.nn layer."""
    return {(ns if reverse else tn): _builder(tn if reverse else ns) for tn, ns in _pairs()}


def _norm_types() -> tuple[type, ...]:
    from . import modules as M

    return (
        nn.modules.batchnorm._NormBase,  # BatchNorm*, InstanceNorm*, SyncBatchNorm, BatchRenorm*
        nn.LayerNorm,  # and LayerNorm2d
        nn.GroupNorm,
        nn.RMSNorm,
        nn.LocalResponseNorm,
        M.FrozenBatchNorm2d,
        M.PowerNorm,
        M.DyT,
        M.AdaLayerNorm,
        M.QKNorm,
        M.PolyNorm,
        M.Derf,
    )


# a class named like a norm is one (timm's RmsNorm, LayerNorm2d, BatchNormAct2d, torchvision's
# FrozenBatchNorm2d, diffusers' RMSNorm and AdaLayerNormZero), unless the name says it holds one
# beside other layers (timm's ConvNormAct, LeViT's LinearNorm, NormMlpClassifierHead)
_NORM_NAME = re.compile(r"Norm(?!ali[sz])")
_HOLDER_NAME = re.compile(
    r"Conv|Linear|Head|Block|Mlp|MLP|Attention|Stage|Stem|Model|Encoder|Decoder|Transformer|Embed|Net(?![a-z])"
)
_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


def _norm_like(m: nn.Module) -> bool:
    """Whether ``m`` is a normalization layer: one of the norm types torch and normscope know, or a
    class named like one (the zoos' own norms subclass nothing in common)."""
    if isinstance(m, _norm_types()):
        return True
    if type(m).__module__ == "torch.nn.utils.parametrizations":  # _WeightNorm, _SpectralNorm: weight maps, no layer
        return False
    name = type(m).__name__
    return bool(_NORM_NAME.search(name)) and not _HOLDER_NAME.search(name)


def _is_normscope(m: nn.Module) -> bool:
    return type(m).__module__.split(".")[0] == "normscope"


def _eps(m: nn.Module) -> float | None:
    for attr in _EPS_NAMES:
        v = getattr(m, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _predicate(where: Any) -> Callable[[str, nn.Module], bool]:
    if where is None:
        return lambda name, m: _norm_like(m)
    if isinstance(where, type) or (isinstance(where, tuple) and all(isinstance(t, type) for t in where)):
        return lambda name, m: isinstance(m, where)
    if callable(where):
        try:
            nargs = len(inspect.signature(where).parameters)
        except (TypeError, ValueError):
            nargs = 2
        return where if nargs >= 2 else (lambda name, m: where(m))
    raise TypeError(
        f"convert: expected `where` to be None, a type, a tuple of types or a predicate, got {type(where).__name__}"
    )


# -- layers that are not exactly torch.nn's: configurations found by probing ------------------------


class _Candidate(NamedTuple):
    """A normscope configuration that may reproduce a layer: how to build it from the layer (on the
    meta device; the layer's own tensors move in) and an input shape to probe it on."""

    label: str
    build: Callable[[nn.Module], nn.Module]
    sample: tuple[int, ...]


def _candidates(m: nn.Module) -> list[_Candidate]:
    """The normscope configurations to probe for a layer that is not exactly a torch.nn norm: the
    namesake of its torch.nn base class, the channels-first LayerNorm (timm's and torchvision's
    ``LayerNorm2d``), the families' casting orders (timm's ``*Fp32`` norms, ``RmsNorm``), and
    :class:`FrozenBatchNorm2d` for torchvision's. A layer with child modules (timm's NormAct: drop,
    then activation) is probed as the norm followed by those same modules."""
    from . import modules as M

    found: list[_Candidate] = []
    bases = [t for t, _ in _pairs() if isinstance(m, t)]
    c, eps = channels(m), _eps(m)
    w, b = getattr(m, "weight", None), getattr(m, "bias", None)
    if bases:
        base = bases[-1]  # the most derived: SyncBatchNorm before BatchNorm's base
        ns = dict((t, n) for t, n in _pairs())[base]
        found.append(_Candidate(f"{ns.__name__} (its torch.nn base {base.__name__})", _builder(ns), sample(base, m)))
        if base is nn.LayerNorm:
            found.append(_Candidate(
                "LayerNorm(casting='gemma'): normalized and scaled in fp32",
                lambda m: M.LayerNorm(m.normalized_shape, m.eps, m.elementwise_affine, m.bias is not None,
                                      device="meta", casting="gemma"),
                sample(base, m),
            ))  # fmt: skip
    elif c is not None and eps is not None:
        names = set(m._parameters) | set(m._buffers)
        if {"weight", "bias", "running_mean", "running_var"} <= set(m._buffers):
            for fold in (False, True):
                found.append(_Candidate(
                    f"FrozenBatchNorm2d(fold={fold})",
                    lambda m, f=fold: M.FrozenBatchNorm2d(c, eps, device="meta", fold=f),
                    (2, c, 3, 5),
                ))  # fmt: skip
        elif names <= {"weight", "bias"} and (w is None or isinstance(w, nn.Parameter)):
            shape = tuple(getattr(m, "normalized_shape", None) or (c,))
            affine = isinstance(w, torch.Tensor)
            if isinstance(b, torch.Tensor):
                for casting in ("torch", "gemma"):
                    found.append(_Candidate(
                        f"LayerNorm(casting={casting!r})",
                        lambda m, k=casting: M.LayerNorm(shape, eps, affine, True, device="meta", casting=k),
                        (3, 5, *shape),
                    ))  # fmt: skip
            else:
                for casting in ("torch", "llama", "gemma"):
                    found.append(_Candidate(
                        f"RMSNorm(casting={casting!r})",
                        lambda m, k=casting: M.RMSNorm(shape, eps, affine, device="meta", casting=k),
                        (3, 5, *shape),
                    ))  # fmt: skip
    if c is not None and eps is not None and isinstance(w, torch.Tensor) and isinstance(b, torch.Tensor):
        if isinstance(m, nn.LayerNorm) or not bases:
            found.append(_Candidate(
                "LayerNorm2d (channels first)", lambda m: M.LayerNorm2d(c, eps, device="meta"), (2, c, 3, 5)
            ))  # fmt: skip
    if m._modules:
        found = [_Candidate(f"{k.label} then {', '.join(m._modules)}", _then_built(k.build), k.sample) for k in found]
    return found


def _then_built(build: Callable[[nn.Module], nn.Module]) -> Callable[[nn.Module], nn.Module]:
    def make(m: nn.Module) -> nn.Module:
        new = build(m)
        # a lossless conversion: the converted class stays a base (not for a layer of another kind, other_layer)
        new.__class__ = then(type(new), type(m))
        return new

    return make


def _same_draws(forward: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Any:
    """``forward(x)`` with the random generators seeded alike for every call and restored after: a layer
    that draws (timm's NormAct with a ``drop_layer``: Dropout, DropBlock in training) is compared on the
    same draws as its candidate, and a probe leaves the caller's random state as it found it."""
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        return forward(x)


def _probe(old: nn.Module, cand: _Candidate) -> str | None:
    """Build ``cand`` from a copy of ``old`` and compare the two bit for bit on a sample input, in
    training and in evaluation (outputs and running statistics; in training the gradients of the input
    and the parameters too), in the layer's dtype and with both cast to bf16.
    None if they agree, else how they differ."""
    src = bare_copy(old)
    try:
        new = cand.build(src)
    except (TypeError, ValueError, AttributeError) as e:
        return f"{cand.label} cannot be built from it ({type(e).__name__}: {e})"
    for kind in ("_parameters", "_buffers"):
        if set(getattr(src, kind)) != set(getattr(new, kind)):
            have, want = sorted(getattr(src, kind)), sorted(getattr(new, kind))
            return f"{cand.label} holds {kind[1:]} {want}, the layer {have}"
    _move("", src, new, only_missing=True)
    ref = bare_copy(old)
    t = _reference_tensor(old)
    device = t.device if t is not None else torch.device("cpu")
    dtype = t.dtype if t is not None and t.is_floating_point() else torch.float32
    compared = 0
    with torch.no_grad():
        # in the layer's dtype, then the layer cast to bf16 (a model run in bf16)
        for xdtype in dict.fromkeys((dtype, torch.bfloat16)):
            if xdtype != dtype:
                ref, new = ref.to(xdtype), new.to(xdtype)
            for training in (True, False):
                ref.train(training), new.train(training)
                x = probe_input(cand.sample, xdtype, device)
                try:
                    want = _same_draws(ref, x)
                except Exception:  # noqa: BLE001 -- the layer itself refuses this input: nothing to compare
                    continue
                try:
                    got = _same_draws(new, x)
                except Exception as e:  # noqa: BLE001 -- a candidate that raises where the layer runs is a miss
                    return f"{cand.label} raised {type(e).__name__} on {xdtype} input where the layer runs"
                mode = "training" if training else "evaluation"
                if not isinstance(want, torch.Tensor) or want.dtype != got.dtype or want.shape != got.shape:
                    return f"{cand.label} returns {got.dtype} {tuple(got.shape)} in {mode}, the layer does not"
                if not torch.equal(want, got):
                    diff = (want.double() - got.double()).abs().max().item()
                    return f"{cand.label} differs by {diff:.3g} on {xdtype} input in {mode}"
                for (name, a), (_, b) in zip(ref.named_buffers(recurse=False), new.named_buffers(recurse=False)):
                    if not torch.equal(a, b):
                        return f"{cand.label} updates {name} differently in {mode}"
                if training and xdtype.is_floating_point:
                    why = _grads_differ(ref, new, x)
                    if why is not None:
                        return f"{cand.label} differs in the gradient of {why} on {xdtype} input"
                compared += 1
    if not compared:
        return f"the layer raised on every probe input (shape {cand.sample})"
    return None


def _grads_differ(ref: nn.Module, new: nn.Module, x: torch.Tensor) -> str | None:
    """The first gradient (of the input, or of a parameter by name) in which ``new`` differs from ``ref``
    in a training step on ``x``, else None: a conversion keeps the layer's training too. timm's
    ``LayerNormFp32`` in a bf16 model normalizes in fp32, and torch's LayerNorm on the bf16 tensors gives
    its output bits but bf16 weight and bias gradients ~8x further from float64 (0.22 vs 0.027)."""
    dy = probe_input(tuple(x.shape), x.dtype, x.device).flip(-1)
    runs = [(m, [(n, p) for n, p in m.named_parameters() if p.requires_grad]) for m in (ref, new)]
    return first_gradient_differing(runs, x, dy)


def first_gradient_differing(
    runs: list[tuple[Callable[[torch.Tensor], torch.Tensor], list[tuple[str, torch.Tensor]]]],
    x: torch.Tensor,
    dy: torch.Tensor,
) -> str | None:
    """Two training steps compared bit for bit: ``runs`` holds two ``(forward, named parameters)``, each
    forward is run on a fresh copy of ``x`` requiring grad and differentiated with ``dy``; returns
    ``"input"`` or the parameter's name where the first run's gradient differs from the second's (or
    one of them has none), else None. A replacement layer -- a conversion, a patched class -- is
    accepted only where its training is the original's too."""
    found = []
    with torch.inference_mode(False), torch.enable_grad():
        for forward, named in runs:
            xi = x.detach().clone().requires_grad_()
            grads = torch.autograd.grad(_same_draws(forward, xi), [xi] + [p for _, p in named], dy, allow_unused=True)
            found.append(dict(zip(["input"] + [n for n, _ in named], grads)))
    want, got = found
    for name, a in want.items():
        b = got.get(name)
        if (a is None) != (b is None) or a is not None and not torch.equal(a, b):
            return name
    return None


def _exact_config(old: nn.Module, kind: type | None = None) -> tuple[_Candidate | None, str]:
    """The first candidate configuration that reproduces ``old`` bit for bit, or ``(None, why not)``;
    ``kind``: among those that build a layer of that normscope class only (:func:`_kind`)."""
    cands = _candidates(old)
    if kind is not None:
        cands = [cand for cand in cands if _builds(cand, old) is kind]
    if not cands:
        return None, "no normscope configuration applies (no channel count or eps attribute to build one from)"
    misses = []
    for cand in cands:
        why = _probe(old, cand)
        if why is None:
            return cand, ""
        misses.append(why)
    return None, "no normscope configuration reproduces it bit for bit: " + "; ".join(misses[:3])


def _kind(cls: type) -> type:
    """The layer class a conversion's class is: itself, or the one a :func:`then` class runs before its
    child modules (the classes made here are the only ones of this module in its method order)."""
    return next(c for c in cls.__mro__ if c.__module__ != _surgery.__name__)


def _builds(cand: _Candidate, m: nn.Module) -> type | None:
    """The layer class (:func:`_kind`) ``cand`` builds for ``m`` (on the meta device; ``m`` is only read),
    or None where it cannot be built from it."""
    try:
        return _kind(type(cand.build(m)))
    except (TypeError, ValueError, AttributeError):
        return None


# the constructor arguments that size a layer: convert passes the old layer's channel count there, not a
# setting of the spec's
_SIZES = frozenset(("num_features", "num_channels", "normalized_shape"))
_ABSENT = object()  # a setting a layer does not keep as an attribute


def _agrees(layer: nn.Module, new: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether ``layer`` has every setting that ``new`` -- what ``to`` builds, with ``kwargs`` -- was given:
    the caller's keywords, and each constructor argument the spec set away from the constructor's default
    (``"group"``'s number of groups, timm's eps). A setting no one gave (a default: ``fold``, ``casting``,
    ``track_running_stats``) is ``layer``'s; the channel count is the old layer's anyway, and so are the
    device and dtype (a layer of another kind takes them from the old one's weights too)."""
    for name, p in inspect.signature(type(new).__init__).parameters.items():
        if name in ("self", "device", "dtype") or name in _SIZES or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        value = getattr(new, name, _ABSENT)
        if value is _ABSENT:  # not kept as such: only a keyword can say what it was asked to be
            if name in kwargs:
                return False
            continue
        if isinstance(value, torch.Tensor) or (value is None and isinstance(p.default, bool)):
            # a bool option kept as a tensor or None (``bias``; None too when ``affine=False``): state
            if name in kwargs and (getattr(layer, name, None) is not None) != bool(kwargs[name]):
                return False
            continue
        given = name in kwargs or p.default is p.empty or value != p.default
        if given and getattr(layer, name, _ABSENT) != value:
            return False
    return True


def _same_kind(old: nn.Module, new: nn.Module, kwargs: dict[str, Any]) -> tuple[nn.Module, bool] | None:
    """The lossless conversion of ``old`` where ``to`` asks for the kind of layer ``old`` already is: the
    layer ``to`` built (``new``, before its tensors come) is of the class the lossless conversion builds, and
    agrees with it on every setting it was given (:func:`_agrees`). ``(layer, keep_source)``: the lossless
    layer (``old`` itself where it is that normscope layer already) and whether ``old`` is kept for
    ``to="torch"``; None otherwise.

    Asked for the layer it is, a layer keeps its numbers: built anew from the spec, it lost what the probe
    had found -- torchvision's FrozenBatchNorm2d folded (2e-6 off), timm's ``LayerNormFp32`` with its fp32
    gradients -- and what the spec does not carry (``track_running_stats=False``, a LayerNorm over two axes).
    """
    kind = type(new)
    if _parametrized(old):
        return None
    if _is_normscope(old):
        return (old, False) if _kind(type(old)) is kind and _agrees(old, new, kwargs) else None
    make = _namesakes().get(type(old))
    if make is not None:
        built, keep_source = make(old), False
    else:
        cand, _ = _exact_config(old, kind)
        if cand is None:
            return None
        built, keep_source = cand.build(old), True
    if _kind(type(built)) is not kind or not _agrees(built, new, kwargs):
        return None
    for slot in ("_parameters", "_buffers"):  # weight_norm's hook renamed the weight: not that layer's state
        if set(getattr(old, slot)) != set(getattr(built, slot)):
            return None
    return built, keep_source


def _move_hooks(old: nn.Module, new: nn.Module) -> None:
    """The old layer's hooks onto the new one. The dicts themselves move when the new layer has no
    hook of its own (always, for the built-in layers), so the user's RemovableHandles still remove them."""
    for attr in HOOKS:
        mine, theirs = getattr(new, attr, None), getattr(old, attr, None)
        if not isinstance(theirs, dict) or not theirs:
            continue
        if not mine:
            setattr(new, attr, theirs)
        else:
            # the new layer's own hooks first, then the old ones (their handles hold the old layer's dicts)
            setattr(new, attr, OrderedDict([*mine.items(), *theirs.items()]))
    if getattr(old, "_is_full_backward_hook", None) is not None:
        new._is_full_backward_hook = old._is_full_backward_hook


def _state_names(m: nn.Module) -> list[str]:
    """What ``state_dict`` would hold, without running its hooks: parameters, then persistent buffers."""
    bufs = [k for k, v in m._buffers.items() if v is not None and k not in m._non_persistent_buffers_set]
    return [k for k, v in m._parameters.items() if v is not None] + bufs


def _refuse_unmovable(path: str, old: nn.Module, new: nn.Module) -> None:
    from torch.nn.utils import parametrize

    where = f"convert: {path or '<root>'} ({type(old).__name__})"
    if parametrize.is_parametrized(old):
        names = ", ".join(old.parametrizations.keys())
        raise ValueError(
            f"{where} has parametrized tensors ({names}; torch.nn.utils.parametrize, e.g. weight_norm or "
            "spectral_norm): a lossless conversion cannot carry them. Remove them first "
            "(parametrize.remove_parametrizations(layer, name, leave_parametrized=True)) or leave this layer "
            "out with `where=`"
        )
    for kind, label in (("_parameters", "parameters"), ("_buffers", "buffers")):
        have, want = set(getattr(old, kind)), set(getattr(new, kind))
        if have != want:
            # torch.nn.utils.weight_norm / spectral_norm work by a forward pre-hook that renames the weight
            by_hook = {"WeightNorm": "weight_norm", "SpectralNorm": "spectral_norm"}
            found = [by_hook[type(h).__name__] for h in old._forward_pre_hooks.values() if type(h).__name__ in by_hook]
            hint = f" (torch.nn.utils.{found[0]} is applied: remove it first)" if found else ""
            raise ValueError(
                f"{where}: expected {label} {sorted(want)} for a lossless conversion to {type(new).__name__}, "
                f"got {sorted(have)}{hint}; leave this layer out with `where=`"
            )


def _move(
    path: str, old: nn.Module, new: nn.Module, *, only_missing: bool = False
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Lossless: the old layer's own Parameter and buffer objects (and None entries) and its child
    modules (a NormAct's drop and activation) into ``new``. ``only_missing``: of the old layer's
    public attributes, only those ``new`` lacks (a layer of another class configures ``new`` by
    its constructor; its own attributes may mean something else)."""
    _refuse_unmovable(path, old, new)
    for name, p in old._parameters.items():
        new.register_parameter(name, p)
    for name, b in old._buffers.items():
        new.register_buffer(name, b, persistent=name not in old._non_persistent_buffers_set)
    for name, child in old._modules.items():
        new.add_module(name, child)
    for name, value in vars(old).items():  # configuration changed after construction, user attributes
        if not name.startswith("_") and name != "training" and not (only_missing and hasattr(new, name)):
            setattr(new, name, value)
    if "_version" in vars(old):
        new._version = old._version
    return tuple(_state_names(old)), ()


def _carry(old: nn.Module, new: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Another layer kind: each entry with the same name, slot (parameter or buffer) and shape moves
    (the same object: dtype, requires_grad and optimizers follow); same name and shape in another slot
    is copied; the rest is dropped."""
    carried, dropped = [], []
    with torch.no_grad():
        for key in _state_names(old):
            is_param = key in old._parameters
            value = old._parameters[key] if is_param else old._buffers[key]
            slot = new._parameters if is_param else new._buffers
            target = new._parameters.get(key, new._buffers.get(key))
            if target is None or target.shape != value.shape:
                dropped.append(key)
            elif key in slot:
                if is_param:
                    new.register_parameter(key, value)
                else:
                    new.register_buffer(key, value, persistent=key not in new._non_persistent_buffers_set)
                carried.append(key)
            else:
                target.copy_(value)
                carried.append(key)
    return tuple(carried), tuple(dropped)


def _reverse_builder(make: Callable[[nn.Module], nn.Module]) -> Callable[[nn.Module], nn.Module]:
    def build(m: nn.Module) -> nn.Module:
        if getattr(m, "channel_dim", 1) != 1:
            raise ValueError(
                f"convert: to='torch': expected a {type(m).__name__} with channel_dim=1 (torch.nn has no other "
                f"channel axis), got channel_dim={m.channel_dim}; leave this layer out with `where=`"
            )
        # torch.nn's LayerNorm/RMSNorm scale by the weight alone and round as casting="torch": the
        # namesake of a layer with another weight_offset or casting would compute another function
        offset, casting = getattr(m, "weight_offset", 0.0), getattr(m, "casting", "torch")
        if offset != 0.0 or casting != "torch":
            raise ValueError(
                f"convert: to='torch': expected a {type(m).__name__} with weight_offset=0.0 and casting='torch' "
                f"(torch.nn has no other), got weight_offset={offset} and casting={casting!r}; leave this layer "
                "out with `where=`"
            )
        return make(m)

    return build


def _parametrized(m: nn.Module) -> bool:
    from torch.nn.utils import parametrize

    return parametrize.is_parametrized(m)


# the layer a lossless conversion replaced, kept (outside ``_modules``: no state_dict entry) on the
# normscope layer that holds its tensors, so that ``to="torch"`` gives back the zoo's own class
_SOURCE = "_normscope_source"


def _options(old: nn.Module, cls: type) -> dict[str, Any]:
    """The old layer's eps, momentum and affine settings, as far as ``cls``'s constructor takes them."""
    params = inspect.signature(cls.__init__).parameters
    out: dict[str, Any] = {}
    eps = _eps(old)
    if eps is not None and "eps" in params:
        out["eps"] = eps
    momentum = getattr(old, "momentum", 0.0)
    if "momentum" in params and (momentum is None or isinstance(momentum, float)):
        out["momentum"] = momentum
    if "weight" in old._parameters and old.weight is None:  # affine=False / elementwise_affine=False
        out.update({key: False for key in ("affine", "elementwise_affine") if key in params})
    return out


def convert(
    model: nn.Module,
    to: NormSpec | None = None,
    where: type | tuple[type, ...] | Callable[..., bool] | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, Report]:
    """Replace normalization layers of ``model`` in place, carrying their state.

    A layer is replaced only by a configuration that reproduces it: torch.nn's own norms by their
    normscope namesakes; any other norm (a subclass, timm's ``LayerNorm2d``/``RmsNorm``/NormAct
    layers, torchvision's ``FrozenBatchNorm2d``) by the first normscope configuration that gives
    its bits on a probe (training and evaluation, its dtype and bf16), with its child modules (a
    NormAct's drop and activation) kept under the same names. Every normalization-like layer left
    as it was is named in ``report.skipped`` with the reason.

    Args:
        model: any module.
        to: ``None`` (or ``"normscope"``): every norm layer becomes the normscope layer that
            reproduces it, with the same configuration and state -- lossless (module docstring): the
            same tensor objects, hooks and mode; outputs are identical. ``"torch"``: the reverse, every
            normscope layer with a torch.nn namesake becomes it, and a layer converted from another
            class becomes that layer again, as losslessly (a BatchNorm1d with ``channel_dim=-1``, a
            LayerNorm/RMSNorm with a ``weight_offset`` or a ``casting`` other than ``"torch"`` is
            refused: torch has no such layer). Otherwise a :func:`normscope.get_norm` spec
            (``"group:32"``, ``"layer2d"``, ``"frozen"``, a class, a partial), built with the old
            layer's channel count, its eps, momentum and affine setting where the new layer takes
            them, and ``**kwargs`` (which win); the state entries that fit move as objects (dtype and
            ``requires_grad`` kept), the hooks move too. A layer that does more than normalize (a
            NormAct: norm, drop, activation) keeps its extra modules after the new norm, when a probe
            shows that is what it does; otherwise it is skipped. A spec for the kind of layer the
            old one already is (``"frozen"`` on torchvision's ``FrozenBatchNorm2d``, ``"batch"`` on a
            BatchNorm2d) converts it as ``to=None`` does, its numbers and configuration kept, unless
            the spec or ``**kwargs`` set something else (``"group:2"`` on a ``GroupNorm(3, C)``).
        where: which layers to replace: a type or tuple of types (``isinstance``), or a predicate
            ``f(module)`` or ``f(path, module)``. Default: every normalization layer (torch.nn's,
            normscope's, and any module whose class is named like a norm).
        **kwargs: constructor arguments for ``to``.

    Returns:
        ``(model, report)``: the same model (the new layer itself when ``model`` is a norm layer)
        and a :class:`Report` listing each replaced path, old -> new, and which state entries
        (parameters and buffers with the same name and shape) were carried or dropped, and in
        ``report.skipped`` every normalization-like layer left as it was, with why. The new
        layer gets the old one's train/eval mode; a layer of another kind takes the device and
        floating dtype of the old one's weights for what it does not carry.

    Raises:
        ValueError: a lossless conversion that would lose something (parametrized tensors, a
            tensor the new layer has no place for), before the model is touched.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        >>> model, report = normscope.convert(model, to="group:4")
        >>> type(model[1]).__name__, len(report)
        ('GroupNorm', 1)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    lossless = to is None or (isinstance(to, str) and to in ("normscope", "torch"))
    reverse = to == "torch"
    if isinstance(to, str) and not lossless:
        # fail fast on a bad name, before touching the model
        _resolve_name(to, "convert", "to", also="None, 'normscope', 'torch' or ")
    elif to is not None and not isinstance(to, str) and not callable(to):
        raise TypeError(
            "convert: expected `to` to be None, 'normscope', 'torch' or a normscope.get_norm spec (a name, a class "
            f"or a callable), got {type(to).__name__} {to!r}"
        )
    match = _predicate(where)
    namesakes = _namesakes(reverse=reverse)
    if reverse:
        namesakes = {k: _reverse_builder(v) for k, v in namesakes.items()}
    report = Report()

    def skip(path: str, old: nn.Module, why: str) -> None:
        report.skipped.append(Skipped(path, _describe(old), why))

    def lossless_layer(path: str, old: nn.Module) -> tuple[nn.Module | None, bool]:
        """(new layer or None, whether ``old`` is a foreign layer whose object is kept for the reverse)."""
        source = vars(old).get(_SOURCE)
        if reverse and source is not None:
            return source, False
        cls = type(old).__bases__[0] if _parametrized(old) else type(old)
        make = namesakes.get(cls)
        if make is not None:  # exact torch.nn (or normscope) type: the namesake, proven by the test suite
            return make(old), False
        if reverse:
            if _is_normscope(old):
                skip(path, old, "torch.nn has no layer computing it")
            return None, False
        if _is_normscope(old):
            return None, False  # already normscope
        cand, why = _exact_config(old)
        if cand is None:
            skip(path, old, why)
            return None, False
        return cand.build(old), True

    def other_layer(path: str, old: nn.Module) -> tuple[nn.Module | None, tuple[nn.Module, bool] | None]:
        """(new layer or None, the lossless conversion where ``to`` is the kind ``old`` is: :func:`_same_kind`)."""
        c = channels(old)
        if c is None:  # nothing to size the new layer by (LocalResponseNorm)
            skip(path, old, "no channel count to size the new layer by")
            return None, None
        try:
            built = type(get_norm(to, c, **kwargs))  # which class the spec builds, to learn what it takes
            new = get_norm(to, c, **{**_options(old, built), **kwargs})
        except ValueError as e:  # e.g. group:32 on 6 channels: say which layer of the model it was
            raise ValueError(f"convert: at {_at(path)} ({_describe(old)}): {e}") from None
        same = _same_kind(old, new, kwargs)
        if same is not None:
            return new, same
        if old._modules:  # more than a norm: keep its extra modules only where a probe shows norm-then-modules
            cand, why = _exact_config(old)
            if cand is None or " then " not in cand.label:
                why = why or "they are not applied after the norm"
                skip(path, old, f"it holds modules {list(old._modules)} besides the norm, and {why}")
                return None, None
            new.__class__ = then(type(new))
            for name, child in old._modules.items():
                new.add_module(name, child)
        return new, None

    def replace(path: str, old: nn.Module) -> nn.Module | None:
        if lossless:
            new, keep_source = lossless_layer(path, old)
            if new is None:
                return None
            if vars(old).get(_SOURCE) is new:  # to="torch" of a converted zoo layer: the original comes back
                carried, dropped = _move(path, old, new, only_missing=True)
                new.__dict__.pop(_SOURCE, None)
            else:
                carried, dropped = _move(path, old, new, only_missing=keep_source)
            if keep_source:
                new.__dict__[_SOURCE] = old
        else:
            new, same = other_layer(path, old)
            if new is None:
                return None
            if same is not None:  # the kind it is: converted losslessly
                new, keep_source = same
                if new is old:  # a normscope layer of that kind already: it stays, the same object
                    report.append(Replacement(path, _describe(old), _describe(old), tuple(_state_names(old)), ()))
                    return old
                carried, dropped = _move(path, old, new, only_missing=keep_source)
                if keep_source:
                    new.__dict__[_SOURCE] = old
            else:
                ref = _reference_tensor(old)
                if ref is not None:
                    new = new.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else None)
                carried, dropped = _carry(old, new)
        _move_hooks(old, new)
        new.train(old.training)
        report.append(Replacement(path, _describe(old), _describe(new), carried, dropped))
        return new

    def visit(path: str, m: nn.Module) -> nn.Module | None:
        if match(path, m):
            return replace(path, m)
        if _norm_like(m) and not (to is None and _is_normscope(m)) and not (reverse and not _is_normscope(m)):
            skip(path, m, "not selected by `where`")
        return None

    if match("", model) or _norm_like(model):
        new = visit("", model)
        if new is not None or not list(model.children()):
            return (new if new is not None else model), report
    # one decision per module object: a layer reached by several paths (tied, shared) is judged
    # at its first path and, if replaced, every path gets the same new layer -- the model keeps
    # its sharing (one Replacement in the report, under the first path)
    done: dict[int, nn.Module | None] = {}
    # every new layer is built before the first is put in: a refusal (ValueError) leaves the model as it was
    plan: list[tuple[nn.Module, str, nn.Module]] = []
    # named_modules() lists a shared module once, so a parent shared by two paths is visited once;
    # the list keeps every old module alive, so no id is reused while `done` is consulted
    replaced: set[int] = set()
    for parent_path, parent in list(model.named_modules()):
        if id(parent) in replaced:  # the inside of a replaced layer (a NormAct's activation) moved with it
            continue
        # _modules, not named_children(): that skips a second name of the same child
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = f"{parent_path}.{name}" if parent_path else name
            if id(child) not in done:
                done[id(child)] = visit(path, child)
            new = done[id(child)]
            if new is not None:
                replaced.add(id(child))
                plan.append((parent, name, new))
    for parent, name, new in plan:
        setattr(parent, name, new)
    return model, report


def _reference_tensor(old: nn.Module) -> torch.Tensor | None:
    """The tensor whose device and dtype a new layer of another kind takes: the first floating
    parameter (the weights' dtype, not the fp32 running statistics'), else the first tensor."""
    params = [p for p in old.parameters(recurse=False) if p.is_floating_point()]
    if params:
        return params[0]
    return next(iter(old.buffers(recurse=False)), None)


def _describe(m: nn.Module) -> str:
    cls = type(m)
    return f"{cls.__module__.split('.')[0]}.{cls.__name__}({m.extra_repr()})"
