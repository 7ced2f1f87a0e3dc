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
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from .registry import NormSpec, _resolve_name, get_norm

__all__ = ["convert", "Replacement", "Report"]


class Replacement(NamedTuple):
    """One replaced layer: its path in the model, the old and new layer (their reprs), the state
    entries carried over, and those of the old layer that the new one has no place for."""

    path: str
    source: str
    target: str
    carried: tuple[str, ...]
    dropped: tuple[str, ...]


class Report(list):
    """The list of :class:`Replacement`; ``str(report)`` is a readable table."""

    def __str__(self) -> str:
        if not self:
            return "convert: no layer replaced"
        lines = [f"convert: {len(self)} layer(s) replaced"]
        for r in self:
            lines.append(f"  {r.path or '<root>'}: {r.source} -> {r.target}")
            dropped = f"; dropped: {', '.join(r.dropped)}" if r.dropped else ""
            lines.append(f"      carried: {', '.join(r.carried) or '-'}{dropped}")
        return "\n".join(lines)


def _pairs() -> list[tuple[type, type]]:
    """(torch.nn class, its normscope namesake): the same constructor, parameters and buffers."""
    from . import modules as M

    pairs = [
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
    ]
    try:  # written by another part of the library; optional here
        from .modules.syncbatchnorm import SyncBatchNorm
    except ImportError:
        pass
    else:
        pairs.append((nn.SyncBatchNorm, SyncBatchNorm))
    return pairs


def _builder(cls: type) -> Callable[[nn.Module], nn.Module]:
    """A builder of ``cls`` with the configuration of a layer of its namesake (either direction).

    Built on the meta device: every tensor is replaced by the old layer's own (:func:`_move`)."""
    # torch >= 2.13 can drop the bias alone (keyword-only ``bias=False``); pass it only then, so
    # older torch versions keep working
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
    )


def _channels(m: nn.Module) -> int | None:
    for attr in ("num_features", "num_channels"):
        v = getattr(m, attr, None)
        if isinstance(v, int):
            return v
    shape = getattr(m, "normalized_shape", None)
    if shape:
        return int(shape[-1])
    return None


def _predicate(where: Any) -> Callable[[str, nn.Module], bool]:
    if where is None:
        types = _norm_types()
        return lambda name, m: isinstance(m, types)
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


_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _move_hooks(old: nn.Module, new: nn.Module) -> None:
    """The old layer's hooks onto the new one. The dicts themselves move when the new layer has no
    hook of its own (always, for the built-in layers), so the user's RemovableHandles still remove them."""
    for attr in _HOOKS:
        mine, theirs = getattr(new, attr, None), getattr(old, attr, None)
        if not isinstance(theirs, dict) or not theirs:
            continue
        if not mine:
            setattr(new, attr, theirs)
        else:  # the new layer's own hooks first, then the old ones (their handles no longer reach them)
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
            legacy = {"WeightNorm": "weight_norm", "SpectralNorm": "spectral_norm"}
            found = [legacy[type(h).__name__] for h in old._forward_pre_hooks.values() if type(h).__name__ in legacy]
            hint = f" (torch.nn.utils.{found[0]} is applied: remove it first)" if found else ""
            raise ValueError(
                f"{where}: expected {label} {sorted(want)} for a lossless conversion to {type(new).__name__}, "
                f"got {sorted(have)}{hint}; leave this layer out with `where=`"
            )


def _move(path: str, old: nn.Module, new: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Lossless: the old layer's own Parameter and buffer objects (and None entries) into ``new``."""
    _refuse_unmovable(path, old, new)
    for name, p in old._parameters.items():
        new.register_parameter(name, p)
    for name, b in old._buffers.items():
        new.register_buffer(name, b, persistent=name not in old._non_persistent_buffers_set)
    for name, value in vars(old).items():  # configuration changed after construction, user attributes
        if not name.startswith("_") and name != "training":
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
        return make(m)

    return build


def _build(old: nn.Module, to: NormSpec | None, namesakes: dict, kwargs: dict) -> nn.Module | None:
    if to is None or to in ("normscope", "torch"):
        # exact type: a subclass (BatchRenorm...) is not its base; a parametrized layer is refused later
        cls = type(old).__bases__[0] if _parametrized(old) else type(old)
        make = namesakes.get(cls)
        return None if make is None else make(old)
    c = _channels(old)
    if c is None:  # nothing to size the new layer by (LocalResponseNorm)
        return None
    return get_norm(to, c, **kwargs)


def _parametrized(m: nn.Module) -> bool:
    from torch.nn.utils import parametrize

    return parametrize.is_parametrized(m)


def convert(
    model: nn.Module,
    to: NormSpec | None = None,
    where: type | tuple[type, ...] | Callable[..., bool] | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, Report]:
    """Replace normalization layers of ``model`` in place, carrying their state.

    Args:
        model: any module.
        to: ``None`` (or ``"normscope"``): every ``torch.nn`` norm layer becomes its normscope
            namesake with the same configuration and state -- lossless (module docstring): the same
            tensor objects, hooks and mode; outputs are identical. ``"torch"``: the reverse, every
            normscope layer with a torch.nn namesake becomes it, as losslessly (a BatchNorm1d with
            ``channel_dim=-1`` is refused: torch has no such layer). Otherwise a
            :func:`normscope.get_norm` spec (``"group:32"``, ``"layer2d"``, ``"frozen"``, a class, a
            partial), built with the old layer's channel count and ``**kwargs``; the state entries
            that fit move as objects (dtype and ``requires_grad`` kept), the hooks move too.
        where: which layers to replace: a type or tuple of types (``isinstance``), or a predicate
            ``f(module)`` or ``f(path, module)``. Default: every normalization layer
            (torch.nn's and normscope's).
        **kwargs: constructor arguments for ``to``.

    Returns:
        ``(model, report)``: the same model (the new layer itself when ``model`` is a norm layer)
        and a :class:`Report` listing each replaced path, old -> new, and which state entries
        (parameters and buffers with the same name and shape) were carried or dropped. The new
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
    if isinstance(to, str) and not lossless:
        _resolve_name(to)  # fail fast on a bad name, before touching the model
    match = _predicate(where)
    namesakes: dict = {}
    if lossless:
        namesakes = _namesakes(reverse=to == "torch")
        if to == "torch":
            namesakes = {k: _reverse_builder(v) for k, v in namesakes.items()}
    report = Report()

    def replace(path: str, old: nn.Module) -> nn.Module | None:
        new = _build(old, to, namesakes, kwargs)
        if new is None:
            return None
        if lossless:
            carried, dropped = _move(path, old, new)
        else:
            ref = _reference_tensor(old)
            if ref is not None:
                new = new.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else None)
            carried, dropped = _carry(old, new)
        _move_hooks(old, new)
        new.train(old.training)
        report.append(Replacement(path, _describe(old), _describe(new), carried, dropped))
        return new

    if match("", model):
        new = replace("", model)
        return (new if new is not None else model), report
    # one decision per module object: a layer reached by several paths (tied, shared) is judged
    # at its first path and, if replaced, every path gets the same new layer -- the model keeps
    # its sharing (one Replacement in the report, under the first path)
    done: dict[int, nn.Module | None] = {}
    # every new layer is built before the first is put in: a refusal (ValueError) leaves the model as it was
    plan: list[tuple[nn.Module, str, nn.Module]] = []
    # named_modules() lists a shared module once, so a parent shared by two paths is visited once;
    # the list keeps every old module alive, so no id is reused while `done` is consulted
    for parent_path, parent in list(model.named_modules()):
        # _modules, not named_children(): that skips a second name of the same child
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = f"{parent_path}.{name}" if parent_path else name
            if id(child) not in done:
                done[id(child)] = replace(path, child) if match(path, child) else None
            new = done[id(child)]
            if new is not None:
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
