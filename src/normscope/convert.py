"""Model surgery: replace the normalization layers of any ``nn.Module`` in place.

model, report = normscope.convert(model)                       # torch.nn -> normscope, lossless
model, report = normscope.convert(model, to="group:32", where=torch.nn.BatchNorm2d)
model, report = normscope.convert(model, to="dyt", where=lambda name, m: "encoder" in name)
print(report)
"""

from __future__ import annotations

import inspect
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


def _namesakes() -> dict[type, Callable[[nn.Module], nn.Module]]:
    """Exact torch.nn type -> builder of the normscope layer with the same configuration."""
    from . import modules as M

    # torch >= 2.13 can drop the bias alone (keyword-only ``bias=False``); pass it only then, so
    # older torch versions keep working
    nobias = lambda m, affine: {"bias": False} if affine and getattr(m, "bias", 0) is None else {}  # noqa: E731
    bn = lambda cls: (
        lambda m: cls(  # noqa: E731
            m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats, **nobias(m, m.affine)
        )
    )
    table: dict[type, Callable[[nn.Module], nn.Module]] = {
        nn.BatchNorm1d: bn(M.BatchNorm1d),
        nn.BatchNorm2d: bn(M.BatchNorm2d),
        nn.BatchNorm3d: bn(M.BatchNorm3d),
        nn.InstanceNorm1d: bn(M.InstanceNorm1d),
        nn.InstanceNorm2d: bn(M.InstanceNorm2d),
        nn.InstanceNorm3d: bn(M.InstanceNorm3d),
        nn.LayerNorm: lambda m: M.LayerNorm(m.normalized_shape, m.eps, m.elementwise_affine, m.bias is not None),
        nn.RMSNorm: lambda m: M.RMSNorm(m.normalized_shape, m.eps, m.elementwise_affine),
        nn.GroupNorm: lambda m: M.GroupNorm(m.num_groups, m.num_channels, m.eps, m.affine, **nobias(m, m.affine)),
        nn.LocalResponseNorm: lambda m: M.LocalResponseNorm(m.size, m.alpha, m.beta, m.k),
    }
    try:  # written by another part of the library; optional here
        from .modules.syncbatchnorm import SyncBatchNorm
    except ImportError:
        pass
    else:
        table[nn.SyncBatchNorm] = lambda m: SyncBatchNorm(
            m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats, m.process_group, **nobias(m, m.affine)
        )
    return table


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


def _carry(old: nn.Module, new: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    src = old.state_dict(keep_vars=True)
    dst = new.state_dict(keep_vars=True)
    carried, dropped = [], []
    with torch.no_grad():
        for key, value in src.items():
            if key in dst and dst[key] is not None and value is not None and dst[key].shape == value.shape:
                dst[key].copy_(value)
                carried.append(key)
            else:
                dropped.append(key)
    return tuple(carried), tuple(dropped)


def _build(old: nn.Module, to: NormSpec | None, namesakes: dict, kwargs: dict) -> nn.Module | None:
    if to is None or to == "normscope":
        make = namesakes.get(type(old))  # exact type: a subclass (BatchRenorm...) is not its base
        return None if make is None else make(old)
    c = _channels(old)
    if c is None:  # nothing to size the new layer by (LocalResponseNorm)
        return None
    return get_norm(to, c, **kwargs)


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
            namesake with the same configuration and state -- lossless, outputs are identical.
            Otherwise a :func:`normscope.get_norm` spec (``"group:32"``, ``"layer2d"``, ``"frozen"``, a
            class, a partial), built with the old layer's channel count and ``**kwargs``.
        where: which layers to replace: a type or tuple of types (``isinstance``), or a predicate
            ``f(module)`` or ``f(path, module)``. Default: every normalization layer
            (torch.nn's and normscope's).
        **kwargs: constructor arguments for ``to``.

    Returns:
        ``(model, report)``: the same model (the new layer itself when ``model`` is a norm layer)
        and a :class:`Report` listing each replaced path, old -> new, and which state entries
        (parameters and buffers with the same name and shape) were carried or dropped. The new
        layer gets the old one's device, floating dtype and train/eval mode.

    Example::

        >>> model, report = normscope.convert(torchvision.models.resnet18(), to="group:32")
        >>> print(report)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(to, str) and to != "normscope":
        _resolve_name(to)  # fail fast on a bad name, before touching the model
    match = _predicate(where)
    namesakes = _namesakes() if to is None or to == "normscope" else {}
    report = Report()

    def replace(path: str, old: nn.Module) -> nn.Module | None:
        new = _build(old, to, namesakes, kwargs)
        if new is None:
            return None
        ref = next(iter(old.state_dict().values()), None)
        if ref is not None:
            new = new.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else None)
        carried, dropped = _carry(old, new)
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
                setattr(parent, name, new)
    return model, report


def _describe(m: nn.Module) -> str:
    cls = type(m)
    return f"{cls.__module__.split('.')[0]}.{cls.__name__}({m.extra_repr()})"
